"""fused_moe: routing preparation, the two Triton stages and the op, against a float32
expert-by-expert reference (CPU: Triton's interpreter at tiny sizes; GPU: real model shapes)."""

from __future__ import annotations

import pytest
import torch

import gemmtune
from gemmtune.families.fmoe.op import DISPATCH, SCHEMA, expert_map_of
from gemmtune.kernels.problem import Activation, MoeProblem
from gemmtune.kernels.torch_ref import fused_moe_ref
from gemmtune.kernels.triton.moe_configs import MoeStage1Config, MoeStage2Config
from gemmtune.tables.lookup import Rule
from gemmtune.tables.store import read_table
from gemmtune.tables.values import ActivationType, QuantType

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 output rounding (2^-9) and a bf16 intermediate between the stages: ~4e-3 in norm.
REL_BOUND = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def moe_inputs(tokens, model_dim, inter_dim, experts, topk, dtype=torch.float32, seed=0,
               route=None, global_experts=None):
    """Fresh random weights and activations; top-k routing without repeats per token over the
    global experts (``route``: a fixed (tokens, topk) list of expert ids instead)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    global_experts = global_experts or experts

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)

    hidden = randn(tokens, model_dim)
    w1 = randn(experts, 2 * inter_dim, model_dim, scale=model_dim ** -0.5)
    w2 = randn(experts, model_dim, inter_dim, scale=inter_dim ** -0.5)
    if route is None:
        scores = torch.rand(tokens, global_experts, generator=gen, device=DEVICE)
        topk_ids = scores.topk(topk, dim=1).indices.to(torch.int32)
    else:
        topk_ids = torch.tensor(route, dtype=torch.int32, device=DEVICE).reshape(tokens, topk)
    topk_weight = torch.rand(tokens, topk, generator=gen, device=DEVICE) + 0.1
    return hidden, w1, w2, topk_weight, topk_ids


def rel_err(y, ref):
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------ routing preparation
@pytest.mark.parametrize("tokens, topk, experts, block_m, local", [
    (9, 3, 6, 1, None),  # block_m 1: runs without padding (the grouped-GEMM backend's)
    (13, 2, 4, 16, None),  # tokens not a multiple of block_m
    (5, 4, 4, 16, None),  # topk = E
    (9, 2, 8, 32, [1, 0, 1, 1, 0, 0, 1, 0]),  # expert parallelism: 4 of 8 experts here
    (1, 1, 6, 64, None),  # one pair: five experts without a token
    (45, 3, 5, 16, None),  # spread: 17 programs of 8, offsets over two steps of 16
    (300, 2, 3, 64, [1, 0, 1]),  # 600 pairs: a span of 1024 lanes in one program
])
@pytest.mark.parametrize("pairs_per_program", [1024, 8])  # one launch; spread over programs
def test_routing_groups_every_local_pair_once_in_order(tokens, topk, experts, block_m, local,
                                                       pairs_per_program):
    from gemmtune.kernels.triton.moe_routing import max_rows, moe_routing

    *_, topk_ids = moe_inputs(tokens, 8, 8, experts, topk, seed=tokens)
    mask = None if local is None else torch.tensor(local, dtype=torch.bool, device=DEVICE)
    local_count = experts if mask is None else int(mask.sum())
    expert_map = expert_map_of(mask, local_count, topk_ids.device)
    routing = moe_routing(topk_ids, expert_map, local_count, block_m,
                          pairs_per_program=pairs_per_program)
    pairs = tokens * topk
    local_of = expert_map[topk_ids.reshape(-1).long()].tolist()
    sorted_ids = routing.sorted_ids.tolist()
    block_expert = routing.block_expert.tolist()
    assert len(sorted_ids) == max_rows(pairs, local_count, block_m)
    rows_used = routing.rows_used.item()
    assert rows_used % block_m == 0
    block_rows = routing.block_rows.tolist()
    want, row = [], 0
    for e in range(local_count):
        mine = [i for i in range(pairs) if local_of[i] == e]  # in pair order: stable
        padded = -(-len(mine) // block_m) * block_m
        want += mine + [None] * (padded - len(mine))  # padding rows: unset, never read
        blocks = slice(row // block_m, (row + padded) // block_m)
        assert block_expert[blocks] == [e] * (padded // block_m)
        # The real rows of the expert's blocks: full ones, then the rest of its pairs.
        assert block_rows[blocks] == [min(block_m, len(mine) - b * block_m)
                                      for b in range(padded // block_m)]
        row += padded
        assert routing.expert_ends[e].item() == row  # a grouped GEMM's offsets
    assert rows_used == row  # what lies past is never read
    placed = [(got, w) for got, w in zip(sorted_ids, want) if w is not None]
    assert len(want) == rows_used and all(got == w for got, w in placed)


# ----------------------------------------------------------------------------- the kernels
TWO_STAGE = "triton.moe1:BM16.BN16.BK16.W4.S1+triton.moe2:BM16.BN16.BK16.SK{sk}.W4.S1"
# One block per routed pair, no routing preparation.
PAIR_BLOCKS = TWO_STAGE.replace(".S1+", ".S1.PB1+") + ".PB1"
# A persistent stage 2 reads whole tiles of the intermediate, padding rows (never written) too:
# their products land only in rows it does not store, but the interpreter's numpy may warn
# about what the unwritten memory holds.
UNWRITTEN_ROWS_WARNINGS = "ignore:(invalid value|overflow) encountered in:RuntimeWarning"
# Both stages persistent, through TMA (split-K is not theirs: every case runs SK1).
PERSISTENT = ("triton.moe1:BM16.BN16.BK16.W4.S1.PB0.P1"
              "+triton.moe2:BM16.BN16.BK16.SK1.W4.S1.PB0.P1")
FLATTENED = PERSISTENT.replace(".P1", ".P2")  # the tile loop flattened into the K loop
# Tiles of 16 and steps of 16 on both stages: ragged tiles and steps below.
ONE_STAGE = "triton.moe_1stage:BN16.BK16.BD16.BI16.W4.S1"
# Chunks of 16 columns and steps of 16 on both stages: ragged chunks and steps below.
STREAM = "triton.moe_stream:BN16.BK16.BD16.BI16.W4"
GROUPED_MM = "triton.moe_gmm"
KERNEL_CASES = [
    # tokens, model_dim, inter_dim, experts, topk, activation, doweight_stage1, split_k, route
    (7, 40, 24, 4, 2, "Silu", False, 1, None),
    (3, 48, 40, 5, 5, "Gelu", True, 2, None),  # topk = E, GELU, weight in stage 1, split-K
    (6, 32, 16, 4, 1, "Silu", False, 1, [2] * 6),  # every token to one expert
]


# Every routing case in bf16; the dtypes' loads, dots and stores (the same code whatever the
# routing) on the first case.
DTYPE_CASES = [(torch.bfloat16, case) for case in KERNEL_CASES] \
    + [(dtype, KERNEL_CASES[0]) for dtype in (torch.float32, torch.float16)]


@pytest.mark.filterwarnings(UNWRITTEN_ROWS_WARNINGS)
@pytest.mark.parametrize("dtype,case", DTYPE_CASES)
@pytest.mark.parametrize("solution", [TWO_STAGE, PAIR_BLOCKS, ONE_STAGE, STREAM, PERSISTENT,
                                      FLATTENED])
def test_the_kernels_match_the_reference(dtype, case, solution):
    from gemmtune.families.fmoe.op import REGISTRY, problem_of

    tokens, model_dim, inter_dim, experts, topk, act, dw1, split_k, route = case
    hidden, w1, w2, weight, ids = moe_inputs(tokens, model_dim, inter_dim, experts, topk, dtype,
                                             seed=tokens, route=route)
    name = solution.format(sk=split_k)
    key = DISPATCH.to_table_key((tokens, model_dim, inter_dim, experts, topk, dtype,
                              ActivationType.from_str(act), dw1))
    problem = problem_of(key)
    kernel = REGISTRY.resolve_for(name, problem)
    expert_map = expert_map_of(None, experts, hidden.device)
    out = torch.full_like(hidden, float("nan"))  # every element must be written
    assert kernel(hidden, w1, w2, weight, ids, expert_map, problem, out=out) is out
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map, act.lower(), dw1)
    assert torch.isfinite(out).all() and rel_err(out, ref) < REL_BOUND[dtype]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_the_grouped_mm_backend_matches_the_reference_in_bf16(case):
    # Our routing, gather, activation and combine around torch._grouped_mm (bf16 only).
    from gemmtune.families.fmoe.op import REGISTRY, problem_of

    tokens, model_dim, inter_dim, experts, topk, act, dw1, _, route = case
    hidden, w1, w2, weight, ids = moe_inputs(tokens, model_dim, inter_dim, experts, topk,
                                             torch.bfloat16, seed=tokens, route=route)
    key = DISPATCH.to_table_key((tokens, model_dim, inter_dim, experts, topk, torch.bfloat16,
                                 ActivationType.from_str(act), dw1))
    kernel = REGISTRY.resolve_for(GROUPED_MM, problem_of(key))
    expert_map = expert_map_of(None, experts, DEVICE)
    out = torch.full_like(hidden, float("nan"))  # every element must be written
    assert kernel(hidden, w1, w2, weight, ids, expert_map, problem_of(key), out=out) is out
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map, act.lower(), dw1)
    assert rel_err(out, ref) < REL_BOUND[torch.bfloat16]


def test_the_grouped_mm_backend_skips_pairs_of_other_ranks():
    mask = torch.tensor([False, True, False, True, True, False], device=DEVICE)
    hidden, w1, w2, weight, ids = moe_inputs(9, 32, 24, 3, 2, torch.bfloat16, seed=5,
                                             global_experts=6)
    ids[0] = torch.tensor([0, 2], dtype=torch.int32)  # token 0: only other ranks' experts
    y = gemmtune.fused_moe(hidden, w1, w2, weight, ids, expert_mask=mask, kernel=GROUPED_MM)
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map_of(mask, 3, DEVICE))
    assert rel_err(y, ref) < REL_BOUND[torch.bfloat16]
    assert torch.equal(y[0], torch.zeros_like(y[0]))


def test_the_grouped_mm_backend_refuses_what_torch_grouped_mm_cannot_run():
    from gemmtune.families.fmoe.op import REGISTRY
    from gemmtune.kernels.problem import Activation, MoeProblem

    kernel = REGISTRY.resolve(GROUPED_MM)
    fp16 = MoeProblem(4, 64, 32, 4, 2, torch.float16, Activation.silu, False)
    ragged = MoeProblem(4, 60, 32, 4, 2, torch.bfloat16, Activation.silu, False)
    assert "bfloat16" in kernel.check(fp16) and "multiples of 8" in kernel.check(ragged)
    with pytest.raises(ValueError, match="no config"):
        REGISTRY.resolve(GROUPED_MM + ":BM16")


@pytest.mark.filterwarnings(UNWRITTEN_ROWS_WARNINGS)
def test_persistent_and_plain_stages_pair_over_one_intermediate():
    # The intermediate follows the routing's rows for both: either stage may be persistent.
    from gemmtune.families.fmoe.op import REGISTRY, problem_of

    first, second = PERSISTENT.split("+")
    plain_first, plain_second = TWO_STAGE.format(sk=1).split("+")
    hidden, w1, w2, weight, ids = moe_inputs(9, 40, 24, 4, 2, seed=11)
    key = DISPATCH.to_table_key((9, 40, 24, 4, 2, torch.float32, ActivationType.Silu, False))
    problem = problem_of(key)
    emap = expert_map_of(None, 4, hidden.device)
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, emap)
    for name in (f"{first}+{plain_second}", f"{plain_first}+{second}"):
        out = torch.full_like(hidden, float("nan"))
        REGISTRY.resolve_for(name, problem)(hidden, w1, w2, weight, ids, emap, problem, out=out)
        assert rel_err(out, ref) < REL_BOUND[torch.float32], name


def test_persistent_stages_refuse_rows_tma_cannot_read():
    from gemmtune.families.fmoe.op import REGISTRY

    kernel = REGISTRY.resolve(PERSISTENT)
    ragged = MoeProblem(4, 60, 32, 4, 2, torch.bfloat16, Activation.silu, False)
    assert "rows of 60 elements" in kernel.check(ragged) and "TMA" in kernel.check(ragged)
    assert kernel.check(MoeProblem(4, 64, 32, 4, 2, torch.bfloat16, Activation.silu,
                                   False)) is None
    # Each stage needs its own rows aligned: stage 1 model_dim (w1), stage 2 inter_dim.
    plain_first, plain_second = TWO_STAGE.format(sk=1).split("+")
    first, second = PERSISTENT.split("+")
    ragged_inter = MoeProblem(4, 64, 36, 4, 2, torch.bfloat16)
    assert REGISTRY.resolve(f"{first}+{plain_second}").check(ragged_inter) is None
    assert "rows of 36" in REGISTRY.resolve(f"{plain_first}+{second}").check(ragged_inter)
    assert "must be 0, 1 or 2" in REGISTRY.resolve(PERSISTENT.replace(".P1", ".P3")).check(ragged)
    split = PERSISTENT.replace("SK1", "SK2")
    aligned_split = REGISTRY.resolve(split).check(MoeProblem(4, 64, 32, 4, 2, torch.bfloat16))
    assert "split_k=1" in aligned_split
    hidden, w1, w2, weight, ids = moe_inputs(4, 32, 16, 4, 2, seed=2)
    w1_strided = w1.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other layout
    with pytest.raises(ValueError, match="w1 through TMA: it must be contiguous"):
        gemmtune.fused_moe(hidden, w1_strided, w2, weight, ids, kernel=PERSISTENT)


def poison_empty(monkeypatch):
    """From here on torch.empty fills what it makes with NaN (int32: 2**30): what a kernel
    leaves unwritten, and then uses, shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(2 ** 30) if t.dtype == torch.int32 else t.fill_(float("nan"))
    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.filterwarnings(UNWRITTEN_ROWS_WARNINGS)
@pytest.mark.parametrize("speculate", [True, False])
def test_the_sum_never_uses_rows_of_other_ranks_experts(speculate, monkeypatch):
    # Few tokens: the sum loads every slot's row before it knows which are local (the rows of
    # other ranks' experts, never written, poisoned here); many: only the local ones.
    from gemmtune.families.fmoe.op import REGISTRY, problem_of
    from gemmtune.kernels.triton import moe_stages

    monkeypatch.setattr(moe_stages, "SPECULATIVE_SUM_TOKENS", 64 if speculate else 0)
    mask = torch.zeros(8, dtype=torch.bool, device=DEVICE)
    mask[[2, 5]] = True
    hidden, w1, w2, weight, ids = moe_inputs(4, 32, 16, 2, 2, seed=3,
                                             route=[2, 0, 5, 2, 1, 7, 0, 5])
    emap = expert_map_of(mask, 2, hidden.device)
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, emap)
    problem = problem_of(DISPATCH.to_table_key((4, 32, 16, 2, 2, torch.float32,
                                                ActivationType.Silu, False)))
    poison_empty(monkeypatch)
    for name in (TWO_STAGE.format(sk=1), PAIR_BLOCKS.format(sk=1)):
        out = torch.full_like(hidden, float("nan"))
        REGISTRY.resolve_for(name, problem)(hidden, w1, w2, weight, ids, emap, problem, out=out)
        assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-4, name
        assert torch.equal(out[2], torch.zeros_like(out[2])), name  # experts 1 and 7: elsewhere


@pytest.mark.filterwarnings(UNWRITTEN_ROWS_WARNINGS)
def test_padding_rows_and_unset_routing_entries_are_never_read(monkeypatch):
    # The routing leaves padding rows of sorted_ids (and blocks past the rows used) unset, and
    # stage 1 leaves the intermediate's padding rows unwritten: poison every such buffer so a
    # missing mask shows up as a wrong or non-finite result.
    from gemmtune.families.fmoe.op import REGISTRY, problem_of

    hidden, w1, w2, weight, ids = moe_inputs(9, 40, 24, 4, 2, seed=12)
    key = DISPATCH.to_table_key((9, 40, 24, 4, 2, torch.float32, ActivationType.Silu, False))
    problem = problem_of(key)
    emap = expert_map_of(None, 4, hidden.device)
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, emap)
    poison_empty(monkeypatch)
    for name in (TWO_STAGE.format(sk=1), PERSISTENT, FLATTENED):
        out = torch.full_like(hidden, float("nan"))
        REGISTRY.resolve_for(name, problem)(hidden, w1, w2, weight, ids, emap, problem, out=out)
        assert torch.isfinite(out).all() and rel_err(out, ref) < REL_BOUND[torch.float32], name


def test_routing_writes_sentinels_into_padding_rows_on_request():
    from gemmtune.kernels.triton.moe_routing import moe_routing

    *_, ids = moe_inputs(5, 8, 8, 4, 2, seed=4)
    routing = moe_routing(ids, expert_map_of(None, 4, ids.device), 4, 16, sentinels=True)
    rows_used = routing.rows_used.item()
    real = [row for b in range(rows_used // 16) for row in range(b * 16, b * 16 + 16)
            if row - b * 16 < routing.block_rows[b].item()]
    padding = sorted(set(range(rows_used)) - set(real))
    assert len(real) == 10 and padding  # 10 pairs over 4 experts: some rows pad
    assert all(routing.sorted_ids[row].item() == 10 for row in padding)


@pytest.mark.filterwarnings(UNWRITTEN_ROWS_WARNINGS)
def test_pairs_routed_to_another_rank_add_nothing():
    # 8 global experts, experts 2 and 5 here; a token routed only elsewhere gets zeros.
    mask = torch.zeros(8, dtype=torch.bool, device=DEVICE)
    mask[[2, 5]] = True
    route = [2, 0, 5, 2, 1, 7, 0, 5]
    hidden, w1, w2, weight, ids = moe_inputs(4, 32, 16, 2, 2, seed=3, route=route)
    for kernel in (TWO_STAGE.format(sk=1), PAIR_BLOCKS.format(sk=1), ONE_STAGE, STREAM,
                   PERSISTENT, "torch.moe"):
        y = gemmtune.fused_moe(hidden, w1, w2, weight, ids, expert_mask=mask, kernel=kernel)
        ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map_of(mask, 2, hidden.device))
        assert rel_err(y, ref) < 1e-4, kernel
        assert torch.equal(y[2], torch.zeros_like(y[2])), kernel  # experts 1 and 7: elsewhere


@pytest.mark.parametrize("kernel", [ONE_STAGE, STREAM])
def test_one_launch_kernels_leave_their_workspace_zero_for_the_next_call(kernel):
    # Their counters (and the 1-stage kernel's sums) are zero before a launch and must be again
    # after it: a second call on new routing through the same cached workspace is right only if
    # the first cleaned up.
    from gemmtune.kernels.triton import moe_one_stage, moe_stream
    from gemmtune.kernels.triton.moe_common import cached_workspaces

    module = moe_one_stage if kernel == ONE_STAGE else moe_stream
    mask = torch.tensor([True, False, True, True, True], device=DEVICE)
    emap = expert_map_of(mask, 4, DEVICE)
    for seed, route in ((1, None), (2, [0, 2, 3, 4, 2, 0, 1, 3, 4, 0]), (3, None)):
        hidden, w1, w2, weight, ids = moe_inputs(5, 48, 24, 4, 2, seed=seed, route=route,
                                                 global_experts=5)  # experts 0, 2, 3, 4 here
        y = gemmtune.fused_moe(hidden, w1, w2, weight, ids, expert_mask=mask, kernel=kernel)
        assert rel_err(y, fused_moe_ref(hidden, w1, w2, weight, ids, emap)) < 1e-4
        (ws,) = [w for w in cached_workspaces(module.WORKSPACE_KIND) if w.inter.shape[0] == 10]
        counters = [ws.ready] + ([ws.acc, ws.done, ws.converted] if kernel == ONE_STAGE
                                 else [ws.exited])
        assert not any(c.any() for c in counters)


@pytest.mark.parametrize("kernel, speculate", [(TWO_STAGE.format(sk=2), True),
                                               (PAIR_BLOCKS.format(sk=2), False)])
def test_split_stage_2_leaves_its_streams_partials_zero_for_the_next_call(kernel, speculate,
                                                                          monkeypatch):
    # Split stage 2 adds its parts into the stream's fp32 rows; the sum zeroes what it read
    # (every slot's row, whether or not it loaded it before knowing the expert is local), so the
    # next call (new routing, a rank without some experts, fewer pairs) starts from zero.
    from gemmtune.kernels.triton import moe_stages
    from gemmtune.kernels.triton.moe_common import cached_workspaces

    monkeypatch.setattr(moe_stages, "SPECULATIVE_SUM_TOKENS", 64 if speculate else 0)
    mask = torch.tensor([True, False, True, True, True], device=DEVICE)
    emap = expert_map_of(mask, 4, DEVICE)
    for seed, tokens, route in ((4, 5, None), (5, 5, [0, 2, 3, 4, 2, 0, 1, 3, 4, 0]),
                                (6, 3, None), (7, 5, None)):
        hidden, w1, w2, weight, ids = moe_inputs(tokens, 48, 24, 4, 2, seed=seed, route=route,
                                                 global_experts=5)
        y = gemmtune.fused_moe(hidden, w1, w2, weight, ids, expert_mask=mask, kernel=kernel)
        assert rel_err(y, fused_moe_ref(hidden, w1, w2, weight, ids, emap)) < 1e-4
        (partials,) = [w for w in cached_workspaces(moe_stages.PARTIALS_KIND)
                       if w.shape[1] == 48]
        assert partials.shape[0] >= 10 and not partials.any()


def test_split_stage_2_past_the_kept_size_takes_zeros_of_its_own(monkeypatch):
    from gemmtune.kernels.triton import moe_stages
    from gemmtune.kernels.triton.moe_common import cached_workspaces

    monkeypatch.setattr(moe_stages, "KEPT_PARTIALS_BYTES", 4 * 40 * 4 - 1)  # < 4 pairs x D=40
    kept = [id(w) for w in cached_workspaces(moe_stages.PARTIALS_KIND)]
    for seed in (8, 9):
        hidden, w1, w2, weight, ids = moe_inputs(2, 40, 24, 4, 2, seed=seed)
        y = gemmtune.fused_moe(hidden, w1, w2, weight, ids, kernel=TWO_STAGE.format(sk=2))
        ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map_of(None, 4, DEVICE))
        assert rel_err(y, ref) < 1e-4
    assert [id(w) for w in cached_workspaces(moe_stages.PARTIALS_KIND)] == kept


@pytest.mark.parametrize("act, dw1, local", [("Silu", False, None),
                                             ("Gelu", True, [1, 0, 1, 1, 0])])
def test_the_torch_backend_in_bf16_takes_the_grouped_gemm_path(act, dw1, local, monkeypatch):
    """bf16 with 8-aligned dims runs ``torch._grouped_mm`` (not the fp32 reference): with pairs of
    other ranks' experts sorted past the last group and zeroed, ragged groups, an empty expert."""
    from gemmtune.kernels import torch_ref

    mask = None if local is None else torch.tensor(local, dtype=torch.bool, device=DEVICE)
    experts = 5 if mask is None else int(mask.sum())
    route = [0, 3, 3, 1, 0, 4, 3, 0, 1, 3, 4, 0, 3, 1]  # expert 2 gets no token
    hidden, w1, w2, weight, ids = moe_inputs(7, 32, 24, experts, 2, torch.bfloat16, seed=5,
                                             route=route)
    expert_map = expert_map_of(mask, experts, hidden.device)
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map, act.lower(), dw1)

    def no_reference(*args, **kwargs):
        raise AssertionError("the bf16 torch backend fell back to the fp32 reference")

    monkeypatch.setattr(torch_ref, "fused_moe_ref", no_reference)
    y = gemmtune.fused_moe(hidden, w1, w2, weight, ids, activation=getattr(ActivationType, act),
                           doweight_stage1=dw1, expert_mask=mask, kernel="torch.moe")
    assert torch.isfinite(y).all() and rel_err(y, ref) < REL_BOUND[torch.bfloat16]


# --------------------------------------------------------------------------------- the op
def test_the_op_defaults_to_torch_on_the_cpu_and_follows_a_table_row(tmp_path, monkeypatch):
    hidden, w1, w2, weight, ids = moe_inputs(5, 32, 16, 4, 2, seed=1)
    expert_map = expert_map_of(None, 4, hidden.device)
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map)
    assert rel_err(gemmtune.fused_moe(hidden, w1, w2, weight, ids), ref) < 1e-4
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.default
    assert plan.decision.kernel_name == ("torch.moe" if DEVICE == "cpu" else
                                         plan.decision.kernel_name)
    header = ("arch,cu_num,token,model_dim,inter_dim,expert,topk,act_type,dtype,q_dtype_a,"
              "q_dtype_w,q_type,use_g1u1,doweight_stage1,block_m,ksplit,us1,kernelName1,err1,us2,"
              "kernelName2,err2,us,run_1stage\n")
    stage1, stage2 = TWO_STAGE.format(sk=1).split("+")
    dev = gemmtune.current_device()
    path = tmp_path / "tuned_fmoe.csv"
    path.write_text(header + f"{dev.arch},{dev.cu_num},5,32,16,4,2,ActivationType.Silu,"
                    f"dtypes.fp32,dtypes.fp32,dtypes.fp32,QuantType.No,True,False,16,1,1.0,"
                    f"{stage1},0.5%,1.0,{stage2},0.1%,2.0,0\n")
    monkeypatch.setenv("GEMMTUNE_CONFIG_FMOE", f"replace:{path}")
    gemmtune.reset()
    assert rel_err(gemmtune.fused_moe(hidden, w1, w2, weight, ids), ref) < 1e-4
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact and plan.decision.kernel_name == f"{stage1}+{stage2}"
    assert gemmtune.report_misses() == []

    # A row the 1-stage kernel won names it alone (run_1stage 1), and dispatch runs it.
    path.write_text(header + f"{dev.arch},{dev.cu_num},5,32,16,4,2,ActivationType.Silu,"
                    f"dtypes.fp32,dtypes.fp32,dtypes.fp32,QuantType.No,True,False,0,0,1.0,"
                    f"{ONE_STAGE},0.1%,0.0,,0.0,1.0,1\n")
    gemmtune.reset()
    assert rel_err(gemmtune.fused_moe(hidden, w1, w2, weight, ids), ref) < 1e-4
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact and plan.decision.kernel_name == ONE_STAGE


def test_the_seeds_untuned_row_parses(tmp_path):
    path = tmp_path / "untuned_fmoe.csv"
    path.write_text("token,model_dim,inter_dim,expert,topk,act_type,dtype,q_dtype_a,q_dtype_w,"
                    "q_type,use_g1u1,doweight_stage1\n1024,4096,14336,8,2,ActivationType.Silu,"
                    "dtypes.bf16,dtypes.fp8,dtypes.fp8,QuantType.per_Token,True,True\n")
    (row,) = read_table(path, SCHEMA, untuned=True).rows
    assert row.key.use_g1u1 is True and row.key.doweight_stage1 is True
    assert row.key.q_type == "QuantType.per_Token" and row.key.q_dtype_w == "torch.float8_e4m3fn"


def test_bad_calls_say_what_is_wrong():
    hidden, w1, w2, weight, ids = moe_inputs(3, 32, 16, 4, 2)
    with pytest.raises(TypeError, match="w1 must be torch.float8_e4m3fn"):  # not quantised
        gemmtune.fused_moe(hidden, w1, w2, weight, ids, quant_type=QuantType.per_Token)
    with pytest.raises(ValueError, match="do not fit hidden"):
        gemmtune.fused_moe(hidden, w1, w2[:, :, :8], weight, ids)
    with pytest.raises(ValueError, match="topk_ids must be int32"):
        gemmtune.fused_moe(hidden, w1, w2, weight, ids.long())
    with pytest.raises(ValueError, match="stage 1 has block_m=16, pair_blocks=0 and stage 2 "
                                         "block_m=32, pair_blocks=0: both run over one routing"):
        gemmtune.fused_moe(hidden, w1, w2, weight, ids, kernel=TWO_STAGE.format(sk=1).replace(
            "moe2:BM16", "moe2:BM32"))
    with pytest.raises(ValueError, match="pair_blocks=1 and stage 2 block_m=16, pair_blocks=0"):
        gemmtune.fused_moe(hidden, w1, w2, weight, ids, kernel=TWO_STAGE.format(sk=1).replace(
            ".S1+", ".S1.PB1+"))
    with pytest.raises(ValueError, match="pair blocks hold one pair each: their block_m is 16"):
        gemmtune.fused_moe(hidden, w1, w2, weight, ids,
                           kernel=PAIR_BLOCKS.format(sk=1).replace("BM16", "BM32"))
    with pytest.raises(ValueError, match="activation ActivationType.Swiglu is not supported"):
        gemmtune.fused_moe(hidden, w1, w2, weight, ids, activation=ActivationType.Swiglu)


def test_eager_calls_of_a_checked_key_take_the_bound_path_and_new_keys_are_checked(monkeypatch):
    from gemmtune.families.fmoe import op

    hidden, w1, w2, weight, ids = moe_inputs(3, 32, 16, 4, 2, seed=21)
    emap = expert_map_of(None, 4, hidden.device)
    gemmtune.reset()
    assert rel_err(gemmtune.fused_moe(hidden, w1, w2, weight, ids),
                   fused_moe_ref(hidden, w1, w2, weight, ids, emap)) < 1e-4
    (miss,) = gemmtune.report_misses()
    assert miss.calls == 1  # the first call is counted once
    run = op.bound_call(hidden, w1, w2, weight, ids)
    assert run is not None and "tf32" in run.chain.refusal  # fp32: never recorded

    def unchecked(*args):
        raise AssertionError("a bound call checks and plans nothing")
    monkeypatch.setattr(op, "_check", unchecked)
    monkeypatch.setattr(op, "_plan", unchecked)
    for seed in (22, 23):  # new tensors, the same key: the bound call
        args = moe_inputs(3, 32, 16, 4, 2, seed=seed)
        assert rel_err(gemmtune.fused_moe(*args), fused_moe_ref(*args, emap)) < 1e-4
    assert len(op._CALLS) == 1 and gemmtune.report_misses()[0].calls == 3
    monkeypatch.undo()
    # Another key goes the checked way again: what is wrong is still said.
    with pytest.raises(ValueError, match="topk_ids must be int32"):
        gemmtune.fused_moe(hidden, w1, w2, weight, ids.long())
    with pytest.raises(ValueError, match="scales are for FP8 experts"):
        gemmtune.fused_moe(hidden, w1, w2, weight, ids, w1_scale=torch.ones(4, 32))
    with pytest.raises(ValueError, match="scales are for FP8 experts"):  # not remembered
        gemmtune.fused_moe(hidden, w1, w2, weight, ids, w1_scale=torch.ones(4, 32))
    with pytest.raises(TypeError, match="hidden must be a torch.Tensor, got list"):  # no key
        gemmtune.fused_moe([[1.0]], w1, w2, weight, ids)
    # Expert parallelism: the map follows each call's mask.
    *_, wide_ids = moe_inputs(3, 32, 16, 6, 2, seed=24)
    for local in ([True, False, True, True, False, True], [False, True, True, True, True, False]):
        mask = torch.tensor(local, device=DEVICE)
        want = fused_moe_ref(hidden, w1, w2, weight, wide_ids, expert_map_of(mask, 4, DEVICE))
        got = gemmtune.fused_moe(hidden, w1, w2, weight, wide_ids, expert_mask=mask)
        assert rel_err(got, want) < 1e-4


def test_custom_op_and_its_fake():
    hidden, w1, w2, weight, ids = moe_inputs(3, 32, 16, 4, 2)
    y = torch.ops.gemmtune.fused_moe(hidden, w1, w2, weight, ids, "Silu", False, None)
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map_of(None, 4, hidden.device))
    assert rel_err(y, ref) < 1e-4
    torch.library.opcheck(torch.ops.gemmtune.fused_moe.default,
                          (hidden, w1, w2, weight, ids, "Silu", False, None))


def test_problem_of_a_key():
    from gemmtune.families.fmoe.op import problem_of

    key = SCHEMA.make_key((16, 64, 32, 8, 2, "ActivationType.Gelu", "torch.bfloat16",
                           "torch.bfloat16", "torch.bfloat16", "QuantType.No", True, True))
    assert problem_of(key) == MoeProblem(16, 64, 32, 8, 2, torch.bfloat16, Activation.gelu, True)


# ---------------------------------------------------------------------------------- the GPU
GPU_ONE_STAGE = "triton.moe_1stage:BN32.BK128.BD64.BI256.W4.S3"
GPU_PAIR_BLOCKS = ("triton.moe1:BM16.BN32.BK128.W4.S3.PB1"
                   "+triton.moe2:BM16.BN64.BK128.SK1.W4.S3.PB1")
GPU_PERSISTENT = ("triton.moe1:BM64.BN128.BK64.W8.S3.PB0.P1"
                  "+triton.moe2:BM64.BN256.BK64.SK1.W8.S3.PB0.P1")
GPU_FLATTENED = GPU_PERSISTENT.replace(".P1", ".P2")
GPU_STREAM = "triton.moe_stream:BN8.BK512.BD8.BI128.W4"

@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 14336, 8, 2), (2048, 768, 128, 8), (7168, 256, 256, 8)])
@pytest.mark.parametrize("tokens", [1, 37, 512])
def test_real_model_shapes_on_the_gpu(shape, tokens):
    model_dim, inter_dim, experts, topk = shape
    hidden, w1, w2, weight, ids = moe_inputs(tokens, model_dim, inter_dim, experts, topk,
                                             torch.bfloat16, seed=tokens)
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map_of(None, experts, hidden.device))
    y = gemmtune.fused_moe(hidden, w1, w2, weight, ids)  # the default Triton pair
    assert rel_err(y, ref) < REL_BOUND[torch.bfloat16]
    torch_y = gemmtune.fused_moe(hidden, w1, w2, weight, ids, kernel="torch.moe")
    assert rel_err(torch_y, ref) < REL_BOUND[torch.bfloat16]
    # The one-launch kernels and pair blocks are for few tokens, torch's grouped GEMM for many.
    few = (GPU_ONE_STAGE, GPU_PAIR_BLOCKS, GPU_STREAM)
    for kernel in few if tokens <= 37 else (GROUPED_MM, GPU_PERSISTENT, GPU_FLATTENED):
        y = gemmtune.fused_moe(hidden, w1, w2, weight, ids, kernel=kernel)
        assert rel_err(y, ref) < REL_BOUND[torch.bfloat16], kernel


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, "torch.moe", GPU_ONE_STAGE, GPU_PAIR_BLOCKS,
                                    GPU_STREAM, GROUPED_MM, GPU_PERSISTENT])
def test_captured_in_a_cuda_graph_and_replayed_on_new_routing(kernel):
    hidden, w1, w2, weight, ids = moe_inputs(64, 2048, 768, 128, 8, torch.bfloat16)
    gemmtune.fused_moe(hidden, w1, w2, weight, ids, kernel=kernel)  # plan, compile: not captured
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemmtune.fused_moe(hidden, w1, w2, weight, ids, kernel=kernel)
    for seed in (5, 6):
        new_hidden, _, _, new_weight, new_ids = moe_inputs(64, 2048, 768, 128, 8,
                                                           torch.bfloat16, seed=seed)
        hidden.copy_(new_hidden), weight.copy_(new_weight), ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map_of(None, 128, hidden.device))
        assert rel_err(y, ref) < REL_BOUND[torch.bfloat16]


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's one config per stage; the GPU "
                    "tunes over the real spaces (gpu_session.sh fmoetune)")
def test_tune_fmoe_on_the_cpu_pairs_the_stages_and_writes_a_row_dispatch_follows(tmp_path,
                                                                                 monkeypatch):
    """The whole tuning path on the interpreter: the stages screened apart (each checked inside
    a whole op), paired by ``compose`` and re-timed end to end; the row names both stages and
    dispatch runs that pair."""
    from gemmtune.cli import main

    untuned = tmp_path / "untuned_fmoe.csv"
    untuned.write_text("token,model_dim,inter_dim,expert,topk,act_type,dtype,q_dtype_a,q_dtype_w,"
                       "q_type,use_g1u1,doweight_stage1\n40,32,16,4,2,ActivationType.Silu,"
                       "torch.float32,torch.float32,torch.float32,QuantType.No,True,False\n")
    tuned, profile = tmp_path / "tuned_fmoe.csv", tmp_path / "profile.csv"
    assert main(["tune", "fmoe", "-i", str(untuned), "-o", str(tuned), "-o2", str(profile),
                 "--iters", "3", "--libtype", "triton", "--routing", "zipf"]) == 0
    (row,) = read_table(tuned, SCHEMA).rows
    screened = [line.split(",") for line in profile.read_text().splitlines()]
    assert screened[0][-1] == "inputs" and len(screened) == 3  # the header and both stages
    assert all(line[-1].startswith("routing=zipf;seed=") for line in screened[1:])
    stage1 = MoeStage1Config(16, 16, 16, 4, 1).name
    stage2 = MoeStage2Config(16, 16, 16, 1, 4, 1).name
    assert {stage1, stage2} <= {field for line in screened for field in line}
    assert (row.results["kernelName1"], row.results["kernelName2"]) == (stage1, stage2)
    assert row.results["block_m"] == 16 and row.results["ksplit"] == 1
    assert row.results["us1"] > 0 and row.results["us2"] > 0 and row.results["us"] > 0
    assert row.results["err1"] <= 0.05 and row.results["err2"] <= 0.05

    assert row.results["run_1stage"] == 0  # 40 tokens: no 1-stage candidate
    monkeypatch.setenv("GEMMTUNE_CONFIG_FMOE", f"replace:{tuned}")
    gemmtune.reset()
    hidden, w1, w2, weight, ids = moe_inputs(40, 32, 16, 4, 2)
    ref = fused_moe_ref(hidden, w1, w2, weight, ids, expert_map_of(None, 4, hidden.device))
    assert rel_err(gemmtune.fused_moe(hidden, w1, w2, weight, ids), ref) < 1e-4
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact
    assert plan.decision.kernel_name == f"{stage1}+{stage2}"


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's one config per stage; the GPU "
                    "tunes over the real spaces (gpu_session.sh fmoetune)")
def test_tune_fmoe_times_the_one_launch_kernels_whole_for_few_tokens(tmp_path):
    """At 2 tokens the one-launch kernels are whole candidates beside the two stages; whichever
    wins, the row's columns describe it."""
    from gemmtune.cli import main

    untuned = tmp_path / "untuned_fmoe.csv"
    untuned.write_text("token,model_dim,inter_dim,expert,topk,act_type,dtype\n"
                       "2,32,16,4,2,ActivationType.Gelu,torch.float32\n")
    tuned, profile = tmp_path / "tuned_fmoe.csv", tmp_path / "profile.csv"
    assert main(["tune", "fmoe", "-i", str(untuned), "-o", str(tuned), "-o2", str(profile),
                 "--iters", "3", "--libtype", "triton"]) == 0
    screened = [line.split(",") for line in profile.read_text().splitlines()[1:]]
    assert len(screened) == 4
    assert all(any(k in line for line in screened) for k in (ONE_STAGE, STREAM))
    (row,) = read_table(tuned, SCHEMA).rows
    r = row.results
    if r["run_1stage"]:
        assert r["kernelName1"] in (ONE_STAGE, STREAM)
        assert (r["kernelName2"], r["block_m"]) == ("", 0)
        assert r["us1"] == r["us"] > 0 and r["err1"] <= 0.05
    else:
        assert r["kernelName1"].startswith("triton.moe1:") and r["block_m"] == 16
        assert r["kernelName2"].startswith("triton.moe2:") and r["us1"] > 0 and r["us2"] > 0


def test_tune_fmoe_takes_the_seeds_err_ratio_by_default(tmp_path):
    from gemmtune.cli import build_parser
    from gemmtune.families.fmoe.tuner import FmoeTuner
    from gemmtune.tune.command import config_from_args

    untuned = tmp_path / "u.csv"
    untuned.write_text("token\n4\n")
    parse = build_parser().parse_args
    args = ["tune", "fmoe", "-i", str(untuned), "-o", str(tmp_path / "t.csv")]
    assert config_from_args(parse(args), FmoeTuner.default_err_ratio).options.err_ratio == 0.5
    assert config_from_args(parse(args + ["--errRatio", "0.1"]),
                            FmoeTuner.default_err_ratio).options.err_ratio == 0.1
    with pytest.raises(ValueError, match="a fraction of the output"):
        config_from_args(parse(args + ["--errRatio", "2"]), FmoeTuner.default_err_ratio)


def test_routing_is_refused_for_a_gemm_family_and_an_old_profile_is_not_appended_to(tmp_path,
                                                                                    capsys):
    from gemmtune.cli import main

    untuned = tmp_path / "u.csv"
    untuned.write_text("M,N,K\n4,8,16\n")
    args = ["tune", "bf16", "-i", str(untuned), "-o", str(tmp_path / "t.csv")]
    assert main(args + ["--routing", "zipf"]) == 2
    assert "--routing is an option of fmoe" in capsys.readouterr().err
    assert main(args + ["--ep", "8"]) == 2
    assert "--ep is an option of fmoe" in capsys.readouterr().err
    old = tmp_path / "old_profile.csv"
    old.write_text("arch,cu_num,M,N,K,kernelName,status\n")
    assert main(args + ["-o2", str(old)]) == 2
    assert "a profile with other columns" in capsys.readouterr().err
    assert old.read_text() == "arch,cu_num,M,N,K,kernelName,status\n"


def test_bench_fmoe_checks_every_shape_and_writes_csv_and_plot(tmp_path, capsys):
    from gemmtune.cli import main

    shapes = tmp_path / "untuned_fmoe.csv"
    shapes.write_text("token,model_dim,inter_dim,expert,topk,dtype,q_dtype_a,q_dtype_w\n"
                      "1,32,16,4,2,torch.bfloat16,torch.bfloat16,torch.bfloat16\n"
                      "6,32,24,6,3,torch.bfloat16,torch.bfloat16,torch.bfloat16\n")
    out = tmp_path / "bench"
    assert main(["bench", "fmoe", "--shapes", str(shapes), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    lines = (out / "bench_fmoe.csv").read_text().splitlines()
    assert lines[0].startswith("name,token,model_dim,inter_dim,expert,topk,q_type,torch_us,"
                               "tuned_us")
    assert [line.split(",")[1] for line in lines[1:]] == ["1", "6"]
    assert all(line.split(",")[-1] == "True" for line in lines[1:])  # both within the bound
    if DEVICE == "cpu":
        assert "2 shape(s) checked against the fp32 reference: all within the bound" in printed
    assert "WRONG" not in printed
    assert main(["bench", "fmoe", "--model", "llama3-8b", "-o", str(out)]) == 2
    assert "llama3-8b has no MoE layers" in capsys.readouterr().err
    assert main(["bench", "fmoe", "--shapes", str(shapes), "--dtype", "fp8", "-o", str(out)]) == 2
    assert "fmoe benches bf16 experts, or FP8 ones with --q_type" in capsys.readouterr().err
    assert main(["bench", "fmoe", "--shapes", str(shapes), "--q_type", "per_Token",
                 "-o", str(out)]) == 2
    assert "an untuned CSV names each row's q_type" in capsys.readouterr().err
    assert main(["bench", "bf16", "--q_type", "per_Token", "-o", str(out)]) == 2
    assert "--q_type and --ep are for fmoe's experts" in capsys.readouterr().err

"""fused_moe with FP8 experts (per_Tensor, per_Token, per_1x128): against a token-by-token
emulation of the scheme (tight) and the fp32 MoE of the dequantised experts (FP8's own error),
at ragged sizes with the edge routings; the scales' checks."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

import gemmtune
from gemmtune import quant
from gemmtune.families.fmoe.quantised import reference
from gemmtune.kernels.problem import MoeScales
from gemmtune.tables.values import QuantType

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCHEMES = list(quant.MOE_QUANT_TYPES)
# Output rounding only (the emulation computes in fp32 as the op's torch backend does).
EMULATION_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# FP8 e4m3 activations, quantised for each stage (3 mantissa bits: ~2-3% rms per stage), against
# the dequantised experts with exact activations; measured 0.046-0.048 at these sizes.
FP8_TOLERANCE = 0.08


def experts(E, D, I, seed):  # noqa: E741
    g = torch.Generator(DEVICE).manual_seed(seed)
    w1 = torch.randn(E, 2 * I, D, device=DEVICE, generator=g) / D ** 0.5
    w2 = torch.randn(E, D, I, device=DEVICE, generator=g) / I ** 0.5
    return w1, w2


def routing(T, E, topk, seed, experts_global=None):
    g = torch.Generator(DEVICE).manual_seed(seed)
    ids = torch.randint(0, experts_global or E, (T, topk), device=DEVICE, generator=g,
                        dtype=torch.int32)
    return torch.rand(T, topk, device=DEVICE, generator=g), ids


class Layer(NamedTuple):
    hidden: torch.Tensor
    w1: torch.Tensor  # the experts before quantisation
    w2: torch.Tensor
    w1q: torch.Tensor
    s1: torch.Tensor
    w2q: torch.Tensor
    s2: torch.Tensor
    topk_weight: torch.Tensor
    topk_ids: torch.Tensor


def fp8_layer(T, D, I, E, topk, q_type, seed, dtype=torch.float32) -> Layer:  # noqa: E741
    """Fresh experts quantised by ``q_type``, hidden states and a routing."""
    w1, w2 = experts(E, D, I, seed)
    hidden = torch.randn(T, D, device=DEVICE, generator=torch.Generator(DEVICE)
                         .manual_seed(seed + 1)).to(dtype)
    return Layer(hidden, w1, w2, *quant.quantize_experts(w1, q_type),
                 *quant.quantize_experts(w2, q_type), *routing(T, E, topk, seed + 2))


def stage_input(t, q_type, static=None):
    """What the scheme makes of a stage's input, in fp32 (one row at a time where it can)."""
    if q_type == QuantType.per_Tensor and static is not None:
        return quant.quantize_fp8(t, static.reshape(())).float() * static.reshape(())
    q, s = quant.quantize(t, q_type)
    return quant.dequantize(q, s, q_type)


def emulate(hidden, w1q, w2q, s1, s2, topk_weight, topk_ids, q_type, local_of=None,
            activation="silu", doweight_stage1=False, a1=None, a2=None):
    """Token by token, slot by slot: the scheme's arithmetic in fp32."""
    T, topk = topk_ids.shape
    I = w2q.shape[2]  # noqa: E741
    w1 = quant.dequantize_experts(w1q, s1, q_type)
    w2 = quant.dequantize_experts(w2q, s2, q_type)
    x = stage_input(hidden.float(), q_type, a1)
    act = F.gelu if activation == "gelu" else F.silu
    inter = torch.zeros(T, topk, I, device=hidden.device)
    for t in range(T):
        for k in range(topk):
            e = int(topk_ids[t, k]) if local_of is None else local_of[int(topk_ids[t, k])]
            if e < 0:
                continue
            h = w1[e] @ x[t]
            h = act(h[:I]) * h[I:]
            inter[t, k] = h * topk_weight[t, k] if doweight_stage1 else h
    inter = stage_input(inter.reshape(T * topk, I), q_type, a2).reshape(T, topk, I)
    out = torch.zeros(T, hidden.shape[1], device=hidden.device)
    for t in range(T):
        for k in range(topk):
            e = int(topk_ids[t, k]) if local_of is None else local_of[int(topk_ids[t, k])]
            if e < 0:
                continue
            y = w2[e] @ inter[t, k]
            out[t] += y if doweight_stage1 else y * topk_weight[t, k]
    return out


def relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_type", SCHEMES)
def test_each_scheme_against_its_emulation_and_the_dequantised_reference(q_type, dtype):
    T, D, E = 7, 200, 4  # D and I (96) ragged against 128
    hidden, _, _, w1q, s1, w2q, s2, topk_weight, topk_ids = fp8_layer(T, D, 96, E, 2, q_type,
                                                                      seed=1, dtype=dtype)
    y = gemmtune.fused_moe(hidden, w1q, w2q, topk_weight, topk_ids, quant_type=q_type,
                           w1_scale=s1, w2_scale=s2)
    assert y.dtype == dtype and y.shape == (T, D) and not torch.isnan(y).any()
    assert relative(y, emulate(hidden, w1q, w2q, s1, s2, topk_weight, topk_ids, q_type)) \
        < EMULATION_TOLERANCE[dtype]
    identity = torch.arange(E, dtype=torch.int32, device=DEVICE)
    ref = reference(hidden, w1q, w2q, topk_weight, topk_ids, identity, q_type,
                    MoeScales(s1, s2))
    assert relative(y, ref) < FP8_TOLERANCE


@pytest.mark.parametrize("q_type", SCHEMES)
def test_edge_routings(q_type):
    # Expert parallelism (global ids, half of them elsewhere, a token with no local expert),
    # a token sent twice to one expert, gelu, the weight on stage 1, one token alone.
    T, D, I, E_global, topk = 5, 136, 40, 6, 3  # noqa: E741
    mask = torch.tensor([True, False, True, False, True, False], device=DEVICE)
    local_of = {0: 0, 1: -1, 2: 1, 3: -1, 4: 2, 5: -1}
    w1, w2 = experts(3, D, I, seed=4)
    w1q, s1 = quant.quantize_experts(w1, q_type)
    w2q, s2 = quant.quantize_experts(w2, q_type)
    hidden = torch.randn(T, D, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(5))
    topk_weight, topk_ids = routing(T, 3, topk, seed=6, experts_global=E_global)
    topk_ids[0] = torch.tensor([1, 3, 5])  # every expert elsewhere
    topk_ids[1] = torch.tensor([2, 2, 4])  # twice to one expert
    for doweight_stage1 in (False, True):
        y = gemmtune.fused_moe(hidden, w1q, w2q, topk_weight, topk_ids, activation="gelu",
                               quant_type=q_type, doweight_stage1=doweight_stage1,
                               w1_scale=s1, w2_scale=s2, expert_mask=mask)
        expected = emulate(hidden, w1q, w2q, s1, s2, topk_weight, topk_ids, q_type, local_of,
                           "gelu", doweight_stage1)
        assert torch.equal(y[0], torch.zeros_like(y[0]))
        assert relative(y, expected) < EMULATION_TOLERANCE[torch.float32]
    one = gemmtune.fused_moe(hidden[2:3], w1q, w2q, topk_weight[2:3], topk_ids[2:3],
                             quant_type=q_type, w1_scale=s1, w2_scale=s2, expert_mask=mask)
    assert relative(one, emulate(hidden[2:3], w1q, w2q, s1, s2, topk_weight[2:3],
                                 topk_ids[2:3], q_type, local_of)) < 1e-5


def test_per_tensor_static_activation_scales_and_flat_weight_scales():
    q_type = QuantType.per_Tensor
    hidden, _, _, w1q, s1, w2q, s2, topk_weight, topk_ids = fp8_layer(6, 128, 64, 3, 2, q_type,
                                                                      seed=7)
    a1 = torch.tensor(0.02, device=DEVICE)  # saturates the largest activations, as static does
    a2 = torch.tensor(0.005, device=DEVICE)
    y = gemmtune.fused_moe(hidden, w1q, w2q, topk_weight, topk_ids, quant_type="per_Tensor",
                           w1_scale=s1.flatten(), w2_scale=s2.flatten(), a1_scale=a1,
                           a2_scale=a2)
    expected = emulate(hidden, w1q, w2q, s1, s2, topk_weight, topk_ids, q_type, a1=a1, a2=a2)
    assert relative(y, expected) < 1e-5
    dynamic = gemmtune.fused_moe(hidden, w1q, w2q, topk_weight, topk_ids,
                                 quant_type="per_Tensor", w1_scale=s1, w2_scale=s2)
    assert not torch.allclose(y, dynamic)  # the static scales were used


def test_bad_quantised_calls_say_what_is_wrong():
    hidden, w1, _, w1q, s1, w2q, s2, topk_weight, topk_ids = fp8_layer(3, 128, 64, 2, 2,
                                                                       "per_Token", seed=10)
    call = dict(hidden=hidden, w1=w1q, w2=w2q, topk_weight=topk_weight, topk_ids=topk_ids)
    with pytest.raises(ValueError, match=r"w1_scale must be float32 of shape \(2, 128, 1\)"):
        gemmtune.fused_moe(**call, quant_type="per_Token", w1_scale=s1[:, :5], w2_scale=s2)
    with pytest.raises(ValueError, match="pass the quant_type they were made for"):
        gemmtune.fused_moe(**call, w1_scale=s1, w2_scale=s2)
    with pytest.raises(TypeError, match="FP8 experts take a quant_type"):
        gemmtune.fused_moe(**call)
    with pytest.raises(TypeError, match="w1 must be torch.float8_e4m3fn"):
        gemmtune.fused_moe(**{**call, "w1": w1}, quant_type="per_Token", w1_scale=s1,
                           w2_scale=s2)
    with pytest.raises(ValueError, match="a1_scale is a static per-tensor activation scale"):
        gemmtune.fused_moe(**call, quant_type="per_Token", w1_scale=s1, w2_scale=s2,
                           a1_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"per_128x128\): not supported"):
        gemmtune.fused_moe(**call, quant_type="per_128x128", w1_scale=s1, w2_scale=s2)
    with pytest.raises(ValueError, match="the Triton MoE kernels take"):
        gemmtune.fused_moe(**call, quant_type="per_Token", w1_scale=s1, w2_scale=s2,
                           kernel="triton.moe_gmm")
    blocks = fp8_layer(3, 128, 64, 2, 2, "per_1x128", seed=14)
    with pytest.raises(ValueError, match="each K step must lie in one block"):
        gemmtune.fused_moe(**{**call, "w1": blocks.w1q, "w2": blocks.w2q},
                           quant_type="per_1x128", w1_scale=blocks.s1, w2_scale=blocks.s2,
                           kernel="triton.moe1:BM16.BN16.BK256.W4.S1"
                                  "+triton.moe2:BM16.BN16.BK256.SK1.W4.S1")


def test_compiles_whole_with_fp8_experts():
    hidden, _, _, w1q, s1, w2q, s2, topk_weight, topk_ids = fp8_layer(4, 128, 64, 3, 2,
                                                                      "per_1x128", seed=12)

    def layer(hidden, topk_weight, topk_ids):
        return gemmtune.fused_moe(hidden, w1q, w2q, topk_weight, topk_ids,
                                  quant_type=QuantType.per_1x128, w1_scale=s1, w2_scale=s2)

    expected = layer(hidden, topk_weight, topk_ids)
    got = torch.compile(layer, fullgraph=True)(hidden, topk_weight, topk_ids)
    assert torch.equal(got, expected)


# The two-stage Triton kernels with FP8 per-token scales (block_k >= 32: Hopper's 8-bit dots).
FP8_TWO_STAGE = ["triton.moe1:BM16.BN16.BK32.W4.S1+triton.moe2:BM16.BN16.BK32.SK1.W4.S1",
                 "triton.moe1:BM16.BN16.BK32.W4.S1.PB1+triton.moe2:BM16.BN16.BK32.SK2.W4.S1.PB1"]


# Every scheme through grouped routing; pair blocks with split-K (many more programs, so slow
# in the interpreter) with block scales, the scheme with the most indexing.
@pytest.mark.parametrize("kernel,q_type", [(FP8_TWO_STAGE[0], q) for q in SCHEMES]
                         + [(FP8_TWO_STAGE[1], QuantType.per_1x128)])
def test_the_two_stage_kernels_take_fp8_experts(kernel, q_type):
    # Against the scheme's emulation: the same quantised inputs and intermediate (the Triton
    # quantiser rounds as gemmtune.quant does), sums in another order. per_Tensor: dynamic
    # scales with the weight on stage 2, static ones with it on stage 1. D and I leave partial
    # 128 blocks.
    T, D, I, E_global, topk = 5, 136, 72, 5, 2  # noqa: E741
    mask = torch.tensor([True, True, False, True, True], device=DEVICE)
    local_of = {0: 0, 1: 1, 2: -1, 3: 2, 4: 3}
    layer = fp8_layer(T, D, I, 4, topk, q_type, seed=20, dtype=torch.bfloat16)
    topk_ids = routing(T, 4, topk, seed=21, experts_global=E_global)[1]
    topk_ids[0] = torch.tensor([2, 4])  # one slot elsewhere
    for doweight_stage1 in (False, True):
        static = q_type == QuantType.per_Tensor and doweight_stage1
        a1, a2 = (torch.tensor(0.01, device=DEVICE), torch.tensor(0.002, device=DEVICE)) \
            if static else (None, None)
        y = gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight, topk_ids,
                               quant_type=q_type, doweight_stage1=doweight_stage1,
                               w1_scale=layer.s1, w2_scale=layer.s2, a1_scale=a1, a2_scale=a2,
                               expert_mask=mask, kernel=kernel)
        expected = emulate(layer.hidden, layer.w1q, layer.w2q, layer.s1, layer.s2,
                           layer.topk_weight, topk_ids, q_type, local_of,
                           doweight_stage1=doweight_stage1, a1=a1, a2=a2)
        assert y.dtype == torch.bfloat16 and not torch.isnan(y).any()
        assert relative(y, expected) < EMULATION_TOLERANCE[torch.bfloat16]


# The persistent stages through TMA (rows of 16-byte multiples: D and I multiples of 16; D
# leaves a partial 128 block), per-token scales as written, block scales flattened.
PERSISTENT_FP8 = [("triton.moe1:BM16.BN16.BK32.W4.S1.PB0.P1"
                   "+triton.moe2:BM16.BN16.BK32.SK1.W4.S1.PB0.P1", QuantType.per_Token),
                  ("triton.moe1:BM16.BN16.BK32.W4.S1.PB0.P2"
                   "+triton.moe2:BM16.BN16.BK32.SK1.W4.S1.PB0.P2", QuantType.per_1x128)]


@pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered in:RuntimeWarning")
@pytest.mark.parametrize("kernel,q_type", PERSISTENT_FP8)
def test_the_persistent_stages_take_fp8_experts(kernel, q_type):
    T, D, I, topk = 6, 144, 48, 2  # noqa: E741
    mask = torch.tensor([True, True, False, True, True], device=DEVICE)
    layer = fp8_layer(T, D, I, 4, topk, q_type, seed=50, dtype=torch.bfloat16)
    topk_ids = routing(T, 4, topk, seed=51, experts_global=5)[1]
    y = gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight, topk_ids,
                           quant_type=q_type, w1_scale=layer.s1, w2_scale=layer.s2,
                           expert_mask=mask, kernel=kernel)
    expected = emulate(layer.hidden, layer.w1q, layer.w2q, layer.s1, layer.s2,
                       layer.topk_weight, topk_ids, q_type, {0: 0, 1: 1, 2: -1, 3: 2, 4: 3})
    assert not torch.isnan(y).any()
    assert relative(y, expected) < EMULATION_TOLERANCE[torch.bfloat16]


# Stage 1 over model_dim in parts (FP8 only): the parts' gate and up sums meet in an fp32
# workspace, and the quantiser applies the activation (per tensor: in both of its passes).
SPLIT_STAGE1 = ("triton.moe1:BM16.BN16.BK32.W4.S1.PB0.P0.SK3"
                "+triton.moe2:BM16.BN16.BK32.SK1.W4.S1")


@pytest.mark.parametrize("q_type,activation", [(QuantType.per_Tensor, "silu"),
                                               (QuantType.per_1x128, "gelu")])
def test_split_stage1_sums_parts_and_leaves_its_workspace_zero(q_type, activation):
    from gemmtune.kernels.triton.moe_common import cached_workspaces
    from gemmtune.kernels.triton.moe_stages import SUMS_KIND

    T, D, I, E, topk = 3, 136, 40, 4, 2  # noqa: E741  (D: 5 steps of 32 in 3 parts)
    layer = fp8_layer(T, D, I, E, topk, q_type, seed=30, dtype=torch.bfloat16)
    y = gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight,
                           layer.topk_ids, activation=activation, quant_type=q_type,
                           w1_scale=layer.s1, w2_scale=layer.s2, kernel=SPLIT_STAGE1)
    expected = emulate(layer.hidden, layer.w1q, layer.w2q, layer.s1, layer.s2,
                       layer.topk_weight, layer.topk_ids, q_type, activation=activation)
    assert relative(y, expected) < EMULATION_TOLERANCE[torch.bfloat16]
    sums = [w for w in cached_workspaces(SUMS_KIND) if w.shape[1] == 2 * I]
    assert sums and all(not w.any() for w in sums)
    with pytest.raises(ValueError, match="routing weight"):
        gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight,
                           layer.topk_ids, quant_type=q_type, doweight_stage1=True,
                           w1_scale=layer.s1, w2_scale=layer.s2, kernel=SPLIT_STAGE1)


def test_only_fp8_experts_split_stage1():
    w1 = torch.randn(2, 32, 64, device=DEVICE).to(torch.bfloat16)
    w2 = torch.randn(2, 64, 16, device=DEVICE).to(torch.bfloat16)
    weight, ids = routing(3, 2, 1, seed=1)
    with pytest.raises(ValueError, match="only for FP8 experts"):
        gemmtune.fused_moe(torch.randn(3, 64, device=DEVICE).to(torch.bfloat16), w1, w2, weight,
                           ids, kernel=SPLIT_STAGE1)


# Stage 1 quantising its own output (QO1): the program that finishes a block quantises its rows,
# with the bits of the quantiser's launch it saves. Grouped routing per token; pair blocks
# split over model_dim (the gate and up sums activated there) with 1x128 block scales.
QUANT_OUT = [("triton.moe1:BM16.BN32.BK32.W4.S1.PB0.P0.SK1.QO1"
              "+triton.moe2:BM16.BN32.BK32.SK1.W4.S1", QuantType.per_Token),
             ("triton.moe1:BM16.BN32.BK32.W4.S1.PB1.P0.SK2.QO1"
              "+triton.moe2:BM16.BN32.BK32.SK1.W4.S1.PB1", QuantType.per_1x128)]


@pytest.mark.parametrize("kernel,q_type", QUANT_OUT)
def test_stage1_quantising_its_output_gives_the_quantisers_bits(kernel, q_type):
    from gemmtune.kernels.triton.moe_common import cached_workspaces
    from gemmtune.kernels.triton.moe_stages import ARRIVALS_KIND

    T, D, I, topk = 5, 72, 150, 2  # noqa: E741  (I: 5 column tiles of 32, 2 blocks of 128)
    mask = torch.tensor([True, True, False, True, True], device=DEVICE)
    layer = fp8_layer(T, D, I, 4, topk, q_type, seed=40, dtype=torch.bfloat16)
    topk_ids = routing(T, 4, topk, seed=41, experts_global=5)[1]
    topk_ids[0] = torch.tensor([2, 4])  # one slot elsewhere
    split = ".SK2" in kernel
    # (split parts leave the activation to their sums' quantiser, which takes no routing weight)
    for doweight_stage1, activation in ((False, "silu"),) if split else ((True, "gelu"),):
        def run(name):
            return gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight,
                                      topk_ids, activation=activation, quant_type=q_type,
                                      doweight_stage1=doweight_stage1, w1_scale=layer.s1,
                                      w2_scale=layer.s2, expert_mask=mask, kernel=name)
        quantised_in_stage1 = run(kernel)
        assert not torch.isnan(quantised_in_stage1).any()
        assert torch.equal(quantised_in_stage1, run(kernel.replace(".QO1", "")))
        expected = emulate(layer.hidden, layer.w1q, layer.w2q, layer.s1, layer.s2,
                           layer.topk_weight, topk_ids, q_type, local_of={
                               0: 0, 1: 1, 2: -1, 3: 2, 4: 3}, activation=activation,
                           doweight_stage1=doweight_stage1)
        assert relative(quantised_in_stage1, expected) < EMULATION_TOLERANCE[torch.bfloat16]
    counts = cached_workspaces(ARRIVALS_KIND)
    assert counts and all(not c.any() for c in counts)  # every call leaves them zero


def test_stage1_quantises_its_output_per_token_or_per_block_only():
    layer = fp8_layer(3, 128, 32, 2, 1, QuantType.per_Tensor, seed=42, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="per token or per block, not tensor"):
        gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight,
                           layer.topk_ids, quant_type=QuantType.per_Tensor, w1_scale=layer.s1,
                           w2_scale=layer.s2, kernel=QUANT_OUT[0][0])


# Rows read once; in two passes of 64; read once by 4 programs each dividing a quarter (blocks
# of 128: 2 programs).
@pytest.mark.parametrize("one_tile_max,chunk_values", [(8192, 1024), (64, 1024), (8192, 64)])
def test_the_triton_row_quantiser_rounds_as_gemmtune_quant(one_tile_max, chunk_values,
                                                           monkeypatch):
    from gemmtune.kernels.triton import moe_quant

    monkeypatch.setattr(moe_quant, "ONE_TILE_MAX", one_tile_max)
    monkeypatch.setattr(moe_quant, "CHUNK_VALUES", chunk_values)
    assert (moe_quant.FP8_MAX, moe_quant.AMAX_FLOOR) == (quant.FP8_MAX, quant.AMAX_FLOOR)
    x = torch.randn(5, 200, device=DEVICE) * torch.tensor([1, 100, 1e-3, 1, 3.0],
                                                          device=DEVICE)[:, None]
    x[3] = 0
    x[4, 7] = float("nan")
    q, scale = moe_quant.quant_rows(x)
    expected_q, expected_scale = quant.per_token_fp8(x)
    assert torch.equal(scale[:4], expected_scale[:4, 0])
    assert torch.equal(q[:4].view(torch.uint8), expected_q[:4].view(torch.uint8))
    assert torch.isnan(scale[4])  # a NaN makes its row's scale NaN, as gemmtune.quant's
    finite = x[:4]
    q, scale = moe_quant.quant_tensor(finite)
    expected_q, expected_scale = quant.per_tensor_fp8(finite)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
    static = torch.tensor(0.05, device=DEVICE)
    q, scale = moe_quant.quant_tensor(finite, static)
    assert torch.equal(scale, static)
    assert torch.equal(q.view(torch.uint8), quant.quantize_fp8(finite, static).view(torch.uint8))
    assert torch.isnan(moe_quant.quant_tensor(x)[1])
    q, scale = moe_quant.quant_blocks(x)
    expected_q, expected_scale = quant.per_block_fp8(x, quant.ACT_BLOCK)
    assert torch.equal(scale[:4], expected_scale[:4])  # (5, 2): a full and a partial block
    assert torch.equal(q[:4].view(torch.uint8), expected_q[:4].view(torch.uint8))
    assert torch.isnan(scale[4, 0]) and not torch.isnan(scale[4, 1])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_gpu_fp8_per_token_two_stage_at_real_sizes(tokens):
    # Hopper's FP8 dots accumulate with reduced precision over long K: against the emulation
    # (fp32 sums) the bound is looser than the interpreter's.
    kernel = "triton.moe1:BM16.BN64.BK128.W4.S3+triton.moe2:BM16.BN64.BK128.SK1.W4.S3"
    layer = fp8_layer(tokens, 2048, 768, 8, 4, "per_Token", seed=tokens, dtype=torch.bfloat16)
    y = gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight,
                           layer.topk_ids, quant_type="per_Token", w1_scale=layer.s1,
                           w2_scale=layer.s2, kernel=kernel)
    expected = emulate(layer.hidden, layer.w1q, layer.w2q, layer.s1, layer.s2,
                       layer.topk_weight, layer.topk_ids, QuantType.per_Token)
    assert relative(y, expected) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,blocks,q_type", [
    (1, ".PB1.P0.SK1", QuantType.per_Token), (1, ".PB1.P0.SK2", QuantType.per_Token),
    (8, ".PB1.P0.SK1", QuantType.per_1x128), (64, ".PB0.P0.SK1", QuantType.per_Token)])
def test_gpu_stage1_quantising_its_output_gives_the_quantisers_bits(tokens, blocks, q_type):
    # deepseek-v3's TP8 shard, 32 of its experts: the same bits as the quantiser's launch, over
    # many programs finishing blocks at once (split parts and column tiles).
    plain = (f"triton.moe1:BM16.BN32.BK128.W4.S4{blocks}"
             f"+triton.moe2:BM16.BN64.BK128.SK1.W4.S3{blocks[:4]}")
    layer = fp8_layer(tokens, 7168, 256, 32, 8, q_type, seed=tokens, dtype=torch.bfloat16)

    def run(name):
        return gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight,
                                  layer.topk_ids, quant_type=q_type, w1_scale=layer.s1,
                                  w2_scale=layer.s2, kernel=name)
    expected = run(plain)
    quantised_in_stage1 = plain.replace("+", ".QO1+")
    for _ in range(3):  # (a count left behind would show in a later call)
        assert torch.equal(run(quantised_in_stage1), expected)
    assert relative(expected, emulate(layer.hidden, layer.w1q, layer.w2q, layer.s1, layer.s2,
                                      layer.topk_weight, layer.topk_ids, q_type)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("q_type", SCHEMES)
@pytest.mark.parametrize("tokens", [1, 300])
def test_gpu_every_scheme_through_triton_with_long_k_and_expert_parallelism(q_type, tokens):
    # Stage 2 over K = 4096 (FP8 dots accumulate with reduced precision on Hopper), half the
    # global experts elsewhere; against the emulation and FP8's own error bound.
    kernel = "triton.moe1:BM64.BN128.BK128.W4.S3+triton.moe2:BM64.BN128.BK128.SK1.W8.S3"
    E, topk = 8, 4
    layer = fp8_layer(tokens, 1024, 4096, E, topk, q_type, seed=tokens, dtype=torch.bfloat16)
    mask = torch.arange(2 * E, device=DEVICE) % 2 == 0
    local_of = {g: g // 2 if g % 2 == 0 else -1 for g in range(2 * E)}
    topk_ids = routing(tokens, E, topk, seed=5, experts_global=2 * E)[1]
    y = gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight, topk_ids,
                           quant_type=q_type, w1_scale=layer.s1, w2_scale=layer.s2,
                           expert_mask=mask, kernel=kernel)
    expected = emulate(layer.hidden, layer.w1q, layer.w2q, layer.s1, layer.s2,
                       layer.topk_weight, topk_ids, q_type, local_of)
    assert relative(y, expected) < 2e-2
    emap = torch.tensor([local_of[g] for g in range(2 * E)], dtype=torch.int32, device=DEVICE)
    ref = reference(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight, topk_ids, emap,
                    q_type, MoeScales(layer.s1, layer.s2))
    assert relative(y, ref) < FP8_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("q_type", SCHEMES)
def test_gpu_persistent_fp8_stages_at_a_prefill_size(q_type):
    # deepseek-v3's TP8 shard over 32 of its experts, 1024 tokens: the persistent TMA stages
    # against the plain ones (the same quantised inputs; sums in other orders).
    kernel = ("triton.moe1:BM64.BN128.BK128.W8.S3.PB0.P1"
              "+triton.moe2:BM64.BN256.BK64.SK1.W8.S3.PB0.P2")
    plain = "triton.moe1:BM64.BN128.BK128.W8.S3+triton.moe2:BM64.BN128.BK64.SK1.W8.S3"
    layer = fp8_layer(1024, 7168, 256, 32, 8, q_type, seed=11, dtype=torch.bfloat16)

    def run(name):
        return gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight,
                                  layer.topk_ids, quant_type=q_type, w1_scale=layer.s1,
                                  w2_scale=layer.s2, kernel=name)
    y = run(kernel)
    assert not torch.isnan(y).any() and relative(y, run(plain)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("q_type", [QuantType.per_Token, QuantType.per_Tensor])
def test_gpu_torch_backend_runs_torch_grouped_fp8_gemm_and_captures(q_type):
    from gemmtune.kernels.torch_ref import TORCH_MOE

    tokens, E, topk = 40, 8, 2
    layer = fp8_layer(tokens, 512, 256, E, topk, q_type, seed=3, dtype=torch.bfloat16)
    mask = torch.arange(2 * E, device=DEVICE) < E
    topk_ids = routing(tokens, E, topk, seed=4, experts_global=2 * E)[1]
    local_of = {g: g if g < E else -1 for g in range(2 * E)}

    def layer_call():
        return gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight,
                                  topk_ids, quant_type=q_type, w1_scale=layer.s1,
                                  w2_scale=layer.s2, expert_mask=mask, kernel=TORCH_MOE)

    y = layer_call()
    expected = emulate(layer.hidden, layer.w1q, layer.w2q, layer.s1, layer.s2,
                       layer.topk_weight, topk_ids, q_type, local_of)
    # Its grouped GEMMs write bf16, which the activation then reads: bf16 rounding between.
    assert relative(y, expected) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer_call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, y)


@pytest.mark.gpu
def test_gpu_fp8_triton_rows_capture_in_a_cuda_graph():
    kernel = "triton.moe1:BM16.BN64.BK128.W4.S3+triton.moe2:BM16.BN64.BK128.SK2.W4.S3"
    layer = fp8_layer(8, 2048, 768, 16, 4, "per_1x128", seed=9, dtype=torch.bfloat16)

    def layer_call():
        return gemmtune.fused_moe(layer.hidden, layer.w1q, layer.w2q, layer.topk_weight,
                                  layer.topk_ids, quant_type="per_1x128", w1_scale=layer.s1,
                                  w2_scale=layer.s2, kernel=kernel)

    y = layer_call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer_call()
    graph.replay()
    torch.cuda.synchronize()
    # (bf16 rounding of sums whose order split-K's atomic adds may change)
    assert relative(captured, y) < EMULATION_TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("q_type,tokens,blocks,ranks", [
    (QuantType.per_Token, 1, ".PB1", 1), (QuantType.per_Token, 64, ".PB0", 1),
    (QuantType.No, 1, ".PB1", 1), (QuantType.No, 64, ".PB0", 1),
    (QuantType.per_Token, 1, ".PB1", 4), (QuantType.per_1x128, 1, ".PB1.P0.SK2.QO1", 4)])
def test_gpu_stages_read_this_replays_routing_under_a_graph_that_routes(q_type, tokens, blocks,
                                                                        ranks):
    # The router's top-k runs in the same graph as the layer, right before it: the stages that
    # read their routing before waiting for the launch before them (stage 2; stage 1 after the
    # activations' quantiser) must still see this replay's. The eager call's bits. With
    # expert parallelism (16 of ranks x 16 experts here) a replay often routes one token to no
    # local expert, when every program of both stages has nothing to compute.
    fp8 = q_type is not QuantType.No
    kernel = (f"triton.moe1:BM16.BN64.BK128.W4.S3{blocks}"
              f"+triton.moe2:BM16.BN64.BK128.SK1.W4.S3{blocks[:4]}")
    layer = fp8_layer(tokens, 2048, 768, 16, 4, QuantType.per_Token if not fp8 else q_type,
                      seed=10, dtype=torch.bfloat16)
    w1, w2 = (layer.w1q, layer.w2q) if fp8 else (layer.w1.to(torch.bfloat16),
                                                  layer.w2.to(torch.bfloat16))
    scales = dict(quant_type=q_type, w1_scale=layer.s1, w2_scale=layer.s2) if fp8 else {}
    mask = torch.arange(16 * ranks, device=DEVICE) < 16 if ranks > 1 else None
    logits = torch.randn(tokens, 16 * ranks, device=DEVICE)

    def layer_call():
        weight, ids = torch.topk(torch.softmax(logits, -1), 4)
        return gemmtune.fused_moe(layer.hidden, w1, w2, weight, ids.to(torch.int32),
                                  expert_mask=mask, kernel=kernel, **scales)

    graph = torch.cuda.CUDAGraph()
    layer_call()
    with torch.cuda.graph(graph):
        captured = layer_call()
    for seed in range(8):
        logits.copy_(torch.randn(tokens, 16 * ranks, device=DEVICE,
                                 generator=torch.Generator(DEVICE).manual_seed(seed)))
        graph.replay()
        assert torch.equal(captured, layer_call())


FP8_NAME = "torch.float8_e4m3fn"


def fp8_key(token, q_type, doweight_stage1=False):
    from gemmtune.families.fmoe.op import FmoeKey

    return FmoeKey(token, 64, 32, 4, 2, "ActivationType.Silu", "torch.bfloat16", FP8_NAME,
                   FP8_NAME, QuantType.from_str(q_type).canonical, True, doweight_stage1)


def test_the_tuner_checks_fp8_candidates_against_the_dequantised_reference_on_an_ep_rank():
    from gemmtune.families.fmoe.quantised import FP8_TOLERANCE
    from gemmtune.families.fmoe.tuner import FmoeTuner
    from gemmtune.measure.accuracy import gate

    key = fp8_key(3, "per_1x128")
    tuner = FmoeTuner(ep=2)  # this rank holds experts 0-3 of 8
    prepared = tuner.prepare(key, seed=3)
    case = prepared.inputs
    assert case.w1.dtype == quant.FP8_DTYPE and case.scales.w1.shape == (4, 1, 1)
    assert bool((case.topk_ids < 8).all()) and bool((case.topk_ids < 4).any())
    assert case.expert_map.tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    assert tuner.inputs_note(3) == "routing=uniform;ep=2;seed=3"
    expected = reference(case.hidden, case.w1, case.w2, case.topk_weight, case.topk_ids,
                         case.expert_map, QuantType.per_1x128, case.scales)
    assert torch.equal(prepared.reference, expected)
    atol, rtol, bound = tuner.tolerance(key)
    assert (atol, rtol, bound) == FP8_TOLERANCE
    names = [c.name for c in tuner.candidates(key, frozenset())]
    assert names[0] == "torch.moe"
    if DEVICE == "cpu":  # torch and the interpreter's one config of each stage
        assert len(names) == 3
    for name in (names[0], FP8_TWO_STAGE[0]):
        verdict = gate(tuner.run(name, prepared), prepared.reference, atol=atol, rtol=rtol,
                       max_err_ratio=0.5, rel_bound=bound)
        assert verdict.ok, (name, verdict.detail)
    for name in names[1:3]:  # a stage screened alone times its own launches
        assert tuner.time(name, prepared, iters=1, warmup=0)[0] > 0
    from argparse import Namespace

    with pytest.raises(ValueError, match="expert-parallel"):
        FmoeTuner.factory_from_args(Namespace(routing=None, ep=0))()


def test_bench_fmoe_times_fp8_rows_beside_the_bf16_op(tmp_path, capsys):
    from gemmtune.cli import main

    shapes = tmp_path / "untuned_fmoe.csv"
    shapes.write_text("token,model_dim,inter_dim,expert,topk,dtype,q_dtype_a,q_dtype_w,q_type\n"
                      f"2,64,32,4,2,torch.bfloat16,{FP8_NAME},{FP8_NAME},QuantType.per_Token\n")
    out = tmp_path / "bench"
    assert main(["bench", "fmoe", "--shapes", str(shapes), "-o", str(out)]) == 0
    header, row = (out / "bench_fmoe.csv").read_text().splitlines()
    values = dict(zip(header.split(","), row.split(",")))
    assert values["q_type"] == "QuantType.per_Token" and values["ok"] == "True"
    assert float(values["bf16_us"]) > 0 and float(values["vs_bf16"]) > 0
    assert "WRONG" not in capsys.readouterr().out
    assert main(["bench", "fmoe", "--shapes", str(shapes), "--ep", "0", "-o", str(out)]) == 2
    assert "--ep 0: expected a positive number" in capsys.readouterr().err


def test_a_tuner_worker_starts_with_its_environment(monkeypatch):
    # A spawned worker imports the family before its first line runs: a variable that decides
    # what an import makes (TRITON_INTERPRET) must be in its environment when it starts.
    import os

    from gemmtune.tune import workers

    seen = {}

    class Started(Exception):
        pass

    def start(self):
        seen["mark"] = os.environ.get("GEMMTUNE_TEST_MARK")
        raise Started

    monkeypatch.delenv("GEMMTUNE_TEST_MARK", raising=False)
    monkeypatch.setattr(workers.mp.get_context("spawn").Process, "start", start)
    worker = workers.Worker(workers.WorkerSpec(dict, (("GEMMTUNE_TEST_MARK", "1"),)))
    with pytest.raises(Started):
        worker.start()
    assert seen == {"mark": "1"} and "GEMMTUNE_TEST_MARK" not in os.environ

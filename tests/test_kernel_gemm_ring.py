"""The TMA-ring Gluon kernel (``triton.ring``) of FP8 decode GEMMs on row-major weights.

Gluon kernels do not run in Triton's interpreter: on the CPU its config space and refusals are
checked here and its sm_90 code in tests/test_kernels_compile_for_hopper.py; the ``gpu`` tests
check blocks of x, steps, slots and splits against the fp32 reference at ragged sizes, with
every scale layout, bias and output dtype, NaN-poisoned outputs, and repeat launches bitwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gemm_checks
from gemm_checks import (DEVICE, assert_block_scaled_decode_launches,
                         assert_fp8_decode_launches, assert_long_k_as_precise_as_cublas,
                         check_fp8_decode, generator, quantised_operands)
from gemmtune.kernels.triton import _splits, _swapped, gemm_ring
from gemmtune.kernels.triton._splits import PDL_WAIT
from gemmtune.kernels.triton.gemm_ring import RingConfig

FP8 = torch.float8_e4m3fn


def test_names_round_trip():
    cfg = RingConfig(16, 256, 4, 2)
    assert cfg.name == "triton.ring:BM16.BK256.S4.SK2"
    assert RingConfig.from_name(cfg.name) == cfg
    added = RingConfig(16, 256, 4, 2, 1)
    assert added.name == "triton.ring:BM16.BK256.S4.SK2.R1"
    assert RingConfig.from_name(added.name) == added
    streamed = RingConfig(16, 256, 8, 1, 0, 64, 2)
    assert streamed.name == "triton.ring:BM16.BK256.S8.SK1.R0.N64.K2"
    assert RingConfig.from_name(streamed.name) == streamed
    with_pdl = RingConfig(16, 256, 4, 2, pdl=PDL_WAIT)
    assert with_pdl.name == "triton.ring:BM16.BK256.S4.SK2.R0.N64.K0.P1"
    assert RingConfig.from_name(with_pdl.name) == with_pdl


@pytest.mark.parametrize("config, M, N, K, dtype, says", [
    (RingConfig(16, 256, 4, 2), 16, 4096, 4096, torch.int8, "float8_e4m3fn only"),
    (RingConfig(16, 256, 4, 2), 16, 4096, 4104, FP8, "not a multiple of 16"),
    (RingConfig(16, 256, 4, 40), 16, 4096, 16384, FP8, "split_k=40 must be in"),
    (RingConfig(16, 256, 4, 8), 16, 4096, 1024, FP8, "4 steps of block_k=256"),
    (RingConfig(24, 256, 4, 1), 16, 4096, 4096, FP8, "block_m=24 must be one of"),
    (RingConfig(16, 64, 4, 1), 16, 4096, 4096, FP8, "block_k=64 must be one of"),
    (RingConfig(16, 256, 1, 1), 16, 4096, 4096, FP8, "stages=1 must be >= 2"),
    (RingConfig(64, 256, 8, 1), 16, 4096, 4096, FP8, "use fewer stages"),
    (RingConfig(8, 128, 2, 1), 600_000, 4096, 4096, FP8, "grid's third axis"),
    (RingConfig(8, 128, 2, 1), 16, 4096, 0, FP8, "K=0"),
    (RingConfig(16, 256, 4, 1, 1), 16, 4096, 4096, FP8, "add_splits=1 needs split_k > 1"),
    (RingConfig(16, 256, 4, 2, 2), 16, 4096, 4096, FP8, "add_splits=2 must be 0"),
    (RingConfig(16, 256, 4, 1, 0, 64, 3), 16, 4096, 4096, FP8, "stream_k=3 must be 0"),
    (RingConfig(16, 256, 4, 2, 0, 64, 2), 16, 4096, 4096, FP8, "takes split_k=1"),
    (RingConfig(16, 256, 4, 2, pdl=2), 16, 4096, 4096, FP8, "pdl=2 must be"),
])
def test_configs_that_cannot_run_say_why(config, M, N, K, dtype, says):
    assert says in gemm_ring.why_not_fits(config, M, N, K, dtype)


def test_split_partials_layout_holds_each_element_once():
    """_swapped.finish_tile's layout over every (BLOCK_N, warps, BLOCK_M) the swapped kernels
    launch (ring: 64 rows of w on 4 warps, 128 on 8; frag: 64 on 4; w4frag: 64 on 4 or 2;
    w4xa: 32-256 on 1-4): its tile of threads fits the (BLOCK_N, BLOCK_M) tile, so no element
    is held twice (it would be added twice), with a warp's 32 lanes down consecutive rows of
    w."""
    from gemmtune.kernels.triton import gemm_frag, gemm_w4frag, gemm_w4xa

    launched = [(n, n // gemm_ring.ROWS_PER_WARP,
                 gemm_ring.BLOCK_MS + ((gemm_ring.WIDE_BLOCK_M,) if n > _swapped.BLOCK_N else ()))
                for n in gemm_ring.BLOCK_NS]
    launched += [(_swapped.BLOCK_N, gemm_frag.NUM_WARPS, gemm_frag.BLOCK_MS)]
    launched += [(_swapped.BLOCK_N, w, gemm_w4frag.BLOCK_MS) for w in gemm_w4frag.WARPS]
    launched += [(8 * t * w, w, (gemm_w4xa.ROWS_OF_X,)) for t in gemm_w4xa.TILES
                 for w in gemm_w4xa.WARPS if 8 * t * w >= gemm_w4xa.MIN_BLOCK_N]
    for block_n, warps, block_ms in launched:
        layout = _swapped._end_layout(block_n, warps)
        assert layout.size_per_thread == [1, 1] and layout.order == [0, 1], layout
        assert layout.threads_per_warp == [32, 1], layout
        assert layout.warps_per_cta[0] * layout.warps_per_cta[1] == warps, layout
        if warps == block_n // 16:  # 16 rows of w a warp: the end every shipped row runs
            assert layout.warps_per_cta == [block_n // 32, 2], layout
        covered = [layout.threads_per_warp[d] * layout.warps_per_cta[d] for d in (0, 1)]
        for block_m in block_ms:
            assert block_n % covered[0] == 0 and block_m % covered[1] == 0, \
                (block_n, warps, block_m, layout)


@pytest.mark.parametrize("M, N, K", [(1, 576, 7168), (16, 4096, 512), (33, 1040, 2320),
                                     (64, 151936, 5120), (200, 256, 7168), (3, 16, 128),
                                     (300, 4096, 4096)])
def test_candidates_and_default_fit(M, N, K):
    found = gemm_ring.candidates(M, N, K, FP8, num_sms=132)
    assert bool(found) == (M <= gemm_ring.MAX_M), (M, N, K)  # decode, and the wide tile to 256
    # 64 < M: the wide tile (128 rows of w on two warpgroups, 128 of x, steps of 128), and
    # 64 rows of w by 64 of x, M in blocks of 64.
    past_64 = 64 < M <= gemm_ring.MAX_M
    wide = {(c.block_n, c.block_m, c.block_k) for c in found if c.block_n == 128}
    assert wide == ({(128, 128, 128)} if past_64 else set()), (M, wide)
    if past_64:
        assert {c.block_m for c in found if c.block_n == 64} == {64}
    # Every split config both ways: its partials summed in order and added.
    split = {dataclasses.replace(c, add_splits=0) for c in found if c.split_k > 1}
    assert {dataclasses.replace(c, add_splits=1) for c in split} <= set(found)
    assert not any(c.stream_k for c in found)  # stream-K lost everywhere it was timed
    for cfg in found:
        assert gemm_ring.fits(cfg, M, N, K, FP8), cfg.name
        assert gemm_ring.ring_bytes(cfg) <= gemm_ring.RING_BYTES
    assert len({c.name for c in found}) == len(found)
    assert gemm_ring.fits(gemm_ring.default_config(M, N, K, FP8, num_sms=132), M, N, K, FP8)
    # Launched plainly and, where PDL is supported, each config with PDL too.
    assert {c.pdl for c in found} <= {0}
    with_pdl = gemm_ring.candidates(M, N, K, FP8, num_sms=132, pdl=PDL_WAIT)
    assert set(with_pdl) == set(found) | {dataclasses.replace(c, pdl=PDL_WAIT) for c in found}
    assert len(with_pdl) == 2 * len(found)


def test_splits_from_below_take_the_deepest_ring_that_fits():
    """128 x 4096 x 4096 on 132 SMs: the wide tile's 32 tiles split 5 ways (160 programs) spill
    past one a SM, so 4 ways (128) is offered too, in the deepest of the ring's depths that
    fits (4: the 6 the ring's bytes hold do not, the end's fp32 tile beside them); 64 rows of
    x at M = 64 and 7168 x 256: 112 tiles of 2 steps, unsplit from below, in 2 slots."""
    wide = {c for c in gemm_ring.candidates(128, 4096, 4096, FP8, num_sms=132)
            if c.block_n == 128}
    assert {c.split_k for c in wide} >= {4, 5}
    below = {c for c in wide if c.split_k == 4}
    assert {c.stages for c in below} == {4}
    assert not gemm_ring.fits(dataclasses.replace(next(iter(below)), stages=6),
                              128, 4096, 4096, FP8)
    unsplit = [c for c in gemm_ring.candidates(64, 7168, 256, FP8, num_sms=132)
               if c.split_k == 1 and not c.stream_k]
    assert unsplit and all(c.stages == 2 for c in unsplit)


def test_stream_k_at_each_count_of_programs_an_sm():
    """``streamed`` (not offered to the tuner, run by name): stream-K for every tile and step,
    unsplit, at 1, 2 and 4 programs an SM where that many rings of 2 slots fit (one for the wide
    tile), with the deepest ring that many hold, and registers capped to hold them."""
    def streamed(M, N, K):
        return [c for bn, bm in gemm_ring.tiles_for(M) for bk in gemm_ring.BLOCK_KS
                for c in gemm_ring.streamed(bm, bk, bn, M, N, K, FP8)]

    found = streamed(16, 7168, 2048)
    assert {(c.block_k, c.stream_k) for c in found} == {
        (bk, n) for bk in gemm_ring.BLOCK_KS for n in (1, 2, 4)}
    for c in found:
        assert (c.split_k, c.add_splits) == (1, 0), c.name
        deeper = dataclasses.replace(c, stages=c.stages + 1)
        assert (c.stages == 8 or gemm_ring.ring_bytes(deeper) * c.stream_k > gemm_ring.RING_BYTES
                or not gemm_ring.fits(deeper, 16, 7168, 2048, FP8)), c.name
        regs = gemm_ring.max_registers(c)
        assert regs * c.num_warps * 32 * c.stream_k <= 65536 and regs <= 255, c.name
    assert gemm_ring.max_registers(dataclasses.replace(found[0], stream_k=0)) is None
    # 64 rows of x at 256 of K a step: 4 rings of 2 slots do not fit; the wide tile one an SM.
    at_64 = streamed(64, 7168, 2048)
    assert (256, 4) not in {(c.block_k, c.stream_k) for c in at_64 if c.block_n == 64}
    wide = [c for c in streamed(128, 7168, 2048) if c.block_n == 128]
    assert wide and {c.stream_k for c in wide} == {1}


def test_a_weight_copied_for_tma_goes_without_pdl(monkeypatch):
    """With PDL w's slots load before the wait, before which the copy the launcher has just
    made of a w TMA cannot read is not sure to be seen: such a launch goes without PDL."""
    monkeypatch.setattr(_splits, "pdl_supported", lambda device: True)
    xq = torch.randn(16, 256).to(FP8)
    out = torch.empty(16, 64, dtype=torch.bfloat16)
    config = RingConfig(16, 128, 2, 1, pdl=PDL_WAIT)
    aligned = torch.randn(64, 256).to(FP8)
    call = gemm_ring.ring_call(xq, aligned, None, out, torch.ones(16), torch.ones(64), config)
    assert call.launch_pdl and call.constexprs["PDL"]
    wide = torch.zeros(64, 256 + 16).to(FP8)
    call = gemm_ring.ring_call(xq, wide[:, 8:264], None, out, torch.ones(16), torch.ones(64),
                               config)
    assert not call.launch_pdl and not call.constexprs["PDL"]


def test_refuses_the_interpreter_other_gpus_and_tiled_weights(monkeypatch):
    """It says what to use instead: in the interpreter, off Hopper, and for the pre-shuffled
    family (whose registry has no ring)."""
    from gemmtune.families.a8w8_bpreshuffle.op import REGISTRY as SHUFFLED
    from gemmtune.kernels.problem import GemmProblem, Scaling
    from gemmtune.kernels.triton import _checks

    cfg = RingConfig(16, 128, 2, 1)
    monkeypatch.setattr(_checks, "interpreted", lambda: True)
    assert "interpreter" in gemm_ring.why_not_supported(cfg, 16, 64, 256, FP8, torch.bfloat16)
    with pytest.raises(ValueError, match="interpreter"):
        gemm_ring.gemm_ring(torch.zeros(16, 256).to(FP8), torch.zeros(64, 256).to(FP8))
    monkeypatch.setattr(_checks, "interpreted", lambda: False)
    monkeypatch.setattr(_swapped, "runs_here", lambda: False)
    assert "written for Hopper" in gemm_ring.why_not_supported(cfg, 16, 64, 256, FP8,
                                                                torch.bfloat16)
    from gemmtune.dispatch import KernelNameError

    with pytest.raises(KernelNameError, match="triton.ring"):
        SHUFFLED.resolve_for(cfg.name, GemmProblem(16, 64, 256, FP8, torch.bfloat16,
                                                   scaling=Scaling.rowwise, preshuffled=True))


def test_block_scales_take_steps_of_128(monkeypatch):
    """The block-scale family's registry takes the ring with steps of 128 (one scale block a
    step) and refuses steps of 256, saying why."""
    from gemmtune.dispatch import KernelNameError
    from gemmtune.families.a8w8_blockscale.op import REGISTRY as BLOCKSCALE
    from gemmtune.kernels.problem import GemmProblem, Scaling

    monkeypatch.setattr(_swapped, "why_not_here", lambda kernel: None)  # as on a Hopper
    monkeypatch.setattr(gemm_ring, "why_not_here", lambda kernel: None)
    problem = GemmProblem(16, 1536, 7168, FP8, torch.bfloat16, scaling=Scaling.block)
    assert BLOCKSCALE.can_run(RingConfig(16, 128, 8, 4).name, problem)
    with pytest.raises(KernelNameError, match="block_k=256 must divide 128"):
        BLOCKSCALE.resolve_for(RingConfig(16, 256, 4, 4).name, problem)


# --- GPU -----------------------------------------------------------------------------------

# (M, N, K, config): blocks of x's rows 8-64 and several blocks past 64, steps of 128-256, K not
# a multiple of the step (TMA's zero fill), 2-8 slots, rings longer than a split's steps,
# splits that divide the steps and that do not, N past a multiple of 64; the wide tile (128
# rows of w and of x) with N and M past multiples of 128.
GPU_CASES = [
    (1, 576, 7168, RingConfig(8, 256, 4, 4)),
    (5, 1040, 2320, RingConfig(8, 128, 8, 3)),
    (16, 4096, 512, RingConfig(16, 128, 2, 2)),
    (16, 1536, 7168, RingConfig(16, 256, 4, 7)),
    (31, 256, 7168, RingConfig(32, 256, 4, 28)),
    (64, 7168, 2048, RingConfig(64, 256, 4, 1)),
    (64, 1040, 4096, RingConfig(64, 128, 8, 5)),
    (100, 4096, 1040, RingConfig(64, 256, 2, 2)),
    (600, 512, 1024, RingConfig(64, 256, 4, 1)),
    # splits added into one sum per tile (R1)
    (1, 576, 7168, RingConfig(8, 256, 4, 4, 1)),
    (16, 1536, 7168, RingConfig(16, 256, 4, 7, 1)),
    (31, 256, 7168, RingConfig(32, 256, 4, 28, 1)),
    (100, 4096, 1040, RingConfig(64, 256, 2, 2, 1)),
    (5, 1040, 2320, RingConfig(8, 128, 8, 3, 1)),
    # the wide tile: summed in order, and added (32 splits of a narrow long-K weight; N and M
    # past whole tiles, whose sums' rows past them are added but never stored)
    (100, 576, 7168, RingConfig(128, 128, 3, 8, 0, 128)),
    (128, 576, 7168, RingConfig(128, 128, 4, 32, 1, 128)),
    (200, 1040, 2320, RingConfig(128, 128, 4, 3, 1, 128)),
    # stream-K (on 132 SMs): runs of 1.3 steps of 28-step tiles (4 programs an SM), of 7.8
    # steps of 4-step tiles (parts and whole tiles), the wide tile's runs of 2.6 of 19
    (16, 1536, 7168, RingConfig(16, 256, 2, 1, 0, 64, 4)),
    (16, 16384, 512, RingConfig(16, 128, 4, 1, 0, 64, 1)),
    (200, 1040, 2320, RingConfig(128, 128, 4, 1, 0, 128, 1)),
    # PDL: w's slots loading before the wait, x's after (more slots than a split's steps,
    # added splits, the wide tile); stream-K, which waits first
    (5, 1040, 2320, RingConfig(8, 128, 8, 3, 1, pdl=PDL_WAIT)),
    (16, 4096, 512, RingConfig(16, 128, 2, 2, pdl=PDL_WAIT)),
    (100, 576, 7168, RingConfig(128, 128, 3, 8, 0, 128, pdl=PDL_WAIT)),
    (16, 1536, 7168, RingConfig(16, 256, 2, 1, 0, 64, 4, PDL_WAIT)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, config", GPU_CASES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("layout", ["tensor", "token_channel", "token_tensor"])
def test_gpu_matches_reference(M, N, K, config, layout):
    def gemm(xq, wq, bias, out_dtype, x_scale, w_scale, out):
        return gemm_ring.gemm_ring(xq, wq, bias, out_dtype, x_scale, w_scale, config, out=out)

    assert_fp8_decode_launches(gemm, M, N, K, layout, config.name,
                               not (config.add_splits or config.stream_k))


@pytest.mark.gpu
@pytest.mark.parametrize("pitch", [2048 + 64, 2048 + 8])
def test_gpu_strided_operands(pitch):
    """x and w with row pitches wider than K (16-byte aligned: read in place; not: copied) and
    an output that is a slice of a wider one."""
    M, N, K = 16, 1000, 2048
    gen = generator(pitch)
    xq, wq, x_scale, w_scale = quantised_operands(M, N, K, FP8, "token_channel", gen)
    wide_x = torch.zeros(M, pitch, device=DEVICE).to(FP8)
    wide_x[:, :K] = xq
    wide_w = torch.zeros(N, pitch, device=DEVICE).to(FP8)
    wide_w[:, :K] = wq
    wide_out = torch.full((M, N + 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    y = gemm_ring.gemm_ring(wide_x[:, :K], wide_w[:, :K], None, torch.bfloat16, x_scale,
                            w_scale, RingConfig(16, 256, 4, 2), out=wide_out[:, :N])
    check_fp8_decode(y, xq, wq, x_scale, w_scale, None, f"pitch={pitch}")
    assert torch.isnan(wide_out[:, N:]).all()


@pytest.mark.gpu
def test_gpu_long_k_is_as_precise_as_cublas():
    """Each step's MMA starts from zero and is added in fp32: over K = 25600 in one split the
    error stays near cuBLAS's (which promotes its FP8 sums)."""
    assert_long_k_as_precise_as_cublas(
        lambda xq, wq, x_scale, w_scale: gemm_ring.gemm_ring(
            xq, wq, None, torch.float32, x_scale, w_scale, RingConfig(16, 256, 8, 1)))


@pytest.mark.gpu
def test_gpu_through_dispatch_with_3d_x_and_n_under_64():
    """The ring named as gemm_a8w8's kernel (dispatch's check, plan and launch, called twice:
    the second replays the first's launch with its descriptors rebuilt): x (batch, tokens, K),
    N smaller than w's 64-row box."""
    import gemmtune

    M, N, K = 12, 40, 1024
    gen = generator(4)
    xq, wq, x_scale, w_scale = quantised_operands(M, N, K, FP8, "token_channel", gen)
    name = RingConfig(16, 256, 2, 2).name
    for _ in range(2):
        y = gemmtune.gemm_a8w8(xq.reshape(3, 4, K), wq, x_scale.reshape(3, 4, 1),
                               w_scale.reshape(N, 1), kernel=name)
        assert y.shape == (3, 4, N)
        check_fp8_decode(y.reshape(M, N), xq, wq, x_scale, w_scale, None, name)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [RingConfig(16, 256, 4, 1, pdl=PDL_WAIT),
                                    RingConfig(8, 128, 8, 4, 1, pdl=PDL_WAIT)],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pdl_chain_reads_its_input_after_the_producer(config, graph):
    """Each GEMM's x quantised from the previous one's output and written into its buffer
    (poisoned) by a kernel that lets the GEMM start ~20 µs before it writes: with PDL only w
    may load before the wait."""
    gemm_checks.pdl_chain_reads_its_input_after_the_producer(
        gemm_ring.launch_gemm_ring, config, 16 if config.block_m == 16 else 5, 2048, graph,
        60 + config.block_m, weight=gemm_checks.fp8_chain_weight(False, config.name),
        between=gemm_checks.fp8_quantised_late(False, scales_late=False))



# (M, N, K, config) with block scales: steps of 128, K past a whole block (the last block's
# scale covers a partial step), N past a block of 128 rows, splits and several blocks of x.
BLOCK_SCALED_CASES = [
    (1, 576, 7168, RingConfig(8, 128, 8, 4)),
    (5, 1040, 2320, RingConfig(8, 128, 8, 3)),
    (16, 4096, 512, RingConfig(16, 128, 2, 2)),
    (31, 256, 7168, RingConfig(32, 128, 4, 28)),
    (64, 1040, 4096, RingConfig(64, 128, 8, 5)),
    (100, 4096, 1024, RingConfig(64, 128, 4, 2)),
    (5, 1040, 2320, RingConfig(8, 128, 8, 3, 1)),
    (64, 1040, 4096, RingConfig(64, 128, 8, 5, 1)),
    (31, 256, 7168, RingConfig(32, 128, 4, 1, 0, 64, 2)),  # stream-K: a step a program
    (31, 1024, 7168, RingConfig(32, 128, 4, 1, 0, 64, 1)),  # runs of 6.8 steps, across tiles
    (31, 256, 7168, RingConfig(32, 128, 4, 28, pdl=PDL_WAIT)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, config", BLOCK_SCALED_CASES,
                         ids=lambda v: getattr(v, "name", v))
def test_gpu_block_scales_match_the_dequantised_reference(M, N, K, config):
    def gemm(xq, wq, bias, out_dtype, x_scale, w_scale, out):
        return gemm_ring.gemm_ring(xq, wq, bias, out_dtype, x_scale, w_scale, config, out=out,
                                   block_scales=True)

    assert_block_scaled_decode_launches(gemm, M, N, K, config.name,
                                        not (config.add_splits or config.stream_k))


@pytest.mark.gpu
def test_gpu_replayed_calls_on_new_inputs_and_weights(monkeypatch):
    """Eager calls through gemm_a8w8 and gemm_a8w8_blockscale with the ring named (splits summed
    in order and added): after each shape's first call every call is a replay (its descriptors
    rebuilt around the call's x and w), right on new activations and on two weights of one shape
    (two layers)."""
    import gemmtune
    from gemm_checks import block_scaled_operands, check_block_scaled_decode
    from gemmtune.kernels.triton._replay import Replay

    served = []  # each launch a replay served: through the fast path or the checked one
    real_fast, real_call = Replay.launch_fast, Replay.__call__

    def fast(self, roles):
        launched = real_fast(self, roles)
        if launched:
            served.append(self)
        return launched

    monkeypatch.setattr(Replay, "launch_fast", fast)
    monkeypatch.setattr(Replay, "__call__", lambda self, roles: (served.append(self),
                                                                 real_call(self, roles)))
    M, N, K = 16, 1280, 2048
    rowwise = [quantised_operands(M, N, K, FP8, "token_channel", generator(s)) for s in (1, 2)]
    blocked = [block_scaled_operands(M, N, K, generator(s)) for s in (3, 4)]
    for step in range(6):
        xq, _, x_scale, _ = quantised_operands(M, N, K, FP8, "token_channel", generator(10 + step))
        _, wq, _, w_scale = rowwise[step % 2]
        y = gemmtune.gemm_a8w8(xq, wq, x_scale.reshape(M, 1), w_scale.reshape(N, 1),
                               kernel=RingConfig(16, 256, 4, 2).name)
        check_fp8_decode(y, xq, wq, x_scale, w_scale, None, f"a8w8 call {step}")
        xq, _, x_scale, _ = block_scaled_operands(M, N, K, generator(20 + step))
        _, wq, _, w_scale = blocked[step % 2]
        y = gemmtune.gemm_a8w8_blockscale(xq, wq, x_scale, w_scale,
                                          kernel=RingConfig(16, 128, 8, 2, 1).name)
        check_block_scaled_decode(y, xq, wq, x_scale, w_scale, None, f"block call {step}")
    assert len(served) == 10  # all but each family's first call


def test_tuners_offer_both_gluon_kernels_where_they_run(monkeypatch):
    """On a Hopper (faked here) the a8w8 and block-scale tuners offer the ring's and the
    register-direct kernel's configs at M <= 64, the block-scale tuner only those with steps of
    128; the pre-shuffled family's registry has no ring."""
    from gemmtune.families import _gemm_tuner
    from gemmtune.families.a8w8.op import REGISTRY as A8W8
    from gemmtune.families.a8w8_blockscale.op import REGISTRY as BLOCKSCALE
    from gemmtune.families.a8w8_bpreshuffle.op import REGISTRY as SHUFFLED
    from gemmtune.kernels.problem import GemmProblem, Scaling
    from gemmtune.kernels.triton import _checks, _splits, gemm_frag

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_checks, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(_splits, "pdl_where_supported", lambda: _splits.PDL_WAIT)
    for module in (gemm_ring, gemm_frag):
        monkeypatch.setattr(module, "why_not_here", lambda kernel: None)
    for m, n, k in ((16, 1536, 7168), (64, 1040, 4096)):
        def names(registry, scaling, preshuffled=False):
            p = GemmProblem(m, n, k, FP8, torch.bfloat16, scaling=scaling, preshuffled=preshuffled)
            return [c.name for c in _gemm_tuner.gluon_candidates(p, registry)]

        rowwise, blocked = names(A8W8, Scaling.rowwise), names(BLOCKSCALE, Scaling.block)
        shuffled = names(SHUFFLED, Scaling.rowwise, preshuffled=True)
        for found in (rowwise, blocked):
            assert any(n.startswith("triton.ring:") for n in found), found
            assert any(n.startswith("triton.frag:") for n in found), found
        assert any(".BK256." in n for n in rowwise)
        assert blocked and all(".BK128." in n for n in blocked), blocked
        assert shuffled and not any(n.startswith("triton.ring:") for n in shuffled)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _gemm_tuner.gluon_candidates(GemmProblem(16, 1536, 7168, FP8, torch.bfloat16,
                                                    scaling=Scaling.block), BLOCKSCALE) == []


def test_added_splits_take_one_zeroed_sum_per_tile():
    """The workspace of a launch whose splits add their partials: one fp32 sum per tile (not one
    per split), zeroed; a warmup's is never read, so not zeroed; one split needs none."""
    from gemmtune.kernels.triton._splits import workspace

    x, out = torch.zeros(16, 256), torch.zeros(16, 64)
    parts, counters, per_call = workspace(x, out, 3, 1024, 4, None, False, add_splits=True)
    assert parts.numel() == 3 * 1024 and not parts.any() and parts.dtype == torch.float32
    assert counters.numel() == 3 and not counters.any() and per_call  # the CPU: made per call
    ordered, _, _ = workspace(x, out, 3, 1024, 4, None, False)
    assert ordered.numel() == 3 * 4 * 1024
    assert workspace(x, out, 3, 1024, 4, None, True, add_splits=True).partials.numel() == 3072
    assert workspace(x, out, 3, 1024, 1, None, False, add_splits=True).partials is out


@pytest.mark.gpu
def test_gpu_added_splits_leave_the_streams_sums_zero():
    """Launches of several shapes whose splits add into the stream's tile sums, one after
    another: each right, and the sums zero after each (the next launch's starting point)."""
    from gemmtune.kernels.triton._splits import stream_sums

    for seed, (M, N, K, config) in enumerate([(16, 1536, 7168, RingConfig(16, 256, 4, 7, 1)),
                                               (64, 1040, 4096, RingConfig(64, 128, 8, 5, 1)),
                                               (16, 1536, 7168, RingConfig(16, 256, 4, 7, 1)),
                                               (128, 576, 7168,
                                                RingConfig(128, 128, 4, 32, 1, 128))]):
        xq, wq, x_scale, w_scale = quantised_operands(M, N, K, FP8, "token_channel",
                                                      generator(seed))
        y = gemm_ring.gemm_ring(xq, wq, None, torch.bfloat16, x_scale, w_scale, config)
        check_fp8_decode(y, xq, wq, x_scale, w_scale, None, config.name)
        torch.cuda.synchronize()
        assert not stream_sums(xq.device, 1).any(), config.name


def test_the_deterministic_switches_sum_added_splits_in_order(monkeypatch):
    """GEMMTUNE_DETERMINISTIC=1, or torch's deterministic switch, turns a row's added splits
    (.R1) into splits summed in order, and stream-K (.K1: wsring's persistent programs, of
    whole tiles; ring's a program a tile), when its kernel is resolved; other configs are
    kept."""
    from gemmtune.kernels.triton.dispatchable import TritonKernel

    added, ordered = RingConfig(16, 256, 4, 7, 1), RingConfig(16, 256, 4, 7)
    assert TritonKernel(added.name).config == added
    monkeypatch.setenv("GEMMTUNE_DETERMINISTIC", "1")
    assert TritonKernel(added.name).config == ordered
    assert TritonKernel(added.name).name == ordered.name
    assert TritonKernel("triton.frag:BM16.BK256.SK4.A1.P0.R1").config.add_splits == 0
    streamed = "triton.wsring:BM64.BN64.S4.SK1.R0.O2.P1.L1.G0.F0.K1"
    assert TritonKernel(streamed).name == "triton.wsring:BM64.BN64.S4.SK1.R0.O2.P1.L1"
    assert TritonKernel("triton.ring:BM16.BK256.S8.SK1.R0.N64.K2").name == \
        "triton.ring:BM16.BK256.S8.SK1"
    monkeypatch.setenv("GEMMTUNE_DETERMINISTIC", "0")
    assert TritonKernel(streamed).name == streamed
    assert TritonKernel(added.name).config == added
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert TritonKernel(added.name).config == ordered
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["triton.ring:BM16.BK256.S4.SK7.R1",
                                  "triton.frag:BM16.BK256.SK7.A1.P1.R1"])
def test_gpu_added_splits_back_to_back_and_in_a_graph(name):
    """Launches whose splits add into the stream's tile sums, back to back into outputs made
    beforehand (nothing between them: with PDL the next launch's programs start before the last
    one ends), then the same launches captured in a CUDA graph and replayed on new x: every
    output right, the sums left zero."""
    from gemmtune.kernels.triton._splits import stream_sums
    from gemmtune.kernels.triton.dispatchable import TritonKernel

    M, N, K, calls = 16, 1536, 7168, 4
    kernel = TritonKernel(name)
    _, wq, _, w_scale = quantised_operands(M, N, K, FP8, "token_channel", generator(1))
    xs = [quantised_operands(M, N, K, FP8, "token_channel", generator(10 + i))
          for i in range(calls)]
    outs = [torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
            for _ in range(calls)]
    for (xq, _, x_scale, _), y in zip(xs, outs):
        kernel(xq, wq, None, torch.bfloat16, x_scale, w_scale, out=y)
    torch.cuda.synchronize()
    for i, ((xq, _, x_scale, _), y) in enumerate(zip(xs, outs)):
        check_fp8_decode(y, xq, wq, x_scale, w_scale, None, f"{name} call {i}")
    assert not stream_sums(wq.device, 1).any()

    static = [(xq.clone(), x_scale.clone()) for xq, _, x_scale, _ in xs]
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the graph's own stream: its tile sums are its own
        kernel(static[0][0], wq, None, torch.bfloat16, static[0][1], w_scale, out=outs[0])
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for (xq, x_scale), y in zip(static, outs):
                kernel(xq, wq, None, torch.bfloat16, x_scale, w_scale, out=y)
    for replay in range(2):
        fresh = [quantised_operands(M, N, K, FP8, "token_channel", generator(20 + 4 * replay + i))
                 for i in range(calls)]
        for (xq, x_scale), (new_x, _, new_scale, _) in zip(static, fresh):
            xq.copy_(new_x)
            x_scale.copy_(new_scale)
        for y in outs:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, ((new_x, _, new_scale, _), y) in enumerate(zip(fresh, outs)):
            check_fp8_decode(y, new_x, wq, new_scale, w_scale, None, f"{name} replay {i}")

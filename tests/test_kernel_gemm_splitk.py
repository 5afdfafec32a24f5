"""gemm_splitk against an fp32 reference: ragged shapes, dtypes, bias, split counts, fp8 scales.

On CPU the kernel runs in Triton's interpreter, where every program is a Python call: grids stay
at a few dozen programs (tiles x splits). The ``gpu``-marked tests run decode sizes, many splits
racing for the same tile counter, and CUDA-graph capture on the GPU machine.
"""

import dataclasses

import pytest
import torch

import gemm_checks
from gemm_checks import DEVICE, DTYPE_PAIRS, assert_matches_reference, generator, poisoned, randn
from gemmtune.kernels.triton.gemm_splitk import (
    KERNEL_PREFIX,
    PDL_OFF,
    PDL_PREFETCH,
    PDL_WAIT,
    SplitKConfig,
    candidates,
    default_config,
    fits,
    gemm_splitk,
    launch_gemm_splitk,
    num_tiles,
    prefetch_row_bytes,
    why_not_fits,
    why_not_supported,
)
from gemmtune.kernels.triton._splits import stream_counters

# (M, N, K): M 1, 13 and 33 (one ragged M tile, two), N ragged against every BN, and K a multiple
# of neither BK nor BK * split_k, so the last K step of the last split is partial.
RAGGED_SHAPES = [(1, 17, 161), (13, 65, 200), (33, 40, 129)]
# Small tiles so that the ragged shapes have several tiles and splits: 3-9 programs.
SMALL = SplitKConfig(16, 32, 32, 3, 4, 2)


@pytest.mark.parametrize("M,N,K", RAGGED_SHAPES)
@pytest.mark.parametrize("dtype,out_dtype", DTYPE_PAIRS)
def test_ragged_shapes_match_reference(M, N, K, dtype, out_dtype):
    with_bias = M != 1  # M = 1 runs without bias
    gemm_checks.ragged_shape(gemm_splitk, M, N, K, dtype, out_dtype, with_bias, SMALL)


@pytest.mark.parametrize("check", gemm_checks.LAUNCHER_CHECKS, ids=lambda c: c.__name__)
def test_launcher_contract(check):
    """Default out dtype and config, fp8's bf16 default, K = 0, M = 0, argument errors."""
    check(gemm_splitk)


@pytest.mark.parametrize("split_k", [1, 2, 4, 7, 9])
def test_split_counts(split_k):
    # K = 129 in BK = 16 steps is 9 steps, the last of 1 element: splits of 4+5, 2+2+2+3, ...,
    # one step each at 9.
    M, N, K = 33, 40, 129
    gen = generator(20 + split_k)
    x, w = randn(M, K, gen=gen, dtype=torch.bfloat16), randn(N, K, gen=gen,
                                                             dtype=torch.bfloat16)
    bias = randn(N, gen=gen)
    config = SplitKConfig(32, 32, 16, split_k, 4, 2)
    y = gemm_splitk(x, w, bias=bias, config=config, out=poisoned(M, N, torch.bfloat16))
    assert_matches_reference(y, x, w, bias)


def test_empty_splits_add_nothing():
    # fits() rejects split_k above the number of K steps, but the kernel stays right without it:
    # 12 splits of 5 steps leave 7 splits empty, whose zero partials must still count in.
    M, N, K = 13, 40, 70
    config = SplitKConfig(16, 32, 16, 12, 4, 2)
    assert "split_k=12" in why_not_fits(config, M, N, K, torch.float32)
    gen = generator(21)
    x, w = randn(M, K, gen=gen), randn(N, K, gen=gen)
    out = poisoned(M, N, torch.float32)
    launch_gemm_splitk(x, w, None, out, None, None, config)
    assert_matches_reference(out, x, w)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])
def test_bias_of_another_dtype(bias_dtype):
    gen = generator(2)
    x, w = randn(13, 100, gen=gen, dtype=torch.bfloat16), randn(40, 100, gen=gen,
                                                                dtype=torch.bfloat16)
    bias = randn(40, gen=gen, dtype=bias_dtype)
    y = gemm_splitk(x, w, bias=bias, config=SMALL, out=poisoned(13, 40, torch.bfloat16))
    assert_matches_reference(y, x, w, bias)


@pytest.mark.parametrize("x_kind,w_kind", [("x_t", "w_s"), ("x_s", "w_t")])
def test_non_contiguous_inputs(x_kind, w_kind):
    gemm_checks.non_contiguous_inputs(gemm_splitk, 13, 40, 129, torch.bfloat16, x_kind, w_kind,
                                      SplitKConfig(16, 32, 32, 2, 4, 2))


def test_non_contiguous_output():
    gemm_checks.non_contiguous_output(gemm_splitk, SplitKConfig(16, 32, 32, 2, 2, 2))


@pytest.mark.parametrize("M,N,K,split_k", [(13, 65, 200, 3), (1, 40, 129, 2)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_per_tensor_scaled(M, N, K, split_k, out_dtype):
    gemm_checks.fp8_per_tensor_scaled(gemm_splitk, M, N, K, out_dtype,
                                      SplitKConfig(16, 32, 32, split_k, 4, 2))


@pytest.mark.parametrize("M,N,K,split_k", [(13, 65, 200, 3), (1, 40, 129, 1), (33, 40, 129, 2)])
@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("layout", list(gemm_checks.SCALE_LAYOUTS))
def test_quantised_with_row_and_column_scales(M, N, K, split_k, q_dtype, layout):
    # int8 partials leave the int32 accumulator as fp32 before the split reduction.
    gemm_checks.quantised_scaled(gemm_splitk, M, N, K, q_dtype, layout, torch.bfloat16,
                                 SplitKConfig(16, 32, 32, split_k, 4, 2))


def test_deterministic():
    gemm_checks.deterministic(gemm_splitk, 33, 40, 129, SplitKConfig(32, 32, 16, 4, 4, 2))


def test_caller_owned_counters_are_left_zero():
    M, N, K = 13, 65, 200
    config = SMALL
    counters = torch.zeros(num_tiles(config, M, N), dtype=torch.int32, device=DEVICE)
    for seed in (10, 11):  # the second launch relies on the first leaving the counters zero
        gen = generator(seed)
        x, w = randn(M, K, gen=gen), randn(N, K, gen=gen)
        out = poisoned(M, N, torch.float32)
        launch_gemm_splitk(x, w, None, out, None, None, config, counters=counters)
        assert_matches_reference(out, x, w)
        assert not counters.any()


# --- config space --------------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    SplitKConfig(16, 64, 256, 8, 4, 3),
    SplitKConfig(64, 128, 64, 16, 8, 5),
    default_config(1, 576, 7168, torch.bfloat16),
])
def test_name_round_trip(config):
    gemm_checks.name_round_trip(config, KERNEL_PREFIX)


def test_name_format():
    assert SplitKConfig(16, 64, 256, 8, 4, 3).name == "triton.splitk:BM16.BN64.BK256.SK8.W4.S3"
    # The launch mode is spelled only where it is not the default, so older names keep parsing.
    assert SplitKConfig(16, 64, 256, 8, 4, 3, PDL_PREFETCH).name == \
        "triton.splitk:BM16.BN64.BK256.SK8.W4.S3.P2"
    assert SplitKConfig.from_name("triton.splitk:BM16.BN64.BK256.SK8.W4.S3").pdl == PDL_OFF
    assert SplitKConfig.from_name("triton.splitk:BM16.BN64.BK256.SK8.W4.S3.P1").pdl == PDL_WAIT


@pytest.mark.parametrize("name,bad_part", [
    ("triton.splitk:BM16.BN64.BK256.SK8.W4", "5 dot-separated fields, expected 6 to 9"),
    ("triton.splitk:BM16.BN64.BK256.SK8.W4.S3.P1.PK0.SW1.P1", "10 dot-separated fields"),
    ("triton.splitk:BM16.BN64.BK256.SK8.W4.S3.P1.PK0.P1", "'P1'"),
    ("triton.splitk:BM16.BN64.BK256.SK8.W4.S3.Q1", "'Q1'"),
    ("triton.tile:BM16.BN64.BK256.SK8.W4.S3", "'triton.tile'"),
    ("BM16.BN64.BK256.SK8.W4.S3", "prefix"),
    ("triton.splitk:BM16.BN64.BK256.G8.W4.S3", "'G8'"),
    ("triton.splitk:BM16.BN64.BK256.SKx.W4.S3", "'SKx'"),
    ("triton.splitk:BM16.BN64.BK256.SK-2.W4.S3", "'SK-2'"),
])
def test_from_name_rejects_bad_names(name, bad_part):
    gemm_checks.assert_bad_name(SplitKConfig.from_name, name, bad_part,
                                "triton.splitk:BM<int>.BN<int>.BK<int>.SK<int>.W<int>.S<int>"
                                ".[P<int>].[PK<int>].[SW<int>]")


@pytest.mark.parametrize("config,reason", [
    (SplitKConfig(48, 64, 64, 2, 4, 3), "block_m=48"),
    (SplitKConfig(16, 8, 64, 2, 4, 3), "block_n=8"),
    (SplitKConfig(16, 64, 512, 2, 4, 3), "block_k=512"),
    (SplitKConfig(16, 64, 64, 0, 4, 3), "split_k=0"),
    (SplitKConfig(16, 64, 64, 65, 4, 3), "split_k=65"),
    (SplitKConfig(16, 64, 256, 17, 4, 3), "split_k <= 16"),  # 4096 / 256 = 16 steps
    (SplitKConfig(16, 64, 64, 2, 3, 3), "num_warps=3"),
    (SplitKConfig(16, 64, 64, 2, 4, 0), "num_stages=0"),
    (SplitKConfig(16, 64, 64, 2, 4, 3, 3), "pdl=3"),
    (SplitKConfig(256, 256, 64, 2, 4, 2), "registers"),  # 512 accumulator registers per thread
    (SplitKConfig(64, 256, 256, 2, 8, 4), "shared memory"),  # 640 KiB of bf16 stages
])
def test_fits_rejects(config, reason):
    assert not fits(config, 64, 4096, 4096, torch.bfloat16)
    assert reason in why_not_fits(config, 64, 4096, 4096, torch.bfloat16)


def test_fits_split_bound_is_k_rounded_up():
    # K = 1000 is 4 steps of 256 (the last partial): 4 splits fit, 5 do not.
    assert fits(SplitKConfig(16, 64, 256, 4, 4, 2), 1, 576, 1000, torch.bfloat16)
    assert not fits(SplitKConfig(16, 64, 256, 5, 4, 2), 1, 576, 1000, torch.bfloat16)
    # K = 0 still takes one (empty) split.
    assert fits(SplitKConfig(16, 64, 256, 1, 4, 2), 1, 576, 0, torch.bfloat16)


def test_why_not_supported_rejects_dtypes():
    config = SplitKConfig(16, 64, 64, 2, 4, 3)
    assert "input dtype" in why_not_supported(config, 1, 64, 128, torch.float64, torch.bfloat16)
    assert "output dtype" in why_not_supported(config, 1, 64, 128, torch.bfloat16, torch.int8)
    assert why_not_supported(config, 1, 64, 128, torch.float8_e4m3fn, torch.bfloat16) is None


DECODE_SHAPES = [(576, 7168), (1536, 7168), (4096, 4096), (6144, 4096), (28672, 4096),
                 (4096, 14336), (1280, 8192), (8192, 1024), (7168, 2048)]  # (N, K)
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_candidates_fit_and_stay_few(dtype):
    for N, K in DECODE_SHAPES + [(17, 33), (65, 4096)]:
        for M in (1, 13, 16, 32, 33, 64, 200, 4096):
            found = candidates(M, N, K, dtype)
            assert 0 < len(found) <= 150, (M, N, K, dtype, len(found))
            assert len(set(found)) == len(found)
            bad = [(c.name, why_not_fits(c, M, N, K, dtype)) for c in found
                   if not fits(c, M, N, K, dtype)]
            assert not bad, bad


def test_candidates_split_where_tiles_are_few():
    # 576 columns are 9-18 tiles: every candidate must split K to reach the SMs.
    assert all(c.split_k > 1 for c in candidates(1, 576, 7168, torch.bfloat16))
    # 28672 columns are 224-896 tiles: no split is needed and none is left out.
    assert any(c.split_k == 1 for c in candidates(16, 28672, 4096, torch.bfloat16))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("M", [1, 13, 16, 32, 64, 65, 1000, 65536])
def test_default_config_fits(dtype, M):
    for N, K in DECODE_SHAPES + [(17, 33), (33, 0), (65, 16)]:
        assert fits(default_config(M, N, K, dtype), M, N, K, dtype)


def test_candidates_carry_the_launch_mode():
    found = candidates(16, 4096, 4096, torch.bfloat16, pdl=PDL_PREFETCH)
    assert found and all(c.pdl == PDL_PREFETCH for c in found)
    assert all(c.pdl == PDL_OFF for c in candidates(16, 4096, 4096, torch.bfloat16))


@pytest.mark.parametrize("pdl", [PDL_WAIT, PDL_PREFETCH])
def test_pdl_configs_compute_the_same_result(pdl):
    # Off the GPU (and before sm_90) a PDL config launches plainly: same numbers, no error.
    M, N, K = 13, 65, 200
    gen = generator(pdl)
    x, w = randn(M, K, gen=gen), randn(N, K, gen=gen)
    config = SplitKConfig(16, 32, 32, 3, 4, 2, pdl)
    y = gemm_splitk(x, w, config=config, out=poisoned(M, N, torch.float32))
    assert_matches_reference(y, x, w)


def test_prefetch_row_bytes():
    w = torch.empty(576, 7168, dtype=torch.bfloat16)
    # 8 MiB of w fits the 16 MiB budget: each split may prefetch all of its slice of each row.
    assert prefetch_row_bytes(w, 14) >= 7168 * 2 / 14
    # 235 MiB does not: an equal share of the budget per row and split, in 16-byte units.
    big = torch.empty(28672, 4096, dtype=torch.bfloat16)
    share = prefetch_row_bytes(big, 2)
    assert share % 16 == 0 and 0 < share and share * 28672 * 2 <= 16 * 2**20
    # The bulk prefetch needs contiguous, 16-byte aligned rows.
    assert prefetch_row_bytes(w.T.contiguous().T, 4) == 0
    assert prefetch_row_bytes(torch.empty(64, 100, dtype=torch.bfloat16)[:, :99], 1) == 0


def test_launcher_rejects_a_config_that_does_not_fit():
    x = torch.ones(16, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="num_warps=3"):
        gemm_splitk(x, x, config=SplitKConfig(16, 16, 16, 1, 3, 1))
    with pytest.raises(ValueError, match="split_k=4 leaves splits"):
        gemm_splitk(x, x, config=SplitKConfig(16, 16, 16, 4, 4, 1))  # K = 32 is 2 steps


# --- GPU: decode sizes, racing splits and CUDA graphs ----------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(576, 7168), (4096, 4096), (8192, 1024), (28672, 4096)])
@pytest.mark.parametrize("M", [1, 16, 33, 64])
def test_gpu_bf16_decode_sizes(M, N, K):
    gen = generator(M + N + K)
    x, w = randn(M, K, gen=gen, dtype=torch.bfloat16), randn(N, K, gen=gen,
                                                             dtype=torch.bfloat16)
    config = default_config(M, N, K, torch.bfloat16)
    for cfg in {config, SplitKConfig(config.block_m, 64, 128, 1, 4, 3),
                SplitKConfig(config.block_m, 32, 64, 16, 4, 4),
                SplitKConfig(config.block_m, 32, 128, 4, 2, 4, PDL_WAIT),
                SplitKConfig(config.block_m, 32, 128, 4, 2, 4, PDL_PREFETCH),
                SplitKConfig(config.block_m, 64, 128, 1, 4, 3, PDL_PREFETCH),
                SplitKConfig(config.block_m, 64, 128, 4, 4, 4, PDL_WAIT, swap_ab=1),
                SplitKConfig(config.block_m, 128, 128, 1, 4, 3, PDL_WAIT, swap_ab=1)}:
        y = gemm_splitk(x, w, config=cfg, out=poisoned(M, N, torch.bfloat16))
        assert_matches_reference(y, x, w)
        gemm_checks.assert_within_torch_error(y, x, w, cfg.name)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64])
def test_gpu_fp8_decode_size(M):
    N, K = 576, 7168
    gen = generator(M)
    x8, w8, scale_a, scale_b = gemm_checks.fp8_operands(M, N, K, gen)
    bias = randn(N, gen=gen, dtype=torch.bfloat16)
    bm = max(16, M)
    for config in (None, SplitKConfig(bm, 64, 128, 4, 4, 4, PDL_WAIT, swap_ab=1),
                   SplitKConfig(bm, 128, 128, 2, 4, 3, PDL_WAIT, swap_ab=1)):
        y = gemm_splitk(x8, w8, bias=bias, scale_a=scale_a, scale_b=scale_b, config=config,
                        out=poisoned(M, N, torch.bfloat16))
        assert_matches_reference(y, x8, w8, bias, scale=gemm_checks.FP8_SCALE)
    gemm_checks.block_scaled(gemm_splitk, M, N, K, SplitKConfig(bm, 64, 128, 4, 4, 4, PDL_WAIT,
                                                                 swap_ab=1))


@pytest.mark.gpu
def test_gpu_splits_race_deterministically():
    # 16 splits of 18 tiles.
    config = SplitKConfig(16, 32, 256, 16, 4, 3)
    gemm_checks.splits_race_deterministically(gemm_splitk, launch_gemm_splitk, config,
                                              num_tiles(config, 16, 576), 16, 576, 7168)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64])
def test_gpu_cuda_graph_replay_on_new_data(M):
    N, K = 1536, 7168
    assert default_config(M, N, K, torch.bfloat16).split_k > 1  # the workspace path is captured
    gemm_checks.cuda_graph_replay_on_new_data(gemm_splitk, M, N, K)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [PDL_WAIT, PDL_PREFETCH])
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pdl_chain_reads_its_input_after_the_producer(pdl, graph):
    gemm_checks.pdl_chain_reads_its_input_after_the_producer(
        launch_gemm_splitk, SplitKConfig(16, 32, 128, 4, 2, 4, pdl), 16, 2048, graph, 40 + pdl)


@pytest.mark.gpu
def test_gpu_stream_counters_are_per_stream_and_left_zero():
    M, N, K = 16, 576, 7168
    gen = generator(50)
    x, w = randn(M, K, gen=gen, dtype=torch.bfloat16), randn(N, K, gen=gen,
                                                             dtype=torch.bfloat16)
    config = SplitKConfig(16, 32, 256, 8, 2, 3, PDL_PREFETCH)
    side = torch.cuda.Stream()
    outs = []
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            out = poisoned(M, N, torch.bfloat16)
            launch_gemm_splitk(x, w, None, out, None, None, config)
            outs.append(out)
    torch.cuda.synchronize()
    for out in outs:
        assert_matches_reference(out, x, w)
    main_counters = stream_counters(x.device, 1)
    with torch.cuda.stream(side):
        side_counters = stream_counters(x.device, 1)
    assert main_counters.data_ptr() != side_counters.data_ptr()
    assert not main_counters.any() and not side_counters.any()


# N 130 and 200: w's last row block is partial; K 300: so is the last K block.
@pytest.mark.parametrize("M,N,K", [(5, 200, 300), (33, 130, 256)])
@pytest.mark.parametrize("config", [SplitKConfig(16, 32, 64, 3, 4, 2), SplitKConfig(32, 64, 128, 1, 4, 2)], ids=lambda c: c.name)
def test_fp8_block_scales(M, N, K, config):
    gemm_checks.block_scaled(gemm_splitk, M, N, K, config)


def test_block_scales_need_block_k_dividing_128_and_fp8():
    gemm_checks.block_scales_refusals(gemm_splitk, SplitKConfig(16, 32, 256, 1, 4, 2))


# --- FP8 accumulation promoted into fp32 (promote_k) -----------------------------------------


# wgmma tiles (block_m of 64, 4 warps): the only dots promote_k applies to.
@pytest.mark.parametrize("config", [SplitKConfig(64, 32, 64, 3, 4, 2, promote_k=64),
                                    SplitKConfig(64, 64, 128, 1, 8, 2, promote_k=32)],
                         ids=lambda c: c.name)
def test_promoted_fp8_matches_reference(config):
    gemm_checks.promoted_fp8(gemm_splitk, config)


def test_promote_k_refusals():
    gemm_checks.promote_k_refusals(gemm_splitk,
                                   SplitKConfig(64, 32, 128, 1, 4, 2, promote_k=128))


def test_promote_k_reaches_the_dot():
    gemm_checks.promote_k_reaches_the_dot(launch_gemm_splitk,
                                          SplitKConfig(64, 32, 64, 2, 4, 2, promote_k=128))


def test_promote_k_name_follows_pdl():
    config = SplitKConfig(64, 64, 256, 4, 4, 3, promote_k=128)
    # The optional fields are positional: a promoted config spells pdl too, even when off.
    assert config.name == "triton.splitk:BM64.BN64.BK256.SK4.W4.S3.P0.PK128"
    gemm_checks.name_round_trip(config, KERNEL_PREFIX)
    assert SplitKConfig.from_name("triton.splitk:BM16.BN64.BK256.SK4.W4.S3.P1").promote_k == 0


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 4])
def test_gpu_promoted_fp8_accumulation_is_precise(split_k):
    gemm_checks.promoted_accumulation_is_precise(
        gemm_splitk, SplitKConfig(64, 64, 256, split_k, 4, 3), 64, 512, 16384)


# --- the swapped dot (swap_ab: y.T = w @ x.T) ------------------------------------------------


SWAPPED = SplitKConfig(16, 32, 32, 3, 4, 2, swap_ab=1)


@pytest.mark.parametrize("M,N,K", RAGGED_SHAPES)
@pytest.mark.parametrize("dtype,out_dtype", DTYPE_PAIRS)
def test_swapped_ragged_shapes_match_reference(M, N, K, dtype, out_dtype):
    gemm_checks.ragged_shape(gemm_splitk, M, N, K, dtype, out_dtype, M != 1,
                             dataclasses.replace(SWAPPED, block_m=32 if M > 16 else 16))


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("layout", list(gemm_checks.SCALE_LAYOUTS))
def test_swapped_quantised_with_row_and_column_scales(q_dtype, layout):
    gemm_checks.quantised_scaled(gemm_splitk, 13, 65, 200, q_dtype, layout, torch.bfloat16,
                                 SWAPPED)


def test_swapped_fp8_block_scales():
    gemm_checks.block_scaled(gemm_splitk, 5, 200, 300,
                             SplitKConfig(16, 32, 64, 3, 4, 2, swap_ab=1))


def test_swapped_name_and_refusals():
    assert SWAPPED.name == "triton.splitk:BM16.BN32.BK32.SK3.W4.S2.P0.PK0.SW1"
    assert SplitKConfig.from_name(SWAPPED.name) == SWAPPED
    assert "swap_ab=2" in why_not_fits(dataclasses.replace(SWAPPED, swap_ab=2), 16, 64, 256,
                                       torch.bfloat16)
    # Promotion needs a wgmma dot: swapped, w's block_n rows are its M.
    promoted = SplitKConfig(16, 64, 128, 1, 4, 2, promote_k=64, swap_ab=1)
    assert why_not_fits(promoted, 16, 64, 256, torch.float8_e4m3fn) is None
    assert "block_n a multiple of 64" in why_not_fits(
        dataclasses.replace(promoted, block_n=32), 16, 64, 256, torch.float8_e4m3fn)


def test_swapped_promoted_fp8_matches_reference():
    gemm_checks.promoted_fp8(gemm_splitk, SplitKConfig(16, 64, 64, 3, 4, 2, promote_k=64,
                                                       swap_ab=1))


def test_swapped_promote_k_reaches_the_dot():
    gemm_checks.promote_k_reaches_the_dot(
        launch_gemm_splitk, SplitKConfig(16, 64, 64, 2, 4, 2, promote_k=128, swap_ab=1))


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 4])
def test_gpu_swapped_promoted_fp8_accumulation_is_precise(split_k):
    gemm_checks.promoted_accumulation_is_precise(
        gemm_splitk, SplitKConfig(16, 64, 256, split_k, 4, 3, swap_ab=1), 16, 512, 16384)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_swapped_candidates_fit_for_m_up_to_64(dtype):
    from gemmtune.kernels.triton.gemm_splitk import swapped_candidates

    for N, K in DECODE_SHAPES:
        for M in (1, 16, 64):
            found = swapped_candidates(M, N, K, dtype)
            # One warpgroup per tile, x's rows in one block of at least 16.
            assert found and all(c.swap_ab == 1 and c.num_warps == 4
                                 and c.block_m == max(16, 1 << (M - 1).bit_length())
                                 for c in found), (M, N, K)
            assert all(fits(c, M, N, K, dtype) for c in found)
        assert swapped_candidates(65, N, K, dtype) == []

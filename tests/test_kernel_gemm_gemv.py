"""gemm_gemv against an fp32 reference: ragged shapes, dtypes, bias, split counts, fp8 scales
per tensor, per row and per block, and its config space.

On CPU the kernel runs in Triton's interpreter: grids stay at a few dozen programs (row blocks x
splits). The ``gpu``-marked tests run decode sizes against torch, racing splits, PDL chains and
CUDA-graph capture on the GPU machine.
"""

import dataclasses

import pytest
import torch

import gemm_checks
from gemm_checks import DEVICE, DTYPE_PAIRS, assert_matches_reference, generator, poisoned, randn
from gemmtune.kernels.triton._splits import PDL_OFF, PDL_WAIT
from gemmtune.kernels.triton.gemm_gemv import (
    KERNEL_PREFIX,
    MAX_M,
    GemvConfig,
    candidates,
    default_config,
    fits,
    gemm_gemv,
    launch_gemm_gemv,
    num_tiles,
    why_not_block_scaled,
    why_not_fits,
    why_not_supported,
)

# (M, N, K): M 1, 3 and 13 (x's rows below block_m), N ragged against every BN, K a multiple of
# neither BK nor BK * split_k, so the last K step of the last split is partial.
RAGGED_SHAPES = [(1, 17, 161), (3, 65, 200), (13, 40, 129)]


def small(split_k=3, block_n=8, block_k=32, warps=2, stages=2):
    """A config small enough that the ragged shapes take several row blocks and splits."""
    return GemvConfig(block_n, block_k, split_k, warps, stages)


@pytest.mark.parametrize("M,N,K", RAGGED_SHAPES)
@pytest.mark.parametrize("dtype,out_dtype", DTYPE_PAIRS)
def test_ragged_shapes_match_reference(M, N, K, dtype, out_dtype):
    gemm_checks.ragged_shape(gemm_gemv, M, N, K, dtype, out_dtype, M != 1, small())


@pytest.mark.parametrize("check", gemm_checks.LAUNCHER_CHECKS, ids=lambda c: c.__name__)
def test_launcher_contract(check):
    """Default out dtype and config, fp8's bf16 default, K = 0, M = 0, argument errors."""
    check(gemm_gemv)


@pytest.mark.parametrize("split_k", [1, 2, 5, 9])
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("stages", [1, 2])
def test_split_counts_and_rows_below_block_m(split_k, M, stages):
    # K = 129 in BK = 16 steps is 9 steps, the last of 1 element; M = 3 leaves one row of the
    # program's 4 unread.
    N, K = 40, 129
    gen = generator(20 + split_k)
    x, w = randn(M, K, gen=gen, dtype=torch.bfloat16), randn(N, K, gen=gen,
                                                             dtype=torch.bfloat16)
    bias = randn(N, gen=gen)
    config = GemvConfig(16, 16, split_k, 4, stages)
    y = gemm_gemv(x, w, bias=bias, config=config, out=poisoned(M, N, torch.bfloat16))
    assert_matches_reference(y, x, w, bias)


@pytest.mark.parametrize("x_kind,w_kind", [("x_t", "w_s"), ("x_s", "w_t")])
def test_non_contiguous_inputs(x_kind, w_kind):
    gemm_checks.non_contiguous_inputs(gemm_gemv, 13, 40, 129, torch.bfloat16, x_kind, w_kind,
                                      small(split_k=2))


def test_non_contiguous_output():
    gemm_checks.non_contiguous_output(gemm_gemv, small(split_k=2))


@pytest.mark.parametrize("M,N,K,split_k", [(13, 65, 200, 3), (1, 40, 129, 1)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_per_tensor_scaled(M, N, K, split_k, out_dtype):
    gemm_checks.fp8_per_tensor_scaled(gemm_gemv, M, N, K, out_dtype, small(split_k))


@pytest.mark.parametrize("M,N,K,split_k", [(13, 65, 200, 3), (1, 40, 129, 1)])
@pytest.mark.parametrize("layout", list(gemm_checks.SCALE_LAYOUTS))
def test_fp8_with_row_and_column_scales(M, N, K, split_k, layout):
    gemm_checks.quantised_scaled(gemm_gemv, M, N, K, torch.float8_e4m3fn, layout,
                                 torch.bfloat16, small(split_k))


# N 130 and 200: the last row block of w and its scale block are partial; K 300 and 520: so is
# the last K step and its scale block; steps of one and of two scale blocks.
@pytest.mark.parametrize("M,N,K,config", [
    (5, 200, 300, GemvConfig(16, 128, 2, 4, 1)),
    (1, 130, 520, GemvConfig(8, 256, 2, 4, 1)),
    (2, 130, 256, GemvConfig(32, 256, 1, 8, 1)),
], ids=lambda v: v.name if isinstance(v, GemvConfig) else str(v))
def test_fp8_block_scales(M, N, K, config):
    gemm_checks.block_scaled(gemm_gemv, M, N, K, config)


def test_block_scales_need_whole_scale_blocks_per_step():
    assert "multiple of 128" in why_not_block_scaled(GemvConfig(4, 64, 1, 4, 1),
                                                     torch.float8_e4m3fn)
    assert why_not_block_scaled(GemvConfig(4, 256, 1, 4, 1), torch.float8_e4m3fn) is None
    assert "use num_stages=1" in why_not_block_scaled(GemvConfig(4, 256, 1, 4, 2),
                                                      torch.float8_e4m3fn)
    assert "float8_e4m3fn" in why_not_block_scaled(GemvConfig(4, 256, 1, 4, 1),
                                                   torch.bfloat16)
    gen = generator(2)
    xq, wq, x_scale, w_scale = gemm_checks.block_scaled_operands(4, 64, 512, gen)
    with pytest.raises(ValueError, match="block_k=64 must be a multiple of 128"):
        gemm_gemv(xq, wq, scale_a=x_scale, scale_b=w_scale, block_scales=True,
                  config=GemvConfig(4, 64, 1, 4, 1))
    # Without a config the default's step spans whole scale blocks.
    y = gemm_gemv(xq, wq, scale_a=x_scale, scale_b=w_scale, block_scales=True)
    assert y.shape == (4, 64) and not torch.isnan(y).any()


def test_int8_is_refused_with_what_to_use():
    gen = generator(3)
    xq, wq, x_scale, w_scale = gemm_checks.quantised_operands(4, 40, 64, torch.int8,
                                                              "token_channel", gen)
    with pytest.raises(ValueError, match="int8 inputs are not supported by the GEMV kernel"):
        gemm_gemv(xq, wq, scale_a=x_scale, scale_b=w_scale)


def test_m_above_max_m_is_refused():
    x = torch.ones(MAX_M + 1, 32, dtype=torch.bfloat16, device=DEVICE)
    for config in (GemvConfig(4, 32, 1, 4, 1), None):
        with pytest.raises(ValueError, match=f"M={MAX_M + 1} exceeds {MAX_M}, the rows of x"):
            gemm_gemv(x, x, config=config)


def test_deterministic():
    gemm_checks.deterministic(gemm_gemv, 13, 40, 129, small(split_k=4))


def test_caller_owned_counters_are_left_zero():
    M, N, K = 3, 65, 200
    config = small()
    counters = torch.zeros(num_tiles(config, N), dtype=torch.int32, device=DEVICE)
    for seed in (10, 11):  # the second launch relies on the first leaving the counters zero
        gen = generator(seed)
        x, w = randn(M, K, gen=gen), randn(N, K, gen=gen)
        out = poisoned(M, N, torch.float32)
        launch_gemm_gemv(x, w, None, out, None, None, config, counters=counters)
        assert_matches_reference(out, x, w)
        assert not counters.any()


def test_pdl_config_computes_the_same_result():
    # Off the GPU (and before sm_90) a PDL config launches plainly: same numbers, no error.
    M, N, K = 3, 65, 200
    gen = generator(4)
    x, w = randn(M, K, gen=gen), randn(N, K, gen=gen)
    config = dataclasses.replace(small(), pdl=PDL_WAIT)
    y = gemm_gemv(x, w, config=config, out=poisoned(M, N, torch.float32))
    assert_matches_reference(y, x, w)


# --- config space --------------------------------------------------------------------------


def test_name_format_and_round_trip():
    config = GemvConfig(4, 1024, 1, 4, 1)
    assert config.name == "triton.gemv:BN4.BK1024.SK1.W4.S1"
    assert dataclasses.replace(config, pdl=PDL_WAIT).name == \
        "triton.gemv:BN4.BK1024.SK1.W4.S1.P1"
    for c in (config, dataclasses.replace(config, pdl=PDL_WAIT),
              default_config(1, 576, 7168, torch.bfloat16)):
        gemm_checks.name_round_trip(c, KERNEL_PREFIX)
    gemm_checks.assert_bad_name(GemvConfig.from_name, "triton.gemv:BN4.BK1024.SK1.W4",
                                "4 dot-separated fields",
                                "triton.gemv:BN<int>.BK<int>.SK<int>.W<int>.S<int>.[P<int>]")


@pytest.mark.parametrize("config,reason", [
    (GemvConfig(3, 1024, 1, 4, 1), "block_n=3"),
    (GemvConfig(128, 64, 1, 4, 1), "block_n=128"),
    (GemvConfig(4, 8, 1, 4, 1), "block_k=8"),
    (GemvConfig(4, 1000, 1, 4, 1), "block_k=1000"),
    (GemvConfig(4, 1024, 0, 4, 1), "split_k=0"),
    (GemvConfig(4, 1024, 65, 4, 1), "split_k=65"),
    (GemvConfig(4, 1024, 5, 4, 1), "split_k <= 4"),  # 4096 / 1024 = 4 steps
    (GemvConfig(4, 1024, 1, 3, 1), "num_warps=3"),
    (GemvConfig(4, 1024, 1, 4, 0), "num_stages=0"),
    (GemvConfig(4, 1024, 1, 4, 3), "num_stages=3 must be 1 or 2"),
    (GemvConfig(4, 1024, 1, 4, 1, 2), "pdl=2"),
    (GemvConfig(64, 2048, 1, 4, 1), "registers per thread"),
])
def test_fits_rejects(config, reason):
    assert not fits(config, 1, 4096, 4096, torch.bfloat16)
    assert reason in why_not_fits(config, 1, 4096, 4096, torch.bfloat16)


def test_register_bound_counts_warps():
    # 16 x 1024 of w: 128 registers per thread at 4 warps, 64 at 8.
    assert "takes 128 fp32 registers" in why_not_fits(GemvConfig(16, 1024, 1, 4, 1), 1, 64,
                                                       4096, torch.bfloat16)
    assert fits(GemvConfig(16, 1024, 1, 8, 1), 16, 64, 4096, torch.bfloat16)


def test_why_not_supported_rejects_dtypes():
    config = GemvConfig(4, 64, 1, 4, 1)
    assert "input dtype" in why_not_supported(config, 1, 64, 128, torch.float64, torch.bfloat16)
    assert "output dtype" in why_not_supported(config, 1, 64, 128, torch.bfloat16, torch.int8)
    assert "int8" in why_not_supported(config, 1, 64, 128, torch.int8, torch.bfloat16)
    assert why_not_supported(config, 1, 64, 128, torch.float8_e4m3fn, torch.bfloat16) is None


DECODE_SHAPES = [(256, 7168), (576, 7168), (4096, 4096), (28672, 4096), (4096, 14336),
                 (8192, 1024), (151936, 5120)]  # (N, K)
GEMV_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
def test_candidates_fit_and_stay_few(dtype):
    for N, K in DECODE_SHAPES + [(17, 33), (65, 4096)]:
        for M in (1, 2, 5, 16):
            for block_scales in ((False, True) if dtype == torch.float8_e4m3fn else (False,)):
                found = candidates(M, N, K, dtype, block_scales=block_scales)
                # Every row count per program, and two steps in flight only without block
                # scales (whose steps load w as they use it).
                assert {c.block_n for c in found} == {1, 2, 4, 8, 16}, (M, N, K, dtype)
                assert {c.num_stages for c in found} == ({1} if block_scales else {1, 2})
                assert len(set(found)) == len(found)
                assert all(fits(c, M, N, K, dtype) for c in found)
                if block_scales:
                    assert all(why_not_block_scaled(c, dtype) is None for c in found)
        assert candidates(MAX_M + 1, N, K, dtype) == []


def test_candidates_split_k_where_row_blocks_are_few():
    # 256 rows are at most 256 row blocks, under 8 per SM: every candidate splits K.
    assert all(c.split_k > 1 for c in candidates(1, 256, 7168, torch.bfloat16))
    # 151936 rows fill the GPU many times over without a split.
    assert all(c.split_k == 1 for c in candidates(1, 151936, 5120, torch.bfloat16))


def test_candidates_carry_the_launch_mode():
    assert all(c.pdl == PDL_WAIT for c in candidates(1, 4096, 4096, torch.bfloat16,
                                                      pdl=PDL_WAIT))
    assert all(c.pdl == PDL_OFF for c in candidates(1, 4096, 4096, torch.bfloat16))


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("M", [1, 3, 16])
def test_default_config_fits(dtype, M):
    for N, K in DECODE_SHAPES + [(17, 33), (33, 0), (65, 16)]:
        config = default_config(M, N, K, dtype)
        assert fits(config, M, N, K, dtype), why_not_fits(config, M, N, K, dtype)
        if dtype == torch.float8_e4m3fn:
            assert why_not_block_scaled(config, dtype) is None


# --- GPU: decode sizes, racing splits, PDL chains and CUDA graphs ----------------------------


def _gpu_configs(M, N, K, dtype, block_scales=False):
    """The default and a spread of the candidates: the narrowest and widest rows per program,
    split and not, with and without PDL."""
    found = candidates(M, N, K, dtype, block_scales=block_scales)
    chosen = {default_config(M, N, K, dtype), found[0], found[-1],
              max(found, key=lambda c: c.split_k), min(found, key=lambda c: c.split_k)}
    return sorted(chosen | {dataclasses.replace(c, pdl=PDL_WAIT) for c in chosen},
                  key=lambda c: c.name)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(256, 7168), (4096, 4096), (8192, 1024), (128256, 4096)])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_gpu_bf16_decode_sizes(M, N, K):
    gen = generator(M + N + K)
    x, w = randn(M, K, gen=gen, dtype=torch.bfloat16), randn(N, K, gen=gen,
                                                             dtype=torch.bfloat16)
    for cfg in _gpu_configs(M, N, K, torch.bfloat16):
        for _ in range(2):  # a split launch must leave its counters ready for the next
            y = gemm_gemv(x, w, config=cfg, out=poisoned(M, N, torch.bfloat16))
            assert_matches_reference(y, x, w)
            gemm_checks.assert_within_torch_error(y, x, w, cfg.name)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8])
def test_gpu_fp8_decode_sizes(M):
    N, K = 576, 7168
    gen = generator(M)
    xq, wq, x_scale, w_scale = gemm_checks.quantised_operands(M, N, K, torch.float8_e4m3fn,
                                                              "token_channel", gen)
    bias = randn(N, gen=gen, dtype=torch.bfloat16)
    scale = x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    for cfg in _gpu_configs(M, N, K, torch.float8_e4m3fn):
        y = gemm_gemv(xq, wq, bias=bias, scale_a=x_scale, scale_b=w_scale, config=cfg,
                      out=poisoned(M, N, torch.bfloat16))
        assert_matches_reference(y, xq, wq, bias, scale=scale)
    for cfg in _gpu_configs(M, N, K, torch.float8_e4m3fn, block_scales=True):
        gemm_checks.block_scaled(gemm_gemv, M, N, K, cfg)


@pytest.mark.gpu
def test_gpu_splits_race_deterministically():
    # 32 splits of 64 row blocks.
    config = GemvConfig(4, 128, 32, 4, 1)
    gemm_checks.splits_race_deterministically(gemm_gemv, launch_gemm_gemv, config,
                                              num_tiles(config, 256), 4, 256, 7168)


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pdl_chain_reads_its_input_after_the_producer(split_k, graph):
    gemm_checks.pdl_chain_reads_its_input_after_the_producer(
        launch_gemm_gemv, GemvConfig(2, 512, split_k, 4, 1, PDL_WAIT), 1, 4096, graph,
        40 + split_k)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16])
def test_gpu_cuda_graph_replay_on_new_data(M):
    N, K = 1536, 7168
    assert default_config(M, N, K, torch.bfloat16).split_k > 1  # the workspace path is captured
    gemm_checks.cuda_graph_replay_on_new_data(gemm_gemv, M, N, K)

"""gemm_tile against an fp32 reference: ragged shapes, dtypes, bias, strides, configs, fp8 scales.

On CPU the kernel runs in Triton's interpreter (~0.1-1 s per launch), so grids stay small; the
``gpu``-marked tests run real sizes and CUDA-graph capture on the GPU machine.
"""

import dataclasses

import pytest
import torch

import gemm_checks
from gemm_checks import DEVICE, DTYPE_PAIRS, assert_matches_reference, generator, poisoned, randn
from gemmtune.kernels.triton.gemm_tile import (
    KERNEL_PREFIX,
    TileConfig,
    default_config,
    fits,
    gemm_tile,
    launch_gemm_tile,
    why_not_fits,
)

RAGGED_SHAPES = [(1, 17, 33), (13, 65, 70), (67, 40, 129), (33, 96, 64)]  # (M, N, K)


@pytest.mark.parametrize("M,N,K", RAGGED_SHAPES)
@pytest.mark.parametrize("dtype,out_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_ragged_shapes_match_reference(M, N, K, dtype, out_dtype, with_bias):
    # A config smaller than the problem so that every shape has ragged edge tiles in M, N and K.
    gemm_checks.ragged_shape(gemm_tile, M, N, K, dtype, out_dtype, with_bias,
                             TileConfig(16, 32, 32, 2, 4, 2))


@pytest.mark.parametrize("check", gemm_checks.LAUNCHER_CHECKS, ids=lambda c: c.__name__)
def test_launcher_contract(check):
    """Default out dtype and config, fp8's bf16 default, K = 0, M = 0, argument errors."""
    check(gemm_tile)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])
def test_bias_of_another_dtype(bias_dtype):
    gen = generator(2)
    x, w = randn(33, 64, gen=gen, dtype=torch.bfloat16), randn(96, 64, gen=gen,
                                                               dtype=torch.bfloat16)
    bias = randn(96, gen=gen, dtype=bias_dtype)
    y = gemm_tile(x, w, bias=bias, out=poisoned(33, 96, torch.bfloat16))
    assert_matches_reference(y, x, w, bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("x_kind,w_kind", [("x_t", "w_s"), ("x_s", "w_t"), ("x_t", "w_t")])
def test_non_contiguous_inputs(dtype, x_kind, w_kind):
    gemm_checks.non_contiguous_inputs(gemm_tile, 67, 40, 129, dtype, x_kind, w_kind,
                                      TileConfig(32, 32, 64, 2, 4, 2))


def test_non_contiguous_output():
    gemm_checks.non_contiguous_output(gemm_tile, TileConfig(16, 16, 32, 1, 1, 1))


@pytest.mark.parametrize("config", [
    TileConfig(16, 16, 16, 1, 1, 1),  # smallest tiles, no grouping: K in 9 steps, ragged 1
    TileConfig(16, 16, 16, 3, 2, 2),  # the last M group is short (5 M tiles = 3 + 2)
    TileConfig(32, 16, 128, 2, 4, 3),  # one full K tile and a ragged one
    TileConfig(128, 64, 256, 8, 8, 2),  # blocks larger than the whole problem
], ids=lambda c: c.name)
def test_configs_cover_ragged_edges(config):
    gemm_checks.configs_cover_ragged_edges(gemm_tile, config)


@pytest.mark.parametrize("M,N,K", [(13, 65, 70), (33, 96, 64)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_per_tensor_scaled(M, N, K, out_dtype):
    gemm_checks.fp8_per_tensor_scaled(gemm_tile, M, N, K, out_dtype,
                                      TileConfig(16, 32, 32, 2, 4, 2))


@pytest.mark.parametrize("M,N,K", [(13, 65, 70), (33, 96, 64)])
@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("layout", list(gemm_checks.SCALE_LAYOUTS))
def test_quantised_with_row_and_column_scales(M, N, K, q_dtype, layout):
    gemm_checks.quantised_scaled(gemm_tile, M, N, K, q_dtype, layout, torch.bfloat16,
                                 TileConfig(16, 32, 32, 2, 4, 2))


def test_deterministic():
    gemm_checks.deterministic(gemm_tile, 67, 40, 129, TileConfig(32, 32, 32, 2, 4, 2))


# --- config space --------------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    TileConfig(64, 64, 32, 8, 4, 3),
    TileConfig(16, 256, 256, 1, 8, 1),
    default_config(4096, 4096, 4096, torch.bfloat16),
])
def test_name_round_trip(config):
    gemm_checks.name_round_trip(config, KERNEL_PREFIX)


def test_name_format():
    assert TileConfig(64, 64, 32, 8, 4, 3).name == "triton.tile:BM64.BN64.BK32.G8.W4.S3"


@pytest.mark.parametrize("name,bad_part", [
    ("triton.tile:BM64.BN64.BK32.G8.W4", "5 dot-separated fields"),
    ("triton.persistent:BM64.BN64.BK32.G8.W4.S3", "'triton.persistent'"),
    ("BM64.BN64.BK32.G8.W4.S3", "prefix"),
    ("triton.tile:BM64.BNx.BK32.G8.W4.S3", "'BNx'"),
    ("triton.tile:BM64.BK32.BN64.G8.W4.S3", "'BK32'"),
    ("triton.tile:BM64.BN64.BK32.G8.W4.S-3", "'S-3'"),
])
def test_from_name_rejects_bad_names(name, bad_part):
    gemm_checks.assert_bad_name(TileConfig.from_name, name, bad_part,
                                "triton.tile:BM<int>.BN<int>.BK<int>.G<int>.W<int>.S<int>")


@pytest.mark.parametrize("config,reason", [
    (TileConfig(48, 64, 32, 8, 4, 3), "block_m=48"),
    (TileConfig(64, 8, 32, 8, 4, 3), "block_n=8"),
    (TileConfig(64, 64, 512, 8, 4, 1), "block_k=512"),
    (TileConfig(64, 64, 32, 0, 4, 3), "group_m=0"),
    (TileConfig(64, 64, 32, 8, 3, 3), "num_warps=3"),
    (TileConfig(64, 64, 32, 8, 16, 3), "num_warps=16"),
    (TileConfig(64, 64, 32, 8, 4, 0), "num_stages=0"),
    (TileConfig(256, 256, 32, 8, 4, 2), "registers"),  # 512 accumulator registers per thread
    (TileConfig(128, 256, 128, 8, 8, 4), "shared memory"),  # 384 KiB of bf16 stages
])
def test_fits_rejects(config, reason):
    assert not fits(config, 4096, 4096, 4096, torch.bfloat16)
    assert reason in why_not_fits(config, 4096, 4096, 4096, torch.bfloat16)


def test_fits_depends_on_element_size():
    config = TileConfig(128, 128, 64, 8, 8, 4)  # 256 KiB in fp32, 128 KiB in bf16, 64 KiB in fp8
    assert not fits(config, 4096, 4096, 4096, torch.float32)
    assert fits(config, 4096, 4096, 4096, torch.bfloat16)
    assert fits(config, 4096, 4096, 4096, torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16,
                                   torch.float8_e4m3fn])
@pytest.mark.parametrize("M", [1, 13, 16, 32, 64, 65, 1000, 4096, 65536])
def test_default_config_fits(dtype, M):
    for N, K in [(4096, 4096), (576, 7168), (17, 33)]:
        assert fits(default_config(M, N, K, dtype), M, N, K, dtype)


def test_launcher_rejects_a_config_that_does_not_fit():
    x = torch.ones(16, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="num_warps=3"):
        gemm_tile(x, x, config=TileConfig(16, 16, 16, 1, 3, 1))


# --- GPU: real sizes and CUDA graphs -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 4096), (576, 7168)])
@pytest.mark.parametrize("M", [1, 16, 128, 1000, 4096])
def test_gpu_bf16_real_sizes(M, N, K):
    gen = generator(M + N + K)
    x, w = randn(M, K, gen=gen, dtype=torch.bfloat16), randn(N, K, gen=gen,
                                                             dtype=torch.bfloat16)
    y = gemm_tile(x, w, out=poisoned(M, N, torch.bfloat16))
    assert_matches_reference(y, x, w)
    gemm_checks.assert_within_torch_error(y, x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [16, 1000])
def test_gpu_fp8_real_size(M):
    N, K = 576, 7168
    x8, w8, scale_a, scale_b = gemm_checks.fp8_operands(M, N, K, generator(M))
    y = gemm_tile(x8, w8, scale_a=scale_a, scale_b=scale_b, out=poisoned(M, N, torch.bfloat16))
    assert_matches_reference(y, x8, w8, scale=gemm_checks.FP8_SCALE)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_on_new_data():
    gemm_checks.cuda_graph_replay_on_new_data(gemm_tile, 64, 4096, 4096)


# N 130 and 200: w's last row block is partial; K 300: so is the last K block.
@pytest.mark.parametrize("M,N,K", [(5, 200, 300), (33, 130, 256)])
@pytest.mark.parametrize("config", [TileConfig(16, 32, 128, 2, 4, 2), TileConfig(32, 64, 64, 2, 4, 2)], ids=lambda c: c.name)
def test_fp8_block_scales(M, N, K, config):
    gemm_checks.block_scaled(gemm_tile, M, N, K, config)


def test_block_scales_need_block_k_dividing_128_and_fp8():
    gemm_checks.block_scales_refusals(gemm_tile, TileConfig(16, 32, 256, 2, 4, 2))


# --- FP8 accumulation promoted into fp32 (promote_k) -----------------------------------------


# wgmma tiles (block_m of 64, 4 warps): the only dots promote_k applies to.
@pytest.mark.parametrize("config", [TileConfig(64, 32, 64, 2, 4, 2, promote_k=64),
                                    TileConfig(64, 64, 128, 2, 8, 2, promote_k=32)],
                         ids=lambda c: c.name)
def test_promoted_fp8_matches_reference(config):
    gemm_checks.promoted_fp8(gemm_tile, config)


def test_promote_k_refusals():
    gemm_checks.promote_k_refusals(gemm_tile, TileConfig(64, 32, 128, 2, 4, 2, promote_k=128))


def test_promote_k_reaches_the_dot():
    gemm_checks.promote_k_reaches_the_dot(launch_gemm_tile,
                                          TileConfig(64, 32, 64, 2, 4, 2, promote_k=128))


def test_promote_k_name():
    config = TileConfig(64, 64, 128, 8, 4, 3, promote_k=128)
    assert config.name == "triton.tile:BM64.BN64.BK128.G8.W4.S3.PK128"
    gemm_checks.name_round_trip(config, KERNEL_PREFIX)
    # Names written before the field existed mean what they meant: no promotion.
    assert TileConfig.from_name("triton.tile:BM64.BN64.BK128.G8.W4.S3").promote_k == 0


def test_promote_k_doubles_accumulator_registers():
    fp8 = torch.float8_e4m3fn
    assert fits(TileConfig(128, 128, 128, 8, 8, 3, promote_k=128), 4096, 4096, 4096, fp8)
    wide = TileConfig(128, 256, 128, 8, 8, 3)  # 128 accumulator registers per thread
    assert fits(wide, 4096, 4096, 4096, fp8)
    assert "needs 256 registers" in why_not_fits(dataclasses.replace(wide, promote_k=128),
                                                 4096, 4096, 4096, fp8)


@pytest.mark.gpu
def test_gpu_promoted_fp8_accumulation_is_precise():
    gemm_checks.promoted_accumulation_is_precise(gemm_tile, TileConfig(64, 64, 128, 8, 4, 3),
                                                 128, 256, 16384)

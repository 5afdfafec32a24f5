"""gemm_persistent (persistent programs, TMA loads) against an fp32 reference: ragged shapes,
dtypes, bias, strides, FP8/INT8 scales, several tiles per program.

On the CPU the kernel runs in Triton's interpreter with 4 programs, so every test with more than
4 output tiles walks several tiles per program; the ``gpu``-marked tests run real sizes and a
CUDA graph on the GPU machine.
"""

import pytest
import torch

import gemm_checks
from gemm_checks import DEVICE, DTYPE_PAIRS, assert_matches_reference, generator, poisoned, randn
from gemmtune.kernels.triton.gemm_persistent import (
    KERNEL_PREFIX,
    PersistentConfig,
    default_config,
    fits,
    gemm_persistent,
    launch_gemm_persistent,
    why_not_fits,
)

# K * itemsize must be a multiple of 16 B (TMA): K multiple of 16 covers every dtype here.
RAGGED_SHAPES = [(1, 17, 32), (13, 65, 48), (67, 40, 128), (33, 96, 64)]  # (M, N, K)
SMALL = PersistentConfig(16, 32, 32, 2, 4, 2)


@pytest.mark.parametrize("M,N,K", RAGGED_SHAPES)
@pytest.mark.parametrize("dtype,out_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_ragged_shapes_match_reference(M, N, K, dtype, out_dtype, with_bias):
    gemm_checks.ragged_shape(gemm_persistent, M, N, K, dtype, out_dtype, with_bias, SMALL)


@pytest.mark.parametrize("check", [gemm_checks.empty_k_gives_bias,
                                   gemm_checks.empty_m_returns_empty,
                                   gemm_checks.rejects_bad_arguments],
                         ids=lambda c: c.__name__)
def test_launcher_contract(check):
    check(gemm_persistent)


def test_default_out_dtype_and_config():
    gemm_checks.default_out_dtype_and_config(gemm_persistent, K=64)
    gemm_checks.fp8_defaults_to_bf16_output(gemm_persistent, K=48)


def test_k_that_tma_cannot_describe_is_refused_with_a_reason():
    gen = generator(2)
    x, w = randn(13, 70, gen=gen, dtype=torch.bfloat16), randn(65, 70, gen=gen,
                                                               dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=70 rows .* not a multiple of 16 B .* triton.tile"):
        gemm_persistent(x, w)
    with pytest.raises(ValueError, match="does not fit"):
        gemm_persistent(x, w, config=SMALL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("x_kind,w_kind", [("x_t", "w_s"), ("x_s", "w_t"), ("x_t", "w_t")])
def test_non_contiguous_inputs_are_copied_for_tma(dtype, x_kind, w_kind):
    gemm_checks.non_contiguous_inputs(gemm_persistent, 67, 40, 128, dtype, x_kind, w_kind,
                                      PersistentConfig(32, 32, 32, 2, 4, 2))


def test_misaligned_view_is_copied_for_tma():
    gen = generator(3)
    x, w = randn(33, 64, gen=gen, dtype=torch.bfloat16), randn(40, 64, gen=gen,
                                                               dtype=torch.bfloat16)
    flat = torch.zeros(33 * 64 + 1, dtype=torch.bfloat16, device=DEVICE)
    flat[1:].copy_(x.flatten())  # contiguous, 2 bytes off alignment
    y = gemm_persistent(flat[1:].view(33, 64), w, config=SMALL, out=poisoned(33, 40,
                                                                                torch.bfloat16))
    assert_matches_reference(y, x, w)


def test_expanded_x_is_copied_for_tma():
    gen = generator(6)
    row, w = randn(1, 64, gen=gen, dtype=torch.bfloat16), randn(40, 64, gen=gen,
                                                                dtype=torch.bfloat16)
    x = row.expand(33, 64)  # stride (0, 1): rows overlap, which TMA cannot describe
    y = gemm_persistent(x, w, config=SMALL, out=poisoned(33, 40, torch.bfloat16))
    assert_matches_reference(y, x.contiguous(), w)


def test_non_contiguous_output():
    gemm_checks.non_contiguous_output(gemm_persistent, PersistentConfig(16, 16, 32, 1, 1, 1),
                                      K=64)


@pytest.mark.parametrize("config", [
    PersistentConfig(16, 16, 16, 1, 1, 1),  # 15 tiles over 4 programs, K in 8 steps
    PersistentConfig(16, 16, 16, 3, 2, 2),  # the last M group is short (5 M tiles = 3 + 2)
    PersistentConfig(128, 64, 256, 8, 8, 2),  # blocks larger than the whole problem
], ids=lambda c: c.name)
def test_configs_cover_ragged_edges(config):
    gemm_checks.configs_cover_ragged_edges(gemm_persistent, config, K=128)


@pytest.mark.parametrize("M,N,K", [(13, 65, 48), (33, 96, 64)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_per_tensor_scaled(M, N, K, out_dtype):
    gemm_checks.fp8_per_tensor_scaled(gemm_persistent, M, N, K, out_dtype, SMALL)


@pytest.mark.parametrize("M,N,K", [(13, 65, 48), (67, 40, 128)])
@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("layout", list(gemm_checks.SCALE_LAYOUTS))
def test_quantised_with_row_and_column_scales(M, N, K, q_dtype, layout):
    gemm_checks.quantised_scaled(gemm_persistent, M, N, K, q_dtype, layout, torch.bfloat16,
                                 SMALL)


def test_deterministic():
    gemm_checks.deterministic(gemm_persistent, 67, 40, 128, PersistentConfig(32, 32, 32, 2, 4, 2))


@pytest.mark.parametrize("config", [SMALL, PersistentConfig(128, 256, 64, 8, 8, 3)],
                         ids=lambda c: c.name)
def test_name_round_trip(config):
    gemm_checks.name_round_trip(config, KERNEL_PREFIX)
    assert config.name.startswith("triton.persistent:BM")


def test_fits_asks_what_tma_needs():
    assert "multiple of 16 B" in why_not_fits(SMALL, 64, 64, 36, torch.bfloat16)  # 72 B rows
    assert fits(SMALL, 64, 64, 40, torch.bfloat16)  # 80 B rows
    assert "multiple of 16 B" in why_not_fits(SMALL, 64, 64, 40, torch.float8_e4m3fn)
    assert fits(SMALL, 64, 64, 48, torch.float8_e4m3fn)
    # Hopper's 8-bit dot needs K tiles of 32+ (the interpreter would run 16; the GPU would not).
    assert "block_k >= 32" in why_not_fits(PersistentConfig(16, 16, 16, 1, 4, 2), 64, 64, 64,
                                           torch.int8)
    assert "power of two" in why_not_fits(PersistentConfig(16, 24, 32, 1, 4, 2), 64, 64, 64,
                                          torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32,
                                   torch.float8_e4m3fn, torch.int8])
def test_default_config_fits(dtype):
    assert fits(default_config(4096, 4096, 4096, dtype), 4096, 4096, 4096, dtype)


def test_block_scales_are_refused_with_a_reason():
    gen = generator(1)
    xq, wq, x_scale, w_scale = gemm_checks.block_scaled_operands(16, 64, 512, gen)
    with pytest.raises(ValueError, match="block scales are not supported"):
        gemm_persistent(xq, wq, scale_a=x_scale, scale_b=w_scale, block_scales=True)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1000, 4096, 4096), (4096, 1536, 7168), (2048, 28672, 4096)])
def test_gpu_bf16_real_sizes(M, N, K):
    gen = generator(M)
    x, w = randn(M, K, gen=gen, dtype=torch.bfloat16), randn(N, K, gen=gen,
                                                             dtype=torch.bfloat16)
    y = gemm_persistent(x, w, out=poisoned(M, N, torch.bfloat16))
    gemm_checks.assert_within_torch_error(y, x, w)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_on_new_data():
    gemm_checks.cuda_graph_replay_on_new_data(gemm_persistent, 1024, 4096, 4096)


# --- FP8 accumulation promoted into fp32 (promote_k) -----------------------------------------


def test_promoted_fp8_matches_reference():
    gemm_checks.promoted_fp8(gemm_persistent, PersistentConfig(64, 32, 64, 2, 4, 2, promote_k=64),
                             K=320)  # TMA: rows of a multiple of 16 B


def test_promote_k_refusals():
    gemm_checks.promote_k_refusals(
        gemm_persistent, PersistentConfig(64, 32, 128, 2, 4, 2, promote_k=128), block_scales=False)


def test_promote_k_reaches_the_dot():
    gemm_checks.promote_k_reaches_the_dot(launch_gemm_persistent,
                                          PersistentConfig(64, 32, 64, 2, 4, 2, promote_k=128))


def test_promote_k_name():
    config = PersistentConfig(128, 128, 128, 8, 8, 3, promote_k=128)
    assert config.name == "triton.persistent:BM128.BN128.BK128.G8.W8.S3.PK128"
    gemm_checks.name_round_trip(config, KERNEL_PREFIX)


@pytest.mark.gpu
def test_gpu_promoted_fp8_accumulation_is_precise():
    gemm_checks.promoted_accumulation_is_precise(
        gemm_persistent, PersistentConfig(128, 128, 128, 8, 8, 3), 256, 512, 16384)

"""The MXFP4-weight Triton kernel (``gemm_w4``): x (bf16/fp16) @ dequant(wq, w_scale).T + bias.

Checked against the fp32 product of x and the dequantised weight (``gemmtune.quant``'s
``dequant_mxfp4``, bit-exact itself: tests/test_quant_mxfp4.py), at ragged sizes, with fresh
random data spread over several decades per block, NaN-poisoned outputs; in the interpreter on
the CPU (small grids), at real sizes on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from gemm_checks import (DEVICE, assert_matches_reference,
                         assert_mxfp4_launcher_says_what_is_wrong, generator,
                         mxfp4_weight_operands)
from gemmtune import quant
from gemmtune.kernels.triton.gemm_w4 import W4Config, default_config, gemm_w4, why_not_fits


def test_names_round_trip():
    cfg = W4Config(16, 64, 128, 4, 3)
    assert cfg.name == "triton.w4:BM16.BN64.BK128.W4.S3"
    assert W4Config.from_name(cfg.name) == cfg
    split = W4Config(16, 64, 128, 4, 3, 4)
    assert split.name == "triton.w4:BM16.BN64.BK128.W4.S3.SK4"
    scaled = W4Config(16, 64, 128, 4, 3, 4, dot_scaled=1)
    assert scaled.name == "triton.w4:BM16.BN64.BK128.W4.S3.SK4.DS1"
    assert W4Config.from_name(scaled.name) == scaled
    assert W4Config.from_name(split.name) == split


@pytest.mark.parametrize("M, N, K", [(1, 4096, 4096), (16, 2880, 2880), (64, 576, 7168),
                                     (300, 4096, 4096)])
def test_candidates_fit_and_split_k_for_decode(M, N, K):
    from gemmtune.kernels.triton.gemm_w4 import DECODE_M, candidates

    found = candidates(M, N, K, torch.bfloat16, num_sms=132)
    assert found and len(set(found)) == len(found)
    assert all(why_not_fits(c, M, N, K, torch.bfloat16) is None for c in found)
    assert any(c.split_k > 1 for c in found) == (M <= DECODE_M)


@pytest.mark.parametrize("config, K, dtype, says", [
    (W4Config(16, 64, 128, 4, 3), 128, torch.float32, "bf16 or fp16"),
    (W4Config(8, 64, 128, 4, 3), 128, torch.bfloat16, "block_m=8 must be a power of two >= 16"),
    (W4Config(16, 48, 128, 4, 3), 128, torch.bfloat16, "block_n=48"),
    (W4Config(16, 64, 16, 4, 3), 128, torch.bfloat16, "multiple of the MXFP4 block"),
    (W4Config(16, 64, 128, 4, 3), 100, torch.bfloat16, "not a multiple of 32"),
    (W4Config(16, 64, 128, 3, 3), 128, torch.bfloat16, "num_warps=3"),
    (W4Config(16, 64, 64, 4, 3, 3), 128, torch.bfloat16, "split_k=3 must be in [1, 2]"),
    (W4Config(16, 64, 64, 4, 3, dot_scaled=1), 128, torch.float16, "would round fp16 x"),
    (W4Config(16, 64, 64, 4, 3, dot_scaled=2), 128, torch.bfloat16, "must be 0 or 1"),
])
def test_configs_that_cannot_run_say_why(config, K, dtype, says):
    assert says in why_not_fits(config, 16, 64, K, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, N, K, config", [
    (1, 40, 96, W4Config(16, 32, 64, 4, 2)),      # K not a multiple of BLOCK_K, N ragged
    (5, 70, 160, W4Config(16, 64, 128, 4, 2)),    # several N blocks, the last partial
    (33, 24, 64, W4Config(32, 16, 32, 4, 1)),     # several M blocks, BLOCK_K of one scale block
    (3, 40, 160, W4Config(16, 32, 64, 4, 2, 3)),  # K split 3 ways, the last step ragged
    (20, 70, 128, W4Config(16, 32, 32, 4, 1, 2)),  # split over several M and N tiles
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_the_dequantised_reference(M, N, K, config, dtype, with_bias):
    gen = generator(M * 1000 + N + K)
    x, wq, w_scale, bias = mxfp4_weight_operands(M, N, K, gen, with_bias, dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    y = gemm_w4(x, wq, w_scale, bias, config, out=out)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    assert_matches_reference(y, x, quant.dequant_mxfp4(wq, w_scale), bias)


@pytest.mark.parametrize("M, N, K, config", [
    (5, 70, 160, W4Config(16, 64, 64, 4, 2, dot_scaled=1)),  # ragged K and N
    (3, 40, 160, W4Config(16, 32, 64, 4, 2, 3, dot_scaled=1)),  # split 3 ways
    (20, 70, 128, W4Config(16, 64, 64, 4, 1, 2, dot_scaled=1)),  # split, several N tiles
])
def test_dot_scaled_matches_the_reference(M, N, K, config):
    """Each step one ``tl.dot_scaled`` (DS1, bf16 x), split and not."""
    dtype = torch.bfloat16
    gen = generator(M * 1000 + N + K + 1)
    x, wq, w_scale, bias = mxfp4_weight_operands(M, N, K, gen, True, dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    y = gemm_w4(x, wq, w_scale, bias, config, out=out)
    assert_matches_reference(y, x, quant.dequant_mxfp4(wq, w_scale), bias)


def test_strided_x_and_output():
    """x a column slice of a wider tensor (its rows a wider pitch apart) and the output a slice
    of a wider one: read and written in place, the rest untouched."""
    gen = generator(11)
    x, wq, w_scale, bias = mxfp4_weight_operands(6, 40, 64, gen, True, torch.bfloat16)
    wide_x = torch.zeros(6, 96, dtype=torch.bfloat16, device=DEVICE)
    wide_x[:, :64] = x
    wide_out = torch.full((6, 56), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    y = gemm_w4(wide_x[:, :64], wq, w_scale, bias, W4Config(16, 32, 32, 4, 1),
                out=wide_out[:, :40])
    assert_matches_reference(y, x, quant.dequant_mxfp4(wq, w_scale), bias)
    assert torch.isnan(wide_out[:, 40:]).all()


@pytest.mark.parametrize("dtype, config", [
    (torch.bfloat16, W4Config(16, 64, 64, 4, 1)), (torch.float16, W4Config(16, 64, 64, 4, 1)),
    (torch.bfloat16, W4Config(16, 64, 64, 4, 1, dot_scaled=1))])
def test_every_code_at_every_scale_byte_exactly(dtype, config):
    """Row n of w has scale byte n (0-255) on both its blocks and the 16 codes over and over;
    x is the identity, so y is w dequantised, rounded once to x's dtype: equal to the reference
    bit for bit, infinities (6 x 2^127) and the NaN row (byte 255) included. fp16 x too: the
    scale is applied in fp32, after the product; and through ``tl.dot_scaled`` (bf16), whose
    bf16 scales reach byte 0's 2^-127 as a subnormal, but whose infinite weights give NaN."""
    K = 64
    codes = torch.arange(K, device=DEVICE) % 16
    wq = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).repeat(256, 1)
    w_scale = torch.arange(256, device=DEVICE).to(torch.uint8)[:, None].repeat(1, K // 32)
    x = torch.eye(K, dtype=dtype, device=DEVICE)
    y = gemm_w4(x, wq, w_scale, None, config)
    want = quant.dequant_mxfp4(wq, w_scale).T.to(dtype)
    if config.dot_scaled:
        # The product sees each dequantised weight, so an infinite one (bytes 253-254, which
        # no finite weight quantises to) meets x's zeros: NaN down its whole column.
        infinite = torch.isinf(want).any(dim=0)
        assert infinite.sum() == 2 and torch.isnan(y[:, infinite]).all()
        y, want = y[:, ~infinite], want[:, ~infinite]
        # Compiled for a GPU, bf16 products below 2^-126 (scale bytes 0-1: weights no real
        # checkpoint has) may flush to zero; every other value is exact.
        subnormal = want.abs() < 2.0 ** -126
        assert ((y[subnormal] == want[subnormal]) | (y[subnormal] == 0)).all()
        y, want = y[~subnormal], want[~subnormal]
    torch.testing.assert_close(y, want, rtol=0, atol=0, equal_nan=True)


def test_strided_weight_scales_bias_and_transposed_x():
    """wq and w_scale column slices of wider tensors, bias every other element of a wider one,
    x a transposed view (K contiguous nowhere): all read right."""
    M, N, K = 5, 24, 96
    gen = generator(13)
    x, wq, w_scale, bias = mxfp4_weight_operands(M, N, K, gen, True, torch.float16)
    wide_q = torch.zeros(N, K // 2 + 16, dtype=torch.uint8, device=DEVICE)
    wide_q[:, :K // 2] = wq
    wide_s = torch.full((N, K // 32 + 5), 255, dtype=torch.uint8, device=DEVICE)
    wide_s[:, :K // 32] = w_scale
    wide_b = torch.zeros(2 * N, dtype=torch.float16, device=DEVICE)
    wide_b[0::2] = bias
    y = gemm_w4(x.T.contiguous().T, wide_q[:, :K // 2], wide_s[:, :K // 32], wide_b[0::2],
                W4Config(16, 16, 64, 4, 1))
    assert_matches_reference(y, x, quant.dequant_mxfp4(wq, w_scale), bias)


def test_ragged_k_reads_no_scale_past_its_row():
    """K = 96 in steps of 64: the last step's second block is past K; the next row's first
    scale byte there is 255 (NaN) and must not be read into this row."""
    gen = generator(17)
    x, wq, w_scale, _ = mxfp4_weight_operands(4, 16, 96, gen, False, torch.bfloat16)
    w_scale[1:, 0] = 255  # every row but the first starts with a NaN block
    y = gemm_w4(x, wq, w_scale, None, W4Config(16, 16, 64, 4, 1))
    assert torch.isfinite(y[:, 0]).all() and torch.isnan(y[:, 1:]).all()
    assert_matches_reference(y[:, :1], x, quant.dequant_mxfp4(wq, w_scale)[:1])


def test_nan_blocks_give_nan_outputs_never_a_finite_number():
    """A weight block with a NaN (scale byte 255) makes its row's outputs NaN; the others stay
    finite and right."""
    gen = generator(7)
    x, wq, w_scale, _ = mxfp4_weight_operands(3, 32, 64, gen, False, torch.bfloat16)
    # Positive x and a block of 1.0s: an infinite scale would give +inf here, not NaN.
    x = x.abs() + 0.5
    w_scale[5, 1] = 255
    wq[5, 16:32] = 0x22
    y = gemm_w4(x, wq, w_scale, None, W4Config(16, 32, 32, 4, 1))
    assert torch.isnan(y[:, 5]).all()
    rest = [n for n in range(32) if n != 5]
    assert torch.isfinite(y[:, rest]).all()
    assert_matches_reference(y[:, rest], x, quant.dequant_mxfp4(wq, w_scale)[rest])


def test_default_config_fits_and_bad_arguments_say_what_is_wrong():
    assert why_not_fits(default_config(300, 4096, 4096, torch.bfloat16), 300, 4096, 4096,
                        torch.bfloat16) is None
    assert_mxfp4_launcher_says_what_is_wrong(gemm_w4)
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
    wq, w_scale = quant.mxfp4(torch.ones(8, 64, device=DEVICE))
    with pytest.raises(TypeError, match="uint8"):
        gemm_w4(x, wq.to(torch.int8), w_scale)
    with pytest.raises(ValueError, match="bias has shape"):
        gemm_w4(x, wq, w_scale, torch.zeros(3, dtype=torch.bfloat16, device=DEVICE))
    assert gemm_w4(x[:0], wq, w_scale).shape == (0, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K", [(1, 4096, 4096), (16, 1280, 8192), (100, 2880, 2880),
                                     (1024, 512, 1024)])
def test_gpu_real_sizes(M, N, K):
    gen = generator(M + N)
    x, wq, w_scale, bias = mxfp4_weight_operands(M, N, K, gen, True, torch.bfloat16)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    y = gemm_w4(x, wq, w_scale, bias, out=out)
    assert_matches_reference(y, x, quant.dequant_mxfp4(wq, w_scale), bias)
    if M <= 16:  # K split over 8 programs, summed in order: right, and bitwise repeatable
        split = W4Config(16, 64, 128, 4, 3, 8)
        first, again = (gemm_w4(x, wq, w_scale, bias, split) for _ in range(2))
        assert_matches_reference(first, x, quant.dequant_mxfp4(wq, w_scale), bias)
        assert torch.equal(first, again)


def test_empty_k_gives_the_bias():
    x = torch.zeros(3, 0, dtype=torch.bfloat16, device=DEVICE)
    wq = torch.zeros(8, 0, dtype=torch.uint8, device=DEVICE)
    ws = torch.zeros(8, 0, dtype=torch.uint8, device=DEVICE)
    bias = torch.arange(8, dtype=torch.bfloat16, device=DEVICE)
    y = gemm_w4(x, wq, ws, bias)
    assert torch.equal(y, bias.expand(3, 8))


@pytest.mark.parametrize("module", ["gemm_w4", "gemm_w4frag", "gemm_w4deq", "gemm_w4xa"])
def test_each_mxfp4_kernel_takes_the_common_scaled_call(module):
    """Dispatch calls every kernel module's validating launcher as (x, w, bias, out_dtype,
    scale_a, scale_b, ...): the MXFP4 modules' refuse x scales and another output dtype by
    name, and pass the call on to their own validating launcher (whose checks then apply)."""
    import importlib

    scaled = getattr(importlib.import_module(f"gemmtune.kernels.triton.{module}"),
                     f"{module}_scaled")
    assert scaled.__name__ == f"{module}_scaled"
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
    wq, w_scale = quant.mxfp4(torch.ones(8, 64, device=DEVICE))
    with pytest.raises(ValueError, match=f"^{module}: an MXFP4 weight brings its own scales"):
        scaled(x, wq, None, None, w_scale, w_scale)
    with pytest.raises(TypeError, match=f"^{module}: the output is in x's dtype"):
        scaled(x, wq, None, torch.float32, None, w_scale)
    with pytest.raises(ValueError, match=rf"^{module}: x's K=64 needs wq \(N, 32\)"):
        scaled(x, wq[:, :16], None, None, None, w_scale)

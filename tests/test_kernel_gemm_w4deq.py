"""Dequantise-then-cuBLAS for MXFP4 weights (``gemm_w4deq``): the Triton kernel's dequantised
weight bit for bit against ``quant.dequant_mxfp4`` rounded once to x's dtype (both layouts, every
code at every scale byte, ragged N and K), and the GEMM against the fp32 reference, with bf16,
fp16 and MXFP4 x; in the interpreter on the CPU, at real sizes on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from gemm_checks import (DEVICE, assert_matches_reference,
                         assert_mxfp4_launcher_says_what_is_wrong, generator, randn)
from gemmtune import quant
from gemmtune.kernels.triton._swapped import runs_here
from gemmtune.kernels.triton.gemm_w4deq import (W4DeqConfig, candidates, dequantize,
                                                gemm_w4deq, why_not_fits, why_not_supported)


def _weight(N, K, gen):
    w = randn(N, K, gen=gen) * torch.logspace(-3, 1, K // 32, device=DEVICE).repeat_interleave(32)
    return quant.mxfp4(w)


def test_names_and_candidates():
    cfg = W4DeqConfig(32, 128, 4)
    assert cfg.name == "triton.w4deq:BN32.BK128.W4"
    packed = W4DeqConfig(8, 512, 4, 1)
    assert packed.name == "triton.w4deq:BN8.BK512.W4.L1"
    assert W4DeqConfig.from_name(packed.name) == packed
    assert candidates(16, 4096, 4096, torch.bfloat16) == []  # decode: the decode kernels'
    found = candidates(1024, 4096, 4096, torch.bfloat16, packed=True)
    assert found and all(c.packed and why_not_fits(c, 1024, 4096, 4096, torch.bfloat16) is None
                         for c in found)
    assert candidates(1024, 4096, 2880, torch.bfloat16, packed=True) == []  # no packed layout
    asm = W4DeqConfig(8, 512, 4, 0, 1)
    assert asm.name == "triton.w4deq:BN8.BK512.W4.L0.A1"
    assert W4DeqConfig.from_name(asm.name) == asm
    # The inline-PTX decode where it is compiled for a Hopper (sm_90's bf16x2 multiply), for
    # bf16 copies (bf16 and MXFP4 x)
    for dtype in (torch.bfloat16, torch.uint8, torch.float16):
        asms = {c.asm for c in candidates(1024, 4096, 4096, dtype)}
        assert asms == ({0} if dtype == torch.float16 or not runs_here() else {0, 1})


@pytest.mark.parametrize("config, K, dtype, says", [
    (W4DeqConfig(32, 128, 4), 128, torch.float32, "bf16 or fp16 x"),
    (W4DeqConfig(32, 16, 4), 128, torch.bfloat16, "whole scale blocks"),
    (W4DeqConfig(24, 128, 4), 128, torch.bfloat16, "block_n=24"),
    (W4DeqConfig(32, 128, 4, 1), 96, torch.bfloat16, "multiple of 128"),
    (W4DeqConfig(32, 128, 4, 0, 2), 128, torch.bfloat16, "asm=2"),
    (W4DeqConfig(32, 128, 4, 0, 1), 128, torch.float16, "asm=1 decodes to bf16"),
    (W4DeqConfig(32, 64, 4, 1, 1), 128, torch.bfloat16, "asm=1 reads a packed w in whole"),
])
def test_configs_that_cannot_run_say_why(config, K, dtype, says):
    assert says in why_not_fits(config, 64, 64, K, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N, K, config", [
    (37, 96, W4DeqConfig(8, 64, 4)),        # N and K ragged against the blocks
    (20, 256, W4DeqConfig(16, 128, 4, 1)),  # packed
    (9, 384, W4DeqConfig(8, 256, 4, 1)),    # packed, K ragged against block_k
])
def test_dequantised_weight_is_the_reference_rounded_once(N, K, config, dtype):
    wq, ws = _weight(N, K, generator(N + K))
    stored = quant.prepack_mxfp4(wq, ws)[0] if config.packed else wq
    got = dequantize(stored, ws, dtype, config)
    torch.testing.assert_close(got, quant.dequant_mxfp4(wq, ws).to(dtype), rtol=0, atol=0)


def test_every_code_at_every_scale_byte_exactly():
    """Row n has scale byte n (0-255) on both blocks, the 16 codes over and over: bf16 holds
    each dequantised value exactly, 2^-127's multiples, infinities and NaN included."""
    K = 64
    codes = torch.arange(K, device=DEVICE) % 16
    wq = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).repeat(256, 1)
    ws = torch.arange(256, device=DEVICE).to(torch.uint8)[:, None].repeat(1, K // 32)
    got = dequantize(wq, ws, torch.bfloat16, W4DeqConfig(32, 64, 4))
    torch.testing.assert_close(got, quant.dequant_mxfp4(wq, ws).to(torch.bfloat16), rtol=0,
                               atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_the_reference(dtype, with_bias):
    M, N, K = 70, 45, 256
    gen = generator(M + N)
    x = randn(M, K, gen=gen).to(dtype)
    wq, ws = _weight(N, K, gen)
    bias = randn(N, gen=gen).to(dtype) if with_bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)
    y = gemm_w4deq(x, wq, ws, bias, W4DeqConfig(16, 128, 4), out=out)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    assert_matches_reference(y, x, quant.dequant_mxfp4(wq, ws), bias)


def test_a_bias_of_another_dtype_is_added_in_fp32():
    """As the torch backend adds it: to the product (in x's dtype) in fp32, then rounded."""
    M, N, K = 3, 40, 64
    gen = generator(9)
    x = randn(M, K, gen=gen).to(torch.bfloat16)
    wq, ws = _weight(N, K, gen)
    bias = torch.full((N,), 3000.0, device=DEVICE) + randn(N, gen=gen)
    y = gemm_w4deq(x, wq, ws, bias, W4DeqConfig(16, 64, 4))
    ref = x.float() @ quant.dequant_mxfp4(wq, ws).T + bias
    assert y.dtype == torch.bfloat16 and ((y.float() - ref).abs() <= ref.abs() * 2 ** -8).all()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("config", [
    W4DeqConfig(16, 128, 4), W4DeqConfig(8, 256, 4, 1),
    pytest.param(W4DeqConfig(8, 256, 4, 1, 1), marks=pytest.mark.gpu),  # the PTX decode
])
def test_mxfp4_x_matches_the_reference(out_dtype, config):
    """x MXFP4 too (gemm_a4w4_blockscale's): both operands dequantised to bf16 (x's codes as
    quantised whatever w's layout), multiplied into each output dtype; a bias is refused (the
    op has none)."""
    from gemmtune.kernels.triton.gemm_w4deq import launch_gemm_w4deq, why_not_supported

    M, N, K = 37, 45, 256
    gen = generator(M + N + K)
    xq, xs = quant.mxfp4(randn(M, K, gen=gen) * torch.logspace(
        -2, 2, K // 32, device=DEVICE).repeat_interleave(32))
    wq, ws = _weight(N, K, gen)
    stored = quant.prepack_mxfp4(wq, ws)[0] if config.packed else wq
    assert why_not_supported(config, M, N, K, torch.uint8, out_dtype) is None
    out = torch.full((M, N), float("nan"), dtype=out_dtype, device=DEVICE)
    launch_gemm_w4deq(xq, stored, None, out, xs, ws, config)
    assert_matches_reference(out, quant.dequant_mxfp4(xq, xs), quant.dequant_mxfp4(wq, ws))
    assert "writes bf16, fp16 or fp32" in why_not_supported(config, M, N, K, torch.uint8,
                                                            torch.int8)
    with pytest.raises(ValueError, match="no bias"):
        launch_gemm_w4deq(xq, stored, torch.zeros(N, device=DEVICE), out, xs, ws, config)


def test_empty_k_gives_the_bias_and_bad_calls_say_why():
    x = torch.zeros(3, 0, dtype=torch.bfloat16, device=DEVICE)
    wq = torch.zeros(8, 0, dtype=torch.uint8, device=DEVICE)
    ws = torch.zeros(8, 0, dtype=torch.uint8, device=DEVICE)
    bias = torch.arange(8, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(gemm_w4deq(x, wq, ws, bias), bias.expand(3, 8))
    assert_mxfp4_launcher_says_what_is_wrong(gemm_w4deq)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_real_sizes(packed):
    M, N, K = 1024, 2880, 4096
    gen = generator(M)
    x = randn(M, K, gen=gen).to(torch.bfloat16)
    wq, ws = _weight(N, K, gen)
    stored = quant.prepack_mxfp4(wq, ws)[0] if packed else wq
    for config in candidates(M, N, K, torch.bfloat16, packed):
        y = gemm_w4deq(x, stored, ws, None, config)
        assert_matches_reference(y, x, quant.dequant_mxfp4(wq, ws))


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter refuses the PTX decode")
def test_the_ptx_decode_is_refused_in_the_interpreter():
    config = W4DeqConfig(8, 512, 4, 0, 1)
    why = why_not_supported(config, 64, 64, 128, torch.bfloat16, torch.bfloat16)
    assert "interpreter" in why and "asm=0" in why
    wq, ws = _weight(64, 128, generator(3))
    with pytest.raises(ValueError, match="asm=0"):  # the op says so too, before any launch
        gemm_w4deq(randn(4, 128, gen=generator(4)).to(torch.bfloat16), wq, ws, None, config)


@pytest.mark.gpu
@pytest.mark.parametrize("N, K, config", [
    (37, 96, W4DeqConfig(8, 64, 4, 0, 1)),       # N and K ragged against the blocks
    (300, 4096, W4DeqConfig(8, 512, 4, 0, 1)),
    (300, 4096, W4DeqConfig(32, 128, 4, 0, 1)),
    (20, 256, W4DeqConfig(16, 128, 4, 1, 1)),    # packed
    (9, 384, W4DeqConfig(8, 256, 4, 1, 1)),      # packed, K ragged against block_k
    (130, 2048, W4DeqConfig(8, 512, 4, 1, 1)),   # packed, groups of 16 words in every place
])
def test_gpu_ptx_decode_is_the_reference_exactly(N, K, config):
    wq, ws = _weight(N, K, generator(N + K))
    stored = quant.prepack_mxfp4(wq, ws)[0] if config.packed else wq
    got = dequantize(stored, ws, torch.bfloat16, config)
    torch.testing.assert_close(got, quant.dequant_mxfp4(wq, ws).to(torch.bfloat16), rtol=0,
                               atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [0, 1])
def test_gpu_ptx_decode_of_every_code_at_every_scale_byte_exactly(packed):
    """As the Triton decode's test, through the PTX, both layouts, each block of a row with a
    scale byte of its own (a block's scale taken from the wrong block shows): equal bit for
    bit (-0 included) and NaN where the reference is."""
    K = 128
    k = torch.arange(K, device=DEVICE)
    codes = (k + k // 16) % 16
    wq = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).repeat(256, 1)
    n, block = torch.arange(256, device=DEVICE)[:, None], torch.arange(K // 32, device=DEVICE)
    ws = ((n + 67 * block) % 256).to(torch.uint8)
    stored = quant.prepack_mxfp4(wq, ws)[0] if packed else wq
    got = dequantize(stored, ws, torch.bfloat16, W4DeqConfig(32, 128, 4, packed, 1))
    _assert_same_bits(got, quant.dequant_mxfp4(wq, ws).to(torch.bfloat16))


def _assert_same_bits(got, want):
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.gpu
@pytest.mark.parametrize("offset, extra", [(1, 4), (0, 1)])
def test_gpu_ptx_decode_of_codes_not_in_aligned_words(offset, extra):
    """Codes whose rows start off a 4-byte boundary (a view one byte in, rows 4-byte apart) or
    lie an odd number of bytes apart (rows padded by one byte) are copied first, then decoded
    as the rest."""
    N, K = 70, 256
    wq, ws = _weight(N, K, generator(5))
    wide = torch.zeros(N, K // 2 + extra, dtype=torch.uint8, device=DEVICE)
    wide[:, offset:offset + K // 2] = wq
    view = wide[:, offset:offset + K // 2]
    assert (view.data_ptr() % 4 != 0) == bool(offset)
    assert (view.stride(0) % 4 != 0) == (extra % 4 != 0)
    got = dequantize(view, ws, torch.bfloat16, W4DeqConfig(8, 256, 4, 0, 1))
    _assert_same_bits(got, quant.dequant_mxfp4(wq, ws).to(torch.bfloat16))



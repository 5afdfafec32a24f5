"""The MXFP4-weight prefill kernel on the warpgroup MMA (``gemm_w4wg``, Gluon, Hopper only):
bf16 x @ dequant(wq, w_scale).T + bias.

On the CPU: its names, constraints and candidates, and what its launch sends the kernel
(tests/test_kernels_compile_for_hopper.py compiles it for sm_90). On a GPU: against the fp32
product of x and the dequantised weight at ragged M and N, every tile and warp count, bias,
with fresh random data and NaN-poisoned outputs; every code at every scale byte bit for bit;
a NaN scale making its row NaN and no other.
"""

from __future__ import annotations

import pytest
import torch

from gemm_checks import (DEVICE, assert_matches_reference,
                         assert_mxfp4_launcher_says_what_is_wrong,
                         assert_only_nan_rows_are_nan, generator, mxfp4_weight_operands,
                         on_hopper, randn, with_nan_scales)
from gemmtune import quant
from gemmtune.kernels.triton.gemm_w4wg import (W4WgConfig, candidates, default_config,
                                               gemm_w4wg, why_not_fits, why_not_supported)

def test_names_round_trip():
    cfg = W4WgConfig(128, 128, 4, 3)
    assert cfg.name == "triton.w4wg:BN128.BM128.W4.S3"
    assert W4WgConfig.from_name(cfg.name) == cfg
    packed = W4WgConfig(256, 64, 8, 4, 1)
    assert packed.name == "triton.w4wg:BN256.BM64.W8.S4.L1"
    assert W4WgConfig.from_name(packed.name) == packed
    overlapped = W4WgConfig(128, 256, 8, 3, 0, 1)
    assert overlapped.name == "triton.w4wg:BN128.BM256.W8.S3.L0.O1"
    assert W4WgConfig.from_name(overlapped.name) == overlapped


@pytest.mark.parametrize("config, K, dtype, says", [
    (W4WgConfig(128, 128, 4, 3), 256, torch.float16, "takes bf16 x"),
    (W4WgConfig(32, 128, 4, 3), 256, torch.bfloat16, "block_n=32 must be one of"),
    (W4WgConfig(128, 32, 4, 3), 256, torch.bfloat16, "block_m=32"),
    (W4WgConfig(64, 128, 8, 3), 256, torch.bfloat16, "16 or 32 rows of w each"),
    (W4WgConfig(256, 64, 4, 3), 256, torch.bfloat16, "16 or 32 rows of w each"),
    (W4WgConfig(128, 256, 4, 3), 256, torch.bfloat16, "more than 128 registers"),
    (W4WgConfig(64, 256, 4, 6), 256, torch.bfloat16, "stages=6"),
    (W4WgConfig(128, 128, 4, 1), 256, torch.bfloat16, "stages=1"),
    (W4WgConfig(128, 128, 4, 3), 160, torch.bfloat16, "not a positive multiple of 64"),
    (W4WgConfig(128, 128, 4, 3, 1), 192, torch.bfloat16, "not a multiple of 128"),
    (W4WgConfig(128, 128, 4, 3, 2), 256, torch.bfloat16, "packed=2"),
    (W4WgConfig(128, 128, 4, 3, 0, 3), 256, torch.bfloat16, "overlap=3"),
    (W4WgConfig(128, 128, 4, 3, 0, 2), 256, torch.bfloat16, "overlap=2 with 32 rows"),
    (W4WgConfig(128, 128, 4, 3), 0, torch.bfloat16, "K=0"),
])
def test_configs_that_cannot_run_say_why(config, K, dtype, says):
    assert says in why_not_fits(config, 1024, 256, K, dtype)


def test_candidates_fit_and_start_where_decode_ends():
    for M, N, K in ((64, 4096, 4096), (1024, 2880, 2880), (8192, 576, 7168)):
        found = candidates(M, N, K, torch.bfloat16)
        assert found and all(why_not_fits(c, M, N, K, torch.bfloat16) is None for c in found)
        assert {c.num_warps for c in found} == {4, 8}
        assert {c.overlap for c in found} == {1, 2} and {c.stages for c in found} == {3}
        assert all(c.block_m <= max(64, M) for c in found)
    assert {c.block_m for c in candidates(64, 4096, 4096, torch.bfloat16)} == {64}
    assert candidates(32, 4096, 4096, torch.bfloat16) == []
    assert candidates(1024, 4096, 4096, torch.float16) == []
    packed = candidates(1024, 4096, 4096, torch.bfloat16, packed=True)
    assert packed and all(c.packed for c in packed)
    assert candidates(1024, 4096, 2880 + 32, torch.bfloat16) == []  # K not in steps of 64
    assert candidates(1024, 4096, 2880, torch.bfloat16, packed=True) == []  # nor of 128
    assert why_not_fits(default_config(100, 4096, 2880, torch.bfloat16), 100, 4096, 2880,
                        torch.bfloat16) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="says why where it cannot run")
def test_refuses_to_run_where_it_cannot():
    config = W4WgConfig(128, 128, 4, 3)
    why = why_not_supported(config, 128, 64, 128, torch.bfloat16, torch.bfloat16)
    assert why is not None and ("interpreter" in why or "Hopper" in why)
    assert "writes x's dtype" in why_not_supported(config, 128, 64, 128, torch.bfloat16,
                                                   torch.float32)


def test_operands_reach_the_kernel_as_it_reads_them():
    """x goes by TMA (dense rows, 16-byte aligned: a copy otherwise) and w's rows as 16-byte
    vectors: codes at an offset that is not a multiple of 16 bytes, or rows a pitch apart that
    is not, reach the kernel as aligned copies; aligned operands go as they are."""
    from gemmtune.kernels.triton.gemm_w4wg import w4wg_call

    x = randn(64, 256, gen=generator(2)).to(torch.bfloat16)
    wq, ws = quant.mxfp4(randn(64, 256, gen=generator(3)))
    y = torch.empty(64, 64, dtype=torch.bfloat16, device=DEVICE)
    config = W4WgConfig(64, 64, 4, 3)
    flat = torch.zeros(wq.numel() + 4, dtype=torch.uint8, device=DEVICE)
    shifted = flat[4:].view(64, 128)
    shifted.copy_(wq)
    wide = torch.zeros(64, 136, dtype=torch.uint8, device=DEVICE)
    wide[:, :128] = wq
    for view in (shifted, wide[:, :128]):
        sent = w4wg_call(x, view, None, y, None, ws, config).args[1]
        assert sent.data_ptr() % 16 == 0 and sent.stride(0) % 16 == 0 and torch.equal(sent, wq)
    call = w4wg_call(x, wq, None, y, None, ws, config)
    assert call.args[1] is wq and call.args[0].base is x
    assert call.grid == (1, 1) and call.constexprs["WARPS"] == 4


def test_bad_arguments_say_what_is_wrong():
    assert_mxfp4_launcher_says_what_is_wrong(gemm_w4wg)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, config", [
    (64, 64, 64, W4WgConfig(64, 64, 4, 3)),        # one step, one tile
    (100, 200, 512, W4WgConfig(128, 128, 4, 3)),   # M and N ragged, 8 steps (the ring wraps)
    (300, 70, 1024, W4WgConfig(64, 256, 4, 3)),    # 256 rows of x, two tiles of them
    (257, 300, 2880, W4WgConfig(128, 64, 4, 4)),   # 2 reps of w's rows in a warpgroup
    (130, 520, 768, W4WgConfig(256, 128, 8, 3)),   # two warpgroups
    (64, 130, 128, W4WgConfig(128, 64, 8, 4)),     # two steps, more slots than steps
    (100, 200, 512, W4WgConfig(128, 128, 4, 3, 1)),  # packed w
    (130, 520, 768, W4WgConfig(256, 128, 8, 3, 1)),  # packed, two warpgroups
    # the decode beside the MMA (the loop unrolled by two): one step (the odd tail alone), two
    # (one pair), 45 (pairs and the tail), 8 with the ring wrapping, two warpgroups, packed
    (64, 64, 64, W4WgConfig(64, 64, 4, 3, 0, 1)),
    (64, 130, 128, W4WgConfig(128, 64, 8, 4, 0, 1)),
    (257, 300, 2880, W4WgConfig(128, 64, 4, 4, 0, 1)),
    (100, 200, 512, W4WgConfig(128, 128, 4, 3, 0, 1)),
    (130, 520, 768, W4WgConfig(128, 256, 8, 3, 0, 1)),
    (300, 70, 1024, W4WgConfig(64, 256, 4, 3, 1, 1)),
    # two MMAs in flight: the same cases (the slot refilled one step later)
    (64, 64, 64, W4WgConfig(64, 64, 4, 3, 0, 2)),
    (64, 130, 128, W4WgConfig(128, 64, 8, 4, 0, 2)),
    (257, 300, 2880, W4WgConfig(64, 64, 4, 3, 0, 2)),
    (100, 200, 512, W4WgConfig(128, 128, 8, 3, 0, 2)),
    (130, 520, 768, W4WgConfig(128, 256, 8, 3, 0, 2)),
    (300, 70, 1024, W4WgConfig(64, 256, 4, 2, 1, 2)),
    (257, 300, 2880, W4WgConfig(128, 64, 4, 4, 0, 2)),
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_matches_the_dequantised_reference(M, N, K, config, with_bias):
    gen = generator(M * 1000 + N + K)
    x, wq, w_scale, bias = mxfp4_weight_operands(M, N, K, gen, with_bias)
    stored = quant.prepack_mxfp4(wq, w_scale)[0] if config.packed else wq
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    y = gemm_w4wg(x, stored, w_scale, bias, config, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_matches_reference(y, x, quant.dequant_mxfp4(wq, w_scale), bias)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [W4WgConfig(128, 128, 4, 3), W4WgConfig(256, 64, 8, 3),
                                    W4WgConfig(64, 256, 4, 3), W4WgConfig(128, 128, 4, 3, 1),
                                    W4WgConfig(128, 256, 8, 3, 0, 1),
                                    W4WgConfig(128, 256, 8, 3, 0, 2)])
def test_gpu_every_code_at_every_scale_byte_exactly(config):
    """Row n of w has scale byte n on all its blocks and the 16 codes over and over, shifted by
    each 16 elements' index (so a K order wrong within a block shows); x is the identity, so y
    is w dequantised, rounded once to bf16: equal to the reference bit for bit, 2^-127's
    multiples (bf16 subnormals through the bf16 scale multiply) and the NaN row (byte 255)
    included; packed too. Bytes 253 and 254 make some weights infinite (4 x 2^126 and up, as
    in fp32), which the MMA's sum over K turns into NaN with x's zeros: those rows are checked
    apart, with x all ones on positive codes (+inf)."""
    K = 128
    k = torch.arange(K, device=DEVICE)
    codes = (k + k // 16) % 16
    wq = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).repeat(256, 1)
    w_scale = torch.arange(256, device=DEVICE).to(torch.uint8)[:, None].repeat(1, K // 32)
    x = torch.eye(K, dtype=torch.bfloat16, device=DEVICE)
    stored = quant.prepack_mxfp4(wq, w_scale)[0] if config.packed else wq
    y = gemm_w4wg(x, stored, w_scale, None, config)
    want = quant.dequant_mxfp4(wq, w_scale).T.to(torch.bfloat16)
    finite = [n for n in range(256) if n not in (253, 254)]
    torch.testing.assert_close(y[:, finite], want[:, finite], rtol=0, atol=0, equal_nan=True)
    # Bytes 253 and 254 with the positive codes (0-7): x all ones sums each row's weights
    positive = (k % 8).to(torch.uint8)
    wq = (positive[0::2] | (positive[1::2] << 4)).repeat(2, 1)
    w_scale = torch.tensor([[253], [254]], dtype=torch.uint8, device=DEVICE).repeat(1, K // 32)
    stored = quant.prepack_mxfp4(wq, w_scale)[0] if config.packed else wq
    y = gemm_w4wg(torch.ones(64, K, dtype=torch.bfloat16, device=DEVICE), stored, w_scale,
                  None, config)
    assert (y == float("inf")).all()


@on_hopper
@pytest.mark.gpu
def test_gpu_a_nan_scale_makes_its_row_nan_and_no_other():
    """A NaN scale byte (255) in one block of a row, beside a large byte (236: the largest
    weights 6 x 2^109, their dot products with x still finite in fp32) and the smallest (0):
    that row is NaN, every other row right."""
    M, N, K = 70, 130, 512
    x, wq, w_scale, _ = mxfp4_weight_operands(M, N, K, generator(7), False)
    nan_rows = {5: 0, 17: 1, 30: 6, 100: 15}  # row: block
    # 236: |x| K 6 x 2^109 < 2^128, the row's sums stay finite
    w_scale = with_nan_scales(w_scale, nan_rows, 236)
    y = gemm_w4wg(x, wq, w_scale, None, W4WgConfig(128, 64, 4, 3))
    assert_only_nan_rows_are_nan(y, nan_rows, x, wq, w_scale)


@on_hopper
@pytest.mark.gpu
def test_gpu_real_sizes_and_default_config():
    for M, N, K in ((1024, 4096, 4096), (2048, 2880, 2880), (96, 1280, 8192)):
        x, wq, w_scale, bias = mxfp4_weight_operands(M, N, K, generator(M + N), True)
        y = gemm_w4wg(x, wq, w_scale, bias)
        assert_matches_reference(y, x, quant.dequant_mxfp4(wq, w_scale), bias)

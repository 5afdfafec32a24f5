"""The register-direct MXFP4-weight kernel (``gemm_w4frag``, Gluon, Hopper only): bf16 x @
dequant(wq, w_scale).T + bias.

On the CPU: its names, constraints and candidates (tests/test_kernels_compile_for_hopper.py
compiles it for sm_90). On a GPU: against the fp32 product of x and the dequantised weight at
ragged sizes, every block_k and block_m, split sums in order and added, PDL, bias, with fresh
random data and NaN-poisoned outputs; every code at every scale byte bit for bit, a NaN scale
making its row NaN and no other; MXFP4 x (gemm_a4w4_blockscale's) the same ways.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gemm_checks
from gemm_checks import (DEVICE, assert_matches_reference,
                         assert_mxfp4_launcher_says_what_is_wrong,
                         assert_only_nan_rows_are_nan, generator, mxfp4_weight_operands,
                         on_hopper, randn, with_nan_scales)
from gemmtune import quant
from gemmtune.kernels.triton import _splits
from gemmtune.kernels.triton._splits import PDL_WAIT
from gemmtune.kernels.triton.gemm_w4frag import (W4FragConfig, candidates, default_config,
                                                 gemm_w4frag, launch_gemm_w4frag, w4frag_call,
                                                 why_not_fits, why_not_supported)

def test_names_round_trip():
    cfg = W4FragConfig(8, 128, 4)
    assert cfg.name == "triton.w4frag:BM8.BK128.SK4"
    added = W4FragConfig(16, 256, 8, PDL_WAIT, 1)
    assert added.name == "triton.w4frag:BM16.BK256.SK8.P1.R1"
    packed = W4FragConfig(8, 128, 4, packed=1)
    assert packed.name == "triton.w4frag:BM8.BK128.SK4.P0.R0.L1"
    assert W4FragConfig.from_name(packed.name) == packed
    assert W4FragConfig.from_name(cfg.name) == cfg
    assert W4FragConfig.from_name(added.name) == added
    first = W4FragConfig(8, 128, 4, x_first=1)
    assert first.name == "triton.w4frag:BM8.BK128.SK4.P0.R0.L0.X1"
    assert W4FragConfig.from_name(first.name) == first
    two_warps = W4FragConfig(8, 128, 4, PDL_WAIT, 1, 1, warps=2)
    assert two_warps.name == "triton.w4frag:BM8.BK128.SK4.P1.R1.L1.X0.W2"
    assert W4FragConfig.from_name(two_warps.name) == two_warps
    by_block = W4FragConfig(16, 128, 9, PDL_WAIT, 1, 1, warps=2, x_by_block=1)
    assert by_block.name == "triton.w4frag:BM16.BK128.SK9.P1.R1.L1.X0.W2.XB1"
    assert W4FragConfig.from_name(by_block.name) == by_block


@pytest.mark.parametrize("config, M, K, dtype, says", [
    (W4FragConfig(8, 128, 1), 1, 256, torch.float16, "takes bf16 x or MXFP4 x"),
    (W4FragConfig(64, 128, 1), 1, 256, torch.bfloat16, "block_m=64 must be one of"),
    (W4FragConfig(8, 96, 1), 1, 192, torch.bfloat16, "block_k=96"),
    (W4FragConfig(8, 128, 1), 1, 160, torch.bfloat16, "not a multiple of block_k=128"),
    (W4FragConfig(8, 64, 5), 1, 256, torch.bfloat16, "split_k=5 must be in [1, 4]"),
    (W4FragConfig(8, 64, 1, add_splits=1), 1, 256, torch.bfloat16, "needs split_k > 1"),
    (W4FragConfig(8, 64, 2, pdl=2), 1, 256, torch.bfloat16, "pdl=2"),
    (W4FragConfig(8, 64, 2, packed=1), 1, 256, torch.bfloat16, "use block_k 128 or 256"),
    (W4FragConfig(8, 64, 2, x_first=1), 1, 256, torch.bfloat16, "1 dequantises MXFP4 x first"),
    (W4FragConfig(8, 64, 2, warps=3), 1, 256, torch.bfloat16, "warps=3 must be one of"),
    (W4FragConfig(8, 128, 2, warps=1), 1, 256, torch.bfloat16, "warps=1 must be one of"),
    (W4FragConfig(32, 128, 2, warps=2), 1, 256, torch.bfloat16, "2 warps take block_m <= 16"),
    (W4FragConfig(8, 128, 2, x_by_block=1), 1, 256, torch.bfloat16, "only a packed config"),
    (W4FragConfig(8, 128, 2, packed=1, x_by_block=2), 1, 256, torch.bfloat16, "x_by_block=2"),
])
def test_configs_that_cannot_run_say_why(config, M, K, dtype, says):
    assert says in why_not_fits(config, M, 256, K, dtype)


def test_candidates_fit_cover_m_and_split_for_decode():
    for M, N, K in ((1, 4096, 4096), (16, 2880, 2880), (32, 576, 7168)):
        found = candidates(M, N, K, torch.bfloat16, num_sms=132, pdl=PDL_WAIT)
        assert found and all(why_not_fits(c, M, N, K, torch.bfloat16) is None for c in found)
        assert all(c.block_m >= M for c in found)  # one tile of x's rows
        assert any(c.split_k > 1 and c.add_splits for c in found)
        assert {c.pdl for c in found} == {0, PDL_WAIT}
    # Past 32 rows, tiles of 32 to 128 rows, each decoding the same w
    for M in (33, 128):
        found = candidates(M, 4096, 4096, torch.bfloat16, num_sms=132, pdl=PDL_WAIT)
        assert {c.block_m for c in found} == {32}
        assert {c.warps for c in found} == {4}
    # Fewer warps (more rows of w each) beside PDL with the splits added, to 16 rows of x
    for M in (1, 16):
        found = candidates(M, 4096, 4096, torch.bfloat16, num_sms=132, pdl=PDL_WAIT)
        assert {c.warps for c in found} == {2, 4}
        assert all(c.pdl == PDL_WAIT and c.add_splits for c in found if c.warps < 4)
    assert candidates(129, 4096, 4096, torch.bfloat16, num_sms=132) == []
    assert candidates(1, 4096, 4096, torch.float16, num_sms=132) == []
    # MXFP4 x (uint8 codes: gemm_a4w4_blockscale) takes the same configs as bf16 x, each also
    # with x dequantised first
    bf16_x = candidates(16, 2880, 2880, torch.bfloat16, num_sms=132, pdl=PDL_WAIT)
    mxfp4_x = candidates(16, 2880, 2880, torch.uint8, num_sms=132, pdl=PDL_WAIT)
    assert sorted(mxfp4_x, key=str) == sorted(
        bf16_x + [dataclasses.replace(c, x_first=1) for c in bf16_x], key=str)
    # 2912 = 91 x 32: no step of 64-256 divides it, so 32; 2880 = 45 x 64
    assert {c.block_k for c in candidates(1, 2880, 2912, torch.bfloat16, num_sms=132)} == {32}
    assert {c.block_k for c in candidates(1, 2880, 2880, torch.bfloat16, num_sms=132)} == {64}
    assert why_not_fits(default_config(5, 4096, 2880, torch.bfloat16, num_sms=132), 5, 4096,
                        2880, torch.bfloat16) is None
    packed = candidates(1, 4096, 4096, torch.bfloat16, num_sms=132, packed=True)
    assert packed and all(c.packed and c.block_k in (128, 256) for c in packed)
    # x's blocks read one at a time: a twin of each packed 2-warp config with bf16 x
    for M in (1, 16):
        packed = candidates(M, 4096, 4096, torch.bfloat16, num_sms=132, pdl=PDL_WAIT,
                            packed=True)
        twins = {dataclasses.replace(c, x_by_block=0) for c in packed if c.x_by_block}
        assert twins and twins == {c for c in packed if c.warps == 2 and not c.x_by_block}
    assert not any(c.x_by_block for c in candidates(16, 4096, 4096, torch.uint8, num_sms=132,
                                                    pdl=PDL_WAIT, packed=True))
    assert candidates(1, 2880, 2880, torch.bfloat16, num_sms=132, packed=True) == []


def test_a_weight_the_launcher_copies_goes_without_pdl(monkeypatch):
    """With PDL w's first group loads before the wait, before which a copy the launcher has just
    made of w (or its scales) is not sure to be seen: such a launch goes without PDL."""
    monkeypatch.setattr(_splits, "pdl_supported", lambda device: True)
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    wq, w_scale = quant.mxfp4(torch.randn(64, 256))
    out = torch.empty(1, 64, dtype=torch.bfloat16)
    config = W4FragConfig(8, 128, 1, PDL_WAIT)
    call = w4frag_call(x, wq, None, out, None, w_scale, config)
    assert call.launch_pdl and call.constexprs["PDL"]
    wide = torch.zeros(64, 128 + 16, dtype=torch.uint8)
    wide[:, 2:130] = wq  # rows 2 bytes past 16-byte alignment: copied
    call = w4frag_call(x, wide[:, 2:130], None, out, None, w_scale, config)
    assert not call.launch_pdl and not call.constexprs["PDL"]
    scales = torch.zeros(64, 8 + 1, dtype=torch.uint8)
    scales[:, 1:] = w_scale  # scales off their alignment: copied
    call = w4frag_call(x, wq, None, out, None, scales[:, 1:], config)
    assert not call.launch_pdl


@pytest.mark.skipif(torch.cuda.is_available(), reason="says why where it cannot run")
def test_refuses_to_run_where_it_cannot():
    why = why_not_supported(W4FragConfig(8, 128, 1), 1, 64, 128, torch.bfloat16, torch.bfloat16)
    assert why is not None and ("interpreter" in why or "Hopper" in why)
    assert "writes x's dtype" in why_not_supported(W4FragConfig(8, 128, 1), 1, 64, 128,
                                                   torch.bfloat16, torch.float32)
    assert "with MXFP4 x the kernel writes bf16, fp16 or fp32" in why_not_supported(
        W4FragConfig(8, 128, 1), 1, 64, 128, torch.uint8, torch.uint8)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, config", [
    (1, 70, 128, W4FragConfig(8, 128, 1)),           # N ragged, one step
    (5, 200, 2880, W4FragConfig(8, 32, 6)),          # K in 32-blocks, split 6 ways
    (8, 64, 512, W4FragConfig(8, 64, 4, PDL_WAIT)),  # PDL
    (13, 130, 1024, W4FragConfig(16, 256, 2, 0, 1)),  # added splits
    (20, 96, 768, W4FragConfig(32, 128, 3)),          # BLOCK_M 32, split 3 (uneven steps)
    (40, 64, 256, W4FragConfig(16, 128, 2, 0, 1)),    # x's rows in 3 blocks, added splits
    (3, 70, 1024, W4FragConfig(8, 128, 3, packed=1)),  # packed w, split 3 (uneven steps)
    (17, 200, 768, W4FragConfig(32, 256, 1, PDL_WAIT, packed=1)),  # packed, 2 groups a step
    (8, 64, 2048, W4FragConfig(8, 256, 4, 0, 1, 1)),  # packed, added splits
    # 2 warps (32 rows each): both layouts, in order and added, PDL
    (1, 70, 1024, W4FragConfig(8, 128, 3, PDL_WAIT, 1, 1, warps=2)),
    (13, 130, 2048, W4FragConfig(16, 256, 2, 0, 0, 0, warps=2)),
    (5, 200, 2880, W4FragConfig(8, 32, 6, warps=2)),
    (3, 200, 4096, W4FragConfig(16, 128, 5, PDL_WAIT, 1, 1, warps=2)),
    (33, 600, 7168, W4FragConfig(32, 128, 28, 0, 1)),  # added: 28 splits, N and M ragged
    (1, 200, 7168, W4FragConfig(8, 256, 28, PDL_WAIT, 1, 1)),  # ... packed, a step a split
    (5, 200, 4096, W4FragConfig(8, 256, 5, 0, 1, 1, warps=2)),  # packed, 2 warps, uneven split
    # packed, x's blocks read one at a time: 2 warps, in order and added, PDL; 4 warps
    (13, 130, 2048, W4FragConfig(16, 128, 3, PDL_WAIT, 1, 1, warps=2, x_by_block=1)),
    (1, 70, 1024, W4FragConfig(8, 256, 2, 0, 0, 1, warps=2, x_by_block=1)),
    (20, 96, 768, W4FragConfig(32, 128, 1, 0, 0, 1, x_by_block=1)),
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_matches_the_dequantised_reference(M, N, K, config, with_bias):
    gemm_checks.mxfp4_weight_kernel_matches_reference(gemm_w4frag, M, N, K, config, with_bias,
                                                      packed=config.packed)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [W4FragConfig(8, 128, 4, PDL_WAIT, 1, 1),
                                    W4FragConfig(16, 256, 1, PDL_WAIT),
                                    W4FragConfig(8, 64, 2, PDL_WAIT)], ids=lambda c: c.name)
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pdl_chain_reads_its_input_after_the_producer(config, graph):
    """Each GEMM's x is the previous one's output: with PDL only w (its first group, before
    the wait) may load before the previous GEMM is done."""
    def mxfp4_weight(K, gen):
        wq, w_scale = quant.mxfp4(randn(K, K, gen=gen) / K ** 0.5)
        codes = quant.prepack_mxfp4(wq, w_scale)[0] if config.packed else wq
        return codes, w_scale, lambda y, x, scale_a: assert_matches_reference(
            y, x, quant.dequant_mxfp4(wq, w_scale))

    gemm_checks.pdl_chain_reads_its_input_after_the_producer(
        launch_gemm_w4frag, config, config.block_m - 3, 1024, graph, 70 + config.block_k,
        weight=mxfp4_weight)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [
    W4FragConfig(32, 32, 1), W4FragConfig(32, 64, 1),  # a step's scales as a byte, two bytes
    W4FragConfig(32, 256, 1), W4FragConfig(32, 128, 1, packed=1),  # groups of 4: a word
    W4FragConfig(16, 128, 1, packed=1, warps=2), W4FragConfig(8, 64, 1, warps=2),
    W4FragConfig(16, 128, 1, packed=1, warps=2, x_by_block=1)])
def test_gpu_every_code_at_every_scale_byte_exactly(config):
    """w's codes multiplied from zero, each block's product scaled in fp32: infinities (6 x
    2^127) stay infinite; packed too."""
    gemm_checks.mxfp4_every_code_at_every_scale_byte(gemm_w4frag, config, config.block_k,
                                                     packed=config.packed,
                                                     scaled_before_mma=False)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [W4FragConfig(8, 128, 2), W4FragConfig(16, 256, 1, packed=1),
                                    W4FragConfig(8, 128, 2, packed=1, warps=2),
                                    W4FragConfig(16, 128, 2, warps=2)])
def test_gpu_a_nan_scale_makes_its_row_nan_and_no_other(config):
    """A NaN scale byte (255) in one block of a row, at each of the 4 places of a scale word
    and beside the largest finite byte (254): that row is NaN, every other row exact."""
    M, N, K = 3, 64, 512
    gen = generator(7)
    x, wq, w_scale, _ = mxfp4_weight_operands(M, N, K, gen, False)
    nan_rows = {5: 0, 17: 1, 30: 6, 41: 15}  # row: block (the word's byte: block % 4)
    w_scale = with_nan_scales(w_scale, nan_rows, 254)
    stored = quant.prepack_mxfp4(wq, w_scale)[0] if config.packed else wq
    y = gemm_w4frag(x, stored, w_scale, None, config)
    assert_only_nan_rows_are_nan(y, nan_rows, x, wq, w_scale)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, config", [
    (1, 70, 128, W4FragConfig(8, 128, 1)),            # N ragged, one group
    (5, 200, 2880, W4FragConfig(8, 32, 6)),           # K in 32-blocks, split 6 ways
    (13, 130, 1024, W4FragConfig(16, 256, 2, 0, 1)),  # added splits
    (20, 96, 768, W4FragConfig(32, 128, 3)),          # 32 rows of x, uneven split
    (3, 70, 1024, W4FragConfig(8, 128, 3, PDL_WAIT, packed=1)),  # packed w, PDL
    (40, 64, 512, W4FragConfig(16, 64, 2)),           # x's rows in 3 blocks, 2 scale bytes
    (5, 200, 2880, W4FragConfig(8, 32, 6, x_first=1)),  # x dequantised first
    (3, 70, 1024, W4FragConfig(8, 128, 3, PDL_WAIT, packed=1, x_first=1)),  # ... PDL, packed
    (20, 96, 768, W4FragConfig(32, 128, 3, 0, 1, x_first=1)),  # ... added splits
    (5, 200, 4096, W4FragConfig(8, 128, 4, PDL_WAIT, 1, 1, warps=2)),  # 2 warps
    (13, 130, 2048, W4FragConfig(16, 256, 2, 0, 0, 0, 1, warps=2)),  # ... x dequantised first
    (5, 200, 4096, W4FragConfig(8, 128, 16, 0, 1)),  # added: 16 splits, N ragged
    (3, 200, 4096, W4FragConfig(16, 128, 4, PDL_WAIT, 1, 0, warps=2)),  # 2 warps, x decoded
    (1, 70, 2048, W4FragConfig(8, 256, 3, PDL_WAIT, 0, 1, warps=2)),  # ... packed, in order
    (3, 200, 4096, W4FragConfig(16, 128, 4, PDL_WAIT, 1, 1, warps=2, x_by_block=1)),  # x's
    # blocks read one at a time
])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_mxfp4_x_matches_the_dequantised_reference(M, N, K, config, out_dtype):
    """x MXFP4 too (gemm_a4w4_blockscale): its codes decoded like w's, each block's product
    scaled by both rows' scales (packed w: x scaled as it is stored); or (x_first) x
    dequantised to bf16 by a launch of its own, then the bf16-x kernel."""
    gemm_checks.mxfp4_x_kernel_matches_reference(launch_gemm_w4frag, M, N, K, config,
                                                 out_dtype, packed=config.packed)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("x_first, packed", [(0, 0), (1, 0), (0, 1)])
def test_gpu_every_x_code_at_every_x_scale_byte_exactly(x_first, packed):
    """Decoded in the loop (w as quantised), decoded and scaled as it is stored in shared
    memory (packed w) or dequantised first. Dequantised first or scaled as stored, an x past
    bf16's range (bytes 253-254) is infinite before the MMA and its row NaN; decoded in the
    loop, the scale comes after the sums and keeps them infinite."""
    gemm_checks.mxfp4_every_x_code_at_every_x_scale_byte(
        launch_gemm_w4frag, W4FragConfig(32, 128, 1, x_first=x_first, packed=packed),
        packed=packed, scaled_before_mma=bool(x_first or packed))


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("packed", [0, 1])
def test_gpu_mxfp4_x_at_large_scales(packed):
    """Packed, x is scaled as it is stored: right up to x's byte 240 (the module's docstring
    says where a block's sum can overflow before w's scale)."""
    gemm_checks.mxfp4_x_at_large_scales(launch_gemm_w4frag, W4FragConfig(8, 128, 1, packed=packed),
                                        packed=packed)


@on_hopper
@pytest.mark.gpu
def test_gpu_real_sizes_and_default_config():
    for M, N, K in ((1, 4096, 4096), (16, 1280, 8192), (32, 2880, 2880)):
        gen = generator(M + N)
        x, wq, w_scale, bias = mxfp4_weight_operands(M, N, K, gen, True)
        y = gemm_w4frag(x, wq, w_scale, bias)
        assert_matches_reference(y, x, quant.dequant_mxfp4(wq, w_scale), bias)


def test_bad_arguments_say_what_is_wrong():
    assert_mxfp4_launcher_says_what_is_wrong(gemm_w4frag)


def test_scales_reach_the_kernel_16_byte_aligned():
    """A step's scale bytes load as one 32-bit word: scales sliced at an odd offset (or
    strided) reach the kernel as an aligned copy, so a recording made with aligned scales (whose
    alignment check is 16 bytes) never replays onto misaligned ones; aligned scales go as they
    are."""
    from gemmtune.kernels.triton.gemm_w4frag import w4frag_call

    x = torch.zeros(1, 256, dtype=torch.bfloat16, device=DEVICE)
    wq, ws = quant.mxfp4(randn(64, 256, gen=generator(1)))
    y = torch.empty(1, 64, dtype=torch.bfloat16, device=DEVICE)
    flat = torch.zeros(ws.numel() + 1, dtype=torch.uint8, device=DEVICE)
    odd = flat[1:].view(64, 8)
    odd.copy_(ws)
    config = W4FragConfig(8, 128, 1)
    scales = w4frag_call(x, wq, None, y, None, odd, config).args[2]
    assert scales.data_ptr() % 16 == 0 and torch.equal(scales, ws)
    wide = torch.zeros(64, 16, dtype=torch.uint8, device=DEVICE)
    wide[:, :8] = ws
    scales = w4frag_call(x, wq, None, y, None, wide[:, :8], config).args[2]
    assert scales.is_contiguous() and torch.equal(scales, ws)
    assert w4frag_call(x, wq, None, y, None, ws, config).args[2] is ws


def test_x_and_codes_reach_the_kernel_as_aligned_words():
    """x (two bf16 a word) and the codes (4 bytes a word) are read as 32-bit words: x at an
    odd element offset or with an odd row pitch, and codes at an offset that is not a multiple
    of 16 bytes, reach the kernel as aligned copies; aligned operands go as they are."""
    from gemmtune.kernels.triton.gemm_w4frag import w4frag_call

    x = randn(2, 256, gen=generator(2)).to(torch.bfloat16)
    wq, ws = quant.mxfp4(randn(64, 256, gen=generator(3)))
    y = torch.empty(2, 64, dtype=torch.bfloat16, device=DEVICE)
    config = W4FragConfig(8, 128, 1)
    wide = torch.zeros(2, 257, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :256] = x
    flat = torch.zeros(x.numel() + 1, dtype=torch.bfloat16, device=DEVICE)
    flat[1:].view(2, 256).copy_(x)
    for view in (flat[1:].view(2, 256), wide[:, :256]):  # odd offset; odd pitch (257)
        sent = w4frag_call(view, wq, None, y, None, ws, config).args[0]
        assert sent.data_ptr() % 16 == 0 and sent.stride(0) % 2 == 0 and torch.equal(sent, view)
    flat = torch.zeros(wq.numel() + 4, dtype=torch.uint8, device=DEVICE)
    shifted = flat[4:].view(64, 128)
    shifted.copy_(wq)
    sent = w4frag_call(x, shifted, None, y, None, ws, config).args[1]
    assert sent.data_ptr() % 16 == 0 and torch.equal(sent, wq)
    call = w4frag_call(x, wq, None, y, None, ws, config)
    assert call.args[0] is x and call.args[1] is wq


def test_configs_that_dequantise_x_first_are_not_replayed():
    """Two launches (x's dequantisation, then the kernel): dispatch launches them each call
    instead of replaying a recording of the second alone."""
    from gemmtune.kernels.triton.dispatchable import TritonKernel
    from gemmtune.kernels.triton.gemm_w4frag import replayed

    first = W4FragConfig(8, 128, 4, x_first=1)
    assert not replayed(first) and replayed(W4FragConfig(8, 128, 4))
    assert TritonKernel(first.name)._call is None
    assert TritonKernel(W4FragConfig(8, 128, 4).name)._call is not None

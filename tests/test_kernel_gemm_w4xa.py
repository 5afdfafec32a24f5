"""The MXFP4-weight kernel with x as the MMA's A operand (``gemm_w4xa``, Gluon, Hopper only):
x @ dequant(wq, w_scale).T + bias for packed w, x bf16 or MXFP4.

On the CPU: its names, constraints and candidates (tests/test_kernels_compile_for_hopper.py
compiles it for sm_90). On a GPU: against the fp32 product of x and the dequantised weight at
ragged sizes, every tile and warp count, split sums in order and added, PDL, bias, fresh random
data and NaN-poisoned outputs; every code at every scale byte bit for bit (w's and MXFP4 x's), a
NaN scale making its row NaN and no other, a chain of launches each reading the previous
output.
"""

from __future__ import annotations

import pytest
import torch

import gemm_checks
from gemm_checks import (DEVICE, assert_matches_reference,
                         assert_mxfp4_launcher_says_what_is_wrong,
                         assert_only_nan_rows_are_nan, generator, mxfp4_weight_operands,
                         on_hopper, randn, with_nan_scales)
from gemmtune import quant
from gemmtune.kernels.triton._splits import PDL_OFF, PDL_WAIT
from gemmtune.kernels.triton.gemm_w4xa import (MAX_M, MIN_M, W4XaConfig, candidates,
                                               default_config, gemm_w4xa, launch_gemm_w4xa,
                                               w4xa_call, why_not_fits, why_not_supported)


def test_names_round_trip():
    config = W4XaConfig(8, 2, 4, PDL_WAIT, 1)
    assert config.name == "triton.w4xa:T8.W2.SK4.P1.R1"
    assert W4XaConfig.from_name(config.name) == config
    assert W4XaConfig.from_name("triton.w4xa:T4.W1.SK1") == W4XaConfig(4, 1, 1)
    assert config.block_n == 128 and config.block_m == 16 and config.block_k == 128


@pytest.mark.parametrize("config, M, K, dtype, says", [
    (W4XaConfig(8, 1, 1), 16, 4096, torch.float16, "takes bf16 x or MXFP4 x"),
    (W4XaConfig(16, 1, 1), 16, 4096, torch.bfloat16, "tiles=16 must be one of"),
    (W4XaConfig(8, 8, 1), 16, 4096, torch.bfloat16, "warps=8 must be one of"),
    (W4XaConfig(2, 1, 1), 16, 4096, torch.bfloat16, "16 rows of w a program"),
    (W4XaConfig(8, 1, 1), 16, 4160, torch.bfloat16, "K must be a multiple of 128"),
    (W4XaConfig(8, 1, 2, add_splits=2), 16, 4096, torch.bfloat16, "add_splits=2 must be"),
    (W4XaConfig(8, 1, 33), 16, 8192, torch.bfloat16, "split_k=33 must be in [1, 32]"),
    (W4XaConfig(8, 1, 3), 16, 256, torch.bfloat16, "split_k=3 must be in [1, 2]"),
    (W4XaConfig(8, 1, 1, pdl=2), 16, 4096, torch.uint8, "pdl=2 must be"),
])
def test_configs_that_cannot_run_say_why(config, M, K, dtype, says):
    assert says in why_not_fits(config, M, 4096, K, dtype)


def test_the_output_dtype_is_checked():
    assert "writes x's dtype" in why_not_supported(
        W4XaConfig(8, 1, 1), 16, 64, 128, torch.bfloat16, torch.float32)
    assert "writes bf16, fp16 or fp32" in why_not_supported(
        W4XaConfig(8, 1, 1), 16, 64, 128, torch.uint8, torch.uint8)


def test_candidates_cover_9_to_16_rows_of_packed_w_and_split_for_decode():
    for M, N, K in ((9, 4096, 4096), (16, 14336, 4096), (16, 4096, 14336), (12, 200, 384)):
        for dtype in (torch.bfloat16, torch.uint8):
            found = candidates(M, N, K, dtype, num_sms=132, pdl=PDL_WAIT)
            assert found and all(why_not_fits(c, M, N, K, dtype) is None for c in found)
            assert {c.tiles for c in found} == {2, 4} and {c.warps for c in found} == {2, 4}
            assert {c.pdl for c in found} == {PDL_OFF, PDL_WAIT}
            # the splits reach at least 2 programs an SM where K has the steps for it
            for c in found:
                programs = -(-N // c.block_n) * c.split_k
                assert programs >= 2 * 132 or c.split_k == min(32, K // 128)
            assert any(c.add_splits for c in found if c.split_k > 1)
    assert candidates(16, 4096, 4096, torch.bfloat16, 132, packed=False) == []
    assert candidates(MIN_M - 1, 4096, 4096, torch.bfloat16, 132) == []
    assert candidates(MAX_M + 1, 4096, 4096, torch.bfloat16, 132) == []
    assert candidates(16, 4096, 4160, torch.bfloat16, 132) == []
    assert candidates(16, 4096, 4096, torch.float16, 132) == []
    assert why_not_fits(default_config(16, 4096, 4096, torch.bfloat16, 132), 16, 4096, 4096,
                        torch.bfloat16) is None


def test_a_weight_the_launcher_copies_goes_without_pdl(monkeypatch):
    """w (or its scales) copied by the launcher for alignment is written by a kernel launched
    just before: the launch then goes without PDL, since w's first group loads before the
    wait."""
    from gemmtune.kernels.triton import _splits

    monkeypatch.setattr(_splits, "pdl_supported", lambda device: True)
    x = torch.zeros(16, 256, dtype=torch.bfloat16, device=DEVICE)
    wq, ws = quant.mxfp4(randn(64, 256, gen=generator(1)))
    packed = quant.prepack_mxfp4(wq, ws)[0]
    y = torch.empty(16, 64, dtype=torch.bfloat16, device=DEVICE)
    config = W4XaConfig(8, 1, 1, PDL_WAIT)
    assert w4xa_call(x, packed, None, y, None, ws, config).launch_pdl
    flat = torch.zeros(packed.numel() + 4, dtype=torch.uint8, device=DEVICE)
    shifted = flat[4:].view(64, 128)
    shifted.copy_(packed)
    call = w4xa_call(x, shifted, None, y, None, ws, config)
    assert not call.launch_pdl and not call.constexprs["PDL"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="says why where it cannot run")
def test_refuses_to_run_where_it_cannot():
    why = why_not_supported(W4XaConfig(8, 1, 1), 16, 64, 128, torch.bfloat16, torch.bfloat16)
    assert "Gluon kernels do not run in Triton's interpreter" in why or "Hopper" in why


def test_dispatch_gives_it_packed_mxfp4_problems_only():
    from gemmtune.kernels.problem import GemmProblem, Scaling
    from gemmtune.kernels.triton.dispatchable import TritonKernel

    kernel = TritonKernel("triton.w4xa:T4.W4.SK4.P1.R1")
    packed = GemmProblem(16, 4096, 4096, torch.bfloat16, torch.bfloat16,
                         scaling=Scaling.mxfp4, preshuffled=True)
    unpacked = GemmProblem(16, 4096, 4096, torch.bfloat16, torch.bfloat16,
                           scaling=Scaling.mxfp4)
    assert "this problem's are as quantised" in kernel.check(unpacked)
    assert "multiplies MXFP4 weights only" in kernel.check(
        GemmProblem(16, 4096, 4096, torch.bfloat16, torch.bfloat16))
    why = kernel.check(packed)  # on the CPU, or a GPU other than a Hopper: says so
    assert why is None if torch.cuda.is_available() and torch.cuda.get_device_capability() == (
        9, 0) else "Gluon" in why or "Hopper" in why


def test_both_mxfp4_families_dispatch_to_it():
    """gemm_a16w4's and gemm_a4w4_blockscale's tables may name it (it takes bf16 and MXFP4
    x)."""
    from gemmtune.families.a4w4_blockscale.op import REGISTRY as A4W4
    from gemmtune.families.a16w4.op import REGISTRY as A16W4

    for registry in (A16W4, A4W4):
        assert "triton.w4xa" in registry.prefixes
        assert registry.resolve("triton.w4xa:T4.W4.SK4.P1.R1").name == \
            "triton.w4xa:T4.W4.SK4.P1.R1"


def test_bad_arguments_say_what_is_wrong():
    assert_mxfp4_launcher_says_what_is_wrong(gemm_w4xa)


# (M, N, K, config): ragged N and M, every tile and warp count, splits even and uneven, in
# order and added, PDL, rows of x past 16
_SHAPES = [
    (16, 70, 128, W4XaConfig(8, 1, 1)),                 # N ragged, one group
    (9, 200, 1024, W4XaConfig(4, 2, 3)),                # split 3 (uneven groups)
    (13, 130, 2048, W4XaConfig(8, 4, 5, PDL_WAIT, 1)),  # added splits, PDL, N past a program
    (16, 600, 7168, W4XaConfig(4, 1, 28, 0, 1)),        # added: 28 splits, two groups each
    (11, 256, 4096, W4XaConfig(8, 2, 32, PDL_WAIT)),    # 32 splits in order, one group each
    (3, 96, 768, W4XaConfig(4, 4, 2)),                  # under 16 rows of x
    (16, 330, 1536, W4XaConfig(2, 4, 6, PDL_WAIT, 1)),  # 2 tiles a warp, added, PDL
    (12, 100, 512, W4XaConfig(2, 2, 1)),                # 2 tiles, 2 warps: 32 rows a program
    (40, 200, 512, W4XaConfig(8, 1, 2, 0, 1)),          # x's rows in 3 blocks of 16
]


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, config", _SHAPES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_matches_the_dequantised_reference(M, N, K, config, with_bias):
    gemm_checks.mxfp4_weight_kernel_matches_reference(gemm_w4xa, M, N, K, config, with_bias,
                                                      packed=True)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, config", _SHAPES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_mxfp4_x_matches_the_dequantised_reference(M, N, K, config, out_dtype):
    """x MXFP4 too (gemm_a4w4_blockscale): its codes decoded and scaled as they are stored."""
    gemm_checks.mxfp4_x_kernel_matches_reference(launch_gemm_w4xa, M, N, K, config, out_dtype,
                                                 packed=True)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [W4XaConfig(8, 1, 1), W4XaConfig(4, 2, 1)],
                         ids=lambda c: c.name)
def test_gpu_every_code_at_every_scale_byte_exactly(config):
    """w's values are scaled in bf16 before the MMA: past bf16's range their rows are NaN."""
    gemm_checks.mxfp4_every_code_at_every_scale_byte(gemm_w4xa, config, 128, packed=True,
                                                     scaled_before_mma=True)


@on_hopper
@pytest.mark.gpu
def test_gpu_every_x_code_at_every_x_scale_byte_exactly():
    """x is scaled as it is stored: past bf16's range its rows are NaN."""
    gemm_checks.mxfp4_every_x_code_at_every_x_scale_byte(
        launch_gemm_w4xa, W4XaConfig(4, 2, 1), packed=True, scaled_before_mma=True)


@on_hopper
@pytest.mark.gpu
def test_gpu_mxfp4_x_at_large_scales():
    """x and w both scaled before the MMA: the sums are of the true products."""
    gemm_checks.mxfp4_x_at_large_scales(launch_gemm_w4xa, W4XaConfig(4, 2, 1), packed=True)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [W4XaConfig(8, 1, 2), W4XaConfig(4, 4, 1, PDL_WAIT)],
                         ids=lambda c: c.name)
def test_gpu_a_nan_scale_makes_its_row_nan_and_no_other(config):
    """A NaN scale byte (255) in one block of a row, at each of the 4 places of a scale word:
    that row is NaN, every other row right, the smallest byte (0) and a large one included
    (w's values are scaled in bf16 before the MMA: byte 254's are past bf16's range, which
    test_gpu_every_code_at_every_scale_byte_exactly covers)."""
    M, N, K = 16, 64, 512
    x, wq, w_scale, _ = mxfp4_weight_operands(M, N, K, generator(7), False)
    # row: block (the word's byte: block % 4); rows 40 (byte 0) and 41 (byte 200) checked for
    # their values
    nan_rows = {5: 0, 17: 1, 30: 6, 60: 15}
    w_scale = with_nan_scales(w_scale, nan_rows, 200)
    y = gemm_w4xa(x, quant.prepack_mxfp4(wq, w_scale)[0], w_scale, None, config)
    assert_only_nan_rows_are_nan(y, nan_rows, x, wq, w_scale)


@on_hopper
@pytest.mark.gpu
@pytest.mark.parametrize("config", [W4XaConfig(8, 1, 4, PDL_WAIT, 1),
                                    W4XaConfig(4, 2, 1, PDL_WAIT)], ids=lambda c: c.name)
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pdl_chain_reads_its_input_after_the_producer(config, graph):
    """Each GEMM's x is the previous one's output: with PDL only w (its first group, before the
    wait) may load before the previous GEMM is done."""
    def mxfp4_weight(K, gen):
        wq, w_scale = quant.mxfp4(randn(K, K, gen=gen) / K ** 0.5)
        return quant.prepack_mxfp4(wq, w_scale)[0], w_scale, \
            lambda y, x, scale_a: assert_matches_reference(y, x, quant.dequant_mxfp4(wq, w_scale))

    gemm_checks.pdl_chain_reads_its_input_after_the_producer(
        launch_gemm_w4xa, config, 13, 1024, graph, 71 + config.tiles, weight=mxfp4_weight)


@on_hopper
@pytest.mark.gpu
def test_gpu_real_sizes_and_default_config():
    for M, N, K in ((16, 4096, 4096), (9, 1280, 8192), (16, 2880, 4096)):
        x, wq, w_scale, bias = mxfp4_weight_operands(M, N, K, generator(M + N), True)
        y = gemm_w4xa(x, quant.prepack_mxfp4(wq, w_scale)[0], w_scale, bias)
        assert_matches_reference(y, x, quant.dequant_mxfp4(wq, w_scale), bias)

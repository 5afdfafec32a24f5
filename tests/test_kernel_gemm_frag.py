"""The register-direct Gluon kernel (``triton.frag``) of FP8 weights, row-major or pre-shuffled.

Gluon kernels do not run in Triton's interpreter: on the CPU its config space and refusals are
checked here and its sm_90 code in tests/test_kernels_compile_for_hopper.py; the ``gpu`` tests
check every config family (steps, splits, steps ahead, blocks of x, PDL) against the fp32
reference at ragged sizes, with every scale layout, bias and output dtype, NaN-poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

from gemm_checks import (DEVICE, assert_block_scaled_decode_launches,
                         assert_fp8_decode_launches, assert_long_k_as_precise_as_cublas,
                         check_fp8_decode, generator, poisoned, quantised_operands)
from gemmtune import quant
from gemmtune.kernels.triton import _splits, _swapped, gemm_frag
from gemmtune.kernels.triton._splits import PDL_WAIT
from gemmtune.kernels.triton.gemm_frag import FragConfig

FP8 = torch.float8_e4m3fn


def test_names_round_trip():
    cfg = FragConfig(16, 256, 4, 2, 1)
    assert cfg.name == "triton.frag:BM16.BK256.SK4.A2.P1"
    assert FragConfig.from_name(cfg.name) == cfg
    assert FragConfig.from_name("triton.frag:BM64.BK128.SK1.A1") == FragConfig(64, 128, 1, 1, 0)
    added = FragConfig(16, 256, 4, 2, 0, 1)  # splits added: the PDL field is written out
    assert added.name == "triton.frag:BM16.BK256.SK4.A2.P0.R1"
    assert FragConfig.from_name(added.name) == added


@pytest.mark.parametrize("config, M, N, K, dtype, says", [
    (FragConfig(16, 256, 4, 1), 16, 4096, 4096, torch.int8, "float8_e4m3fn only"),
    (FragConfig(16, 256, 4, 1), 16, 4096, 2304 + 128, FP8, "not a multiple of block_k=256"),
    (FragConfig(16, 256, 40, 1), 16, 4096, 16384, FP8, "split_k=40 must be in"),
    (FragConfig(16, 256, 8, 1), 16, 4096, 1024, FP8, "4 steps of block_k=256"),
    (FragConfig(24, 256, 1, 1), 16, 4096, 4096, FP8, "block_m=24 must be one of"),
    (FragConfig(128, 256, 1, 1), 16, 4096, 4096, FP8, "block_m=128 must be one of"),
    (FragConfig(16, 64, 1, 1), 16, 4096, 4096, FP8, "block_k=64 must be one of"),
    (FragConfig(16, 256, 1, 2), 16, 4096, 4096, FP8, "768 bytes of each row in flight"),
    (FragConfig(8, 128, 1, 1), 600_000, 4096, 4096, FP8, "grid's third axis"),
    (FragConfig(16, 256, 1, 0), 16, 4096, 4096, FP8, "ahead=0 must be in"),
    (FragConfig(16, 256, 1, 1, 2), 16, 4096, 4096, FP8, "pdl=2 must be"),
])
def test_configs_that_cannot_run_say_why(config, M, N, K, dtype, says):
    assert says in gemm_frag.why_not_fits(config, M, N, K, dtype)


def test_any_n_row_major_whole_tiles_pre_shuffled():
    """Row-major w takes any N (rows past it are masked); a pre-shuffled one comes in whole
    16-row tiles, which the dispatch checks (``_wlayout.why_not_tiled``)."""
    from gemmtune.kernels.triton._wlayout import why_not_tiled

    cfg = FragConfig(16, 256, 4, 1)
    assert gemm_frag.why_not_fits(cfg, 16, 4100, 4096, FP8) is None
    assert "N must be a multiple of 16" in why_not_tiled(cfg, 4100, 4096, FP8)


@pytest.mark.parametrize("M, N, K", [(1, 576, 7168), (16, 4096, 512), (33, 1040, 2304),
                                     (64, 151936, 5120), (200, 256, 7168), (1000, 4096, 4096),
                                     (3, 16, 128)])
def test_candidates_and_default_fit(M, N, K):
    found = gemm_frag.candidates(M, N, K, FP8, num_sms=132, pdl=1)
    assert bool(found) == (M <= 64), (M, N, K)  # decode only
    assert {c.pdl for c in found} == ({0, 1} if found else set())
    assert all(gemm_frag.w_bytes_in_flight(c) <= 512 for c in found)
    for cfg in found:
        assert gemm_frag.fits(cfg, M, N, K, FP8), cfg.name
        assert cfg.block_m == gemm_frag.block_m_for(M) and K % cfg.block_k == 0
    assert len({c.name for c in found}) == len(found)
    assert gemm_frag.fits(gemm_frag.default_config(M, N, K, FP8, num_sms=132), M, N, K, FP8)


def test_a_weight_the_launcher_copies_goes_without_pdl(monkeypatch):
    """With PDL w's first steps load before the wait, before which a copy the launcher has just
    made of w (rows not 16-byte aligned) is not sure to be seen: such a launch goes without
    PDL."""
    monkeypatch.setattr(_splits, "pdl_supported", lambda device: True)
    xq = torch.randn(16, 256).to(torch.float8_e4m3fn)
    out = torch.empty(16, 64, dtype=torch.bfloat16)
    config = FragConfig(16, 128, 1, 1, PDL_WAIT)
    aligned = torch.randn(64, 256).to(torch.float8_e4m3fn)
    call = gemm_frag.frag_call(xq, aligned, None, out, torch.ones(16), torch.ones(64), config)
    assert call.launch_pdl and call.constexprs["PDL"]
    wide = torch.zeros(64, 256 + 8).to(torch.float8_e4m3fn)
    call = gemm_frag.frag_call(xq, wide[:, :256], None, out, torch.ones(16), torch.ones(64),
                               config)
    assert not call.launch_pdl and not call.constexprs["PDL"]


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU's refusal")
def test_refuses_the_interpreter():
    from gemmtune.kernels.triton import _checks

    if not _checks.interpreted():
        pytest.skip("runs under the test suite's TRITON_INTERPRET=1")
    cfg = FragConfig(16, 128, 1, 1)
    assert "interpreter" in gemm_frag.why_not_supported(cfg, 16, 64, 256, FP8, torch.bfloat16)
    with pytest.raises(ValueError, match="interpreter"):
        gemm_frag.gemm_frag(torch.zeros(16, 256).to(FP8), torch.zeros(64, 256).to(FP8))


@pytest.mark.parametrize("config, says", [
    (FragConfig(16, 128, 4, 3), None),
    (FragConfig(64, 128, 4, 2), None),
    (FragConfig(16, 256, 4, 1), "block_k=256 must divide 128"),
])
def test_block_scales_take_steps_of_128(config, says):
    """One scale block a step: the block-scale family's registry takes steps of 128 only."""
    from gemmtune.kernels.triton.dispatchable import _kernel_module

    why = _kernel_module("triton.frag").why_not_block_scaled(config, FP8)
    assert why is None if says is None else says in why


def test_refuses_gpus_other_than_hopper_and_strided_tiled_weights(monkeypatch):
    """Compiled for Blackwell the fp32 sums it is written for do not build, and a strided
    pre-shuffled w would be read as if contiguous: both are refused with what to use instead."""
    from gemmtune.kernels.triton import _checks

    monkeypatch.setattr(_checks, "interpreted", lambda: False)
    monkeypatch.setattr(_swapped, "runs_here", lambda: False)
    cfg = FragConfig(16, 128, 1, 1)
    assert "written for Hopper" in gemm_frag.why_not_supported(cfg, 16, 64, 256, FP8,
                                                                torch.bfloat16)
    wide = torch.zeros(64, 512).to(FP8)
    with pytest.raises(ValueError, match="pre-shuffled w must be contiguous"):
        gemm_frag.gemm_frag(torch.zeros(16, 256).to(FP8), wide[:, :256], w_tiled=True)


@pytest.mark.parametrize("family", ["a8w8", "a8w8_bpreshuffle"])
def test_fp8_tuners_offer_the_register_direct_kernel_for_decode_where_it_runs(family):
    """Both FP8 per-row families' tuners take triton.frag's configs for FP8 at M <= 64 on a Hopper
    GPU (row-major and pre-shuffled w); none for INT8, past M = 64, or without such a GPU; and
    triton.ring's on row-major w only (TMA reads rows)."""
    import importlib

    tuner_module = importlib.import_module(f"gemmtune.families.{family}.tuner")
    tuner_cls = next(v for k, v in vars(tuner_module).items()
                     if k.endswith("Tuner") and k != "GemmTuner")
    tuner = tuner_cls()

    def names(M, q, prefix):
        key = tuner.schema.key_type(M, 512, 1024, q)
        return [c.name for c in tuner.candidates(key, frozenset())
                if c.name.startswith(prefix + ":")]

    here = torch.cuda.is_available() and _swapped.runs_here()
    assert bool(names(16, "torch.float8_e4m3fn", "triton.frag")) == here
    assert bool(names(16, "torch.float8_e4m3fn", "triton.ring")) == (here and family == "a8w8")
    assert not names(16, "torch.int8", "triton.frag")
    assert not names(128, "torch.float8_e4m3fn", "triton.frag")


# --- GPU -----------------------------------------------------------------------------------


# (M, N, K, config): every block of x's rows (8-64, and several blocks past 64), steps of
# 128-256, 1-3 steps ahead, splits that divide the steps and that do not, N past a multiple of
# 64 (the last program's rows past N), PDL on and off.
GPU_CASES = [
    (1, 576, 7168, FragConfig(8, 256, 4, 1, 1)),
    (5, 1040, 2304, FragConfig(8, 128, 3, 1)),
    (16, 4096, 512, FragConfig(16, 128, 4, 3, 1)),
    (16, 1536, 7168, FragConfig(16, 256, 7, 1, 1)),
    (31, 256, 7168, FragConfig(32, 256, 28, 1)),
    (64, 7168, 2048, FragConfig(64, 256, 1, 1, 1)),
    (64, 1040, 4096, FragConfig(64, 128, 5, 2)),
    (100, 4096, 1024, FragConfig(64, 256, 2, 1)),
    (256, 528, 4096, FragConfig(32, 128, 3, 2)),
    (600, 512, 1024, FragConfig(64, 256, 2, 1, 1)),
    # splits added into one sum per tile (R1)
    (1, 576, 7168, FragConfig(8, 256, 4, 1, 1, 1)),
    (31, 256, 7168, FragConfig(32, 256, 28, 1, 0, 1)),
    (100, 4096, 1024, FragConfig(64, 256, 2, 1, 1, 1)),
    (5, 1040, 2304, FragConfig(8, 128, 3, 1, 0, 1)),  # N past a multiple of 64
    (64, 1040, 4096, FragConfig(64, 128, 5, 2, 0, 1)),
    (16, 576, 7168, FragConfig(16, 256, 28, 1, 1, 1)),  # a step a split
]


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, config", GPU_CASES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("layout", ["tensor", "token_channel", "token_tensor"])
@pytest.mark.parametrize("w_tiled", [False, True], ids=["row_major", "tiled"])
def test_gpu_matches_reference(M, N, K, config, layout, w_tiled):
    def gemm(xq, wq, bias, out_dtype, x_scale, w_scale, out):
        w = quant.shuffle_weight(wq) if w_tiled else wq
        return gemm_frag.gemm_frag(xq, w, bias, out_dtype, x_scale, w_scale, config, out=out,
                                   w_tiled=w_tiled)

    assert_fp8_decode_launches(gemm, M, N, K, layout, config.name, not config.add_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("N, pitch", [(1000, 2048), (77, 2048 + 128), (1000, 2048 + 4)])
def test_gpu_row_major_any_n_and_row_pitch(N, pitch):
    """Row-major w: N not a multiple of 16 or 64, rows a wider pitch apart (16-byte aligned,
    read in place; not, copied first)."""
    M, K = 16, 2048
    gen = generator(N + pitch)
    xq, wq, x_scale, w_scale = quantised_operands(M, N, K, FP8, "token_channel", gen)
    wide = torch.zeros(N, pitch, device=DEVICE).to(FP8)
    wide[:, :K] = wq
    y = gemm_frag.gemm_frag(xq, wide[:, :K], None, torch.bfloat16, x_scale, w_scale,
                            FragConfig(16, 128, 3, 2), out=poisoned(M, N, torch.bfloat16))
    check_fp8_decode(y, xq, wq, x_scale, w_scale, None, f"N={N} pitch={pitch}")


@pytest.mark.gpu
def test_gpu_strided_x_and_output():
    """x with a row pitch wider than K, and an output that is a slice of a wider one."""
    M, N, K = 16, 1024, 2048
    gen = generator(3)
    xq, wq, x_scale, w_scale = quantised_operands(M, N, K, FP8, "token_channel", gen)
    wide_x = torch.zeros(M, K + 64, device=DEVICE).to(FP8)
    wide_x[:, :K] = xq
    wide_out = torch.full((M, N + 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    y = gemm_frag.gemm_frag(wide_x[:, :K], quant.shuffle_weight(wq), None, torch.bfloat16,
                            x_scale, w_scale, FragConfig(16, 256, 2, 1), out=wide_out[:, :N],
                            w_tiled=True)
    check_fp8_decode(y, xq, wq, x_scale, w_scale, None, "strided")
    assert torch.isnan(wide_out[:, N:]).all()


@pytest.mark.gpu
def test_gpu_long_k_is_as_precise_as_cublas():
    """Each step's MMA starts from zero and is added in fp32, so over K = 25600 in one split
    the error stays near cuBLAS's (which promotes its FP8 sums) rather than 10-30x it, as
    unpromoted FP8 wgmma sums were (docs/benchmarks.md, session 18)."""
    assert_long_k_as_precise_as_cublas(
        lambda xq, wq, x_scale, w_scale: gemm_frag.gemm_frag(
            xq, wq, None, torch.float32, x_scale, w_scale, FragConfig(16, 256, 1, 1)))


# (M, N, K, config) with block scales: steps of 128, N past a block of 128 rows, splits that do
# and do not divide the steps, 1-3 steps ahead, several blocks of x.
BLOCK_SCALED_CASES = [
    (1, 576, 7168, FragConfig(8, 128, 4, 2, 1)),
    (5, 1040, 2304, FragConfig(8, 128, 3, 3)),
    (16, 4096, 512, FragConfig(16, 128, 1, 1, 1)),
    (33, 256, 7168, FragConfig(64, 128, 28, 2)),
    (100, 1040, 1024, FragConfig(64, 128, 3, 1)),
    (16, 1536, 7168, FragConfig(16, 128, 14, 2, 1, 1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("M, N, K, config", BLOCK_SCALED_CASES,
                         ids=lambda v: getattr(v, "name", v))
def test_gpu_block_scales_match_the_dequantised_reference(M, N, K, config):
    def gemm(xq, wq, bias, out_dtype, x_scale, w_scale, out):
        return gemm_frag.gemm_frag(xq, wq, bias, out_dtype, x_scale, w_scale, config, out=out,
                                   block_scales=True)

    assert_block_scaled_decode_launches(gemm, M, N, K, config.name, not config.add_splits)

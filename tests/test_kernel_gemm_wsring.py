"""The warp-specialised TMA-ring Gluon kernel (``triton.wsring``) of FP8 GEMMs at 16 <= M <= 256.

Gluon kernels do not run in Triton's interpreter: on the CPU its config space and refusals are
checked here and its sm_90 code in tests/test_kernels_compile_for_hopper.py; the ``gpu`` tests
check tiles, slots and splits against the fp32 reference at ragged sizes, with every scale
layout and FP8 block scales, bias and output dtypes, NaN-poisoned outputs, and repeat launches
bitwise; fast accumulation (per-row and per-tensor scales) within what cuBLAS's fast
accumulation errs, and less precise than the promoted sum at long K.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gemm_checks
from gemm_checks import (assert_block_scaled_decode_launches, assert_fp8_decode_launches,
                         block_scaled_operands, check_block_scaled_decode, fast_accumulated_scaled,
                         generator, poisoned, quantised_operands)
from gemmtune.kernels.triton import _swapped, gemm_wsring
from gemmtune.kernels.triton.gemm_wsring import WsRingConfig

FP8 = torch.float8_e4m3fn
# Every GPU case runs in a few seconds; one that hangs (a ring's waits that never complete)
# fails here instead of stalling the run.
GPU_TIMEOUT = pytest.mark.timeout(60)


def test_names_round_trip():
    cfg = WsRingConfig(128, 64, 4, 2)
    assert cfg.name == "triton.wsring:BM128.BN64.S4.SK2"
    assert WsRingConfig.from_name(cfg.name) == cfg
    added = WsRingConfig(64, 128, 3, 8, 1)
    assert added.name == "triton.wsring:BM64.BN128.S3.SK8.R1"
    assert WsRingConfig.from_name(added.name) == added
    two = WsRingConfig(64, 64, 6, 3, 0, 2)
    assert two.name == "triton.wsring:BM64.BN64.S6.SK3.R0.O2"
    assert WsRingConfig.from_name(two.name) == two
    pdl = WsRingConfig(128, 128, 4, 1, 0, 1, 1)
    assert pdl.name == "triton.wsring:BM128.BN128.S4.SK1.R0.O1.P1"
    assert WsRingConfig.from_name(pdl.name) == pdl
    ahead = WsRingConfig(64, 64, 4, 2, 1, 1, 1, w_ahead=1)
    assert ahead.name == "triton.wsring:BM64.BN64.S4.SK2.R1.O1.P1.L0.G0.F0.K0.A1"
    assert WsRingConfig.from_name(ahead.name) == ahead
    looped = WsRingConfig(128, 128, 4, 1, 0, 1, 0, 1)
    assert looped.name == "triton.wsring:BM128.BN128.S4.SK1.R0.O1.P0.L1"
    assert WsRingConfig.from_name(looped.name) == looped
    m_first = WsRingConfig(64, 128, 4, 2, 1, 1, 1, 0, 1)
    assert m_first.name == "triton.wsring:BM64.BN128.S4.SK2.R1.O1.P1.L0.G1"
    assert WsRingConfig.from_name(m_first.name) == m_first
    fast = WsRingConfig(64, 128, 4, 2, fast_accumulation=1)
    assert fast.name == "triton.wsring:BM64.BN128.S4.SK2.R0.O1.P0.L0.G0.F1"
    assert WsRingConfig.from_name(fast.name) == fast
    streamed = WsRingConfig(64, 64, 4, 1, 0, 2, 1, 1, stream_k=1)
    assert streamed.name == "triton.wsring:BM64.BN64.S4.SK1.R0.O2.P1.L1.G0.F0.K1"
    assert WsRingConfig.from_name(streamed.name) == streamed
    assert WsRingConfig.from_name("triton.wsring:BM64.BN128.S4.SK2").fast_accumulation == 0


def test_fast_accumulation_twins_and_refusals():
    """A fast twin where a split sums two or more steps of K (with one the two kernels are the
    same); block scales refuse it, saying why, and take the promoted config. Stream-K takes
    persistent, unsplit configs only."""
    promoted = WsRingConfig(128, 128, 4, 4, 1, 1, 1)
    twin = gemm_wsring.fast_twin(promoted, 4096)  # 32 steps, 8 a split
    assert twin == dataclasses.replace(promoted, fast_accumulation=1)
    assert gemm_wsring.fast_twin(twin, 4096) is None
    assert gemm_wsring.fast_twin(WsRingConfig(64, 64, 2, 2), 512) is not None  # 2 a split
    assert gemm_wsring.fast_twin(WsRingConfig(64, 64, 2, 4), 512) is None  # 1 a split
    assert gemm_wsring.fast_twin(WsRingConfig(64, 64, 2, 1), 128) is None  # 1 step
    assert "block scales" in gemm_wsring.why_not_block_scaled(twin, FP8)
    assert gemm_wsring.why_not_block_scaled(promoted, FP8) is None
    assert "must be 0" in gemm_wsring.why_not_fits(
        dataclasses.replace(promoted, fast_accumulation=2), 128, 4096, 4096, FP8)
    # Stream-K: persistent and unsplit only.
    for bad in (WsRingConfig(64, 64, 4, 1, stream_k=1), WsRingConfig(64, 64, 4, 2, 1, 1, 0, 1,
                                                                        stream_k=1)):
        assert "stream_k=1 takes persistent programs" in gemm_wsring.why_not_fits(
            bad, 128, 4096, 4096, FP8)
    # The launch-only path (a dispatch plan's, no config checks) refuses the pair too.
    x, w = torch.zeros(128, 4096).to(FP8), torch.zeros(256, 4096).to(FP8)
    with pytest.raises(ValueError, match="fast_accumulation=1 sums the K steps"):
        gemm_wsring.wsring_call(x, w, None, torch.empty(128, 256), torch.ones(128, 32),
                                torch.ones(2, 32), twin, block_scales=True)


def test_registers_share_an_sm():
    """A program's threads (the math warps and the producer's warpgroup) times their registers
    fit an SM's 64K as many times as programs it is to hold."""
    for cfg in (WsRingConfig(128, 128, 4, 1), WsRingConfig(64, 64, 4, 1),
                WsRingConfig(64, 64, 4, 1, 0, 2)):
        regs = gemm_wsring.max_registers(cfg)
        assert regs % 8 == 0 and regs * cfg.threads * cfg.per_sm <= 65536, cfg.name
    assert gemm_wsring.max_registers(WsRingConfig(128, 128, 4, 1)) == 168  # 384 threads
    assert gemm_wsring.max_registers(WsRingConfig(64, 64, 4, 1, 0, 2)) == 128  # 2 x 256


@pytest.mark.parametrize("config, M, N, K, dtype, says", [
    (WsRingConfig(128, 128, 4, 2), 128, 4096, 4096, torch.int8, "float8_e4m3fn only"),
    (WsRingConfig(128, 128, 4, 2), 128, 4096, 4104, FP8, "not a multiple of 16"),
    (WsRingConfig(128, 128, 4, 40), 128, 4096, 16384, FP8, "split_k=40 must be in"),
    (WsRingConfig(128, 128, 4, 8), 128, 4096, 512, FP8, "4 steps of block_k=128"),
    (WsRingConfig(96, 128, 4, 1), 128, 4096, 4096, FP8, "block_m=96 must be one of"),
    (WsRingConfig(128, 256, 2, 1), 128, 4096, 4096, FP8, "block_n=256 must be one of"),
    (WsRingConfig(128, 128, 1, 1), 128, 4096, 4096, FP8, "stages=1 must be >= 2"),
    (WsRingConfig(128, 128, 8, 1), 128, 4096, 4096, FP8, "use fewer stages"),
    (WsRingConfig(64, 64, 8, 1, 0, 2), 128, 4096, 4096, FP8, "use fewer stages"),
    (WsRingConfig(128, 64, 3, 1, 0, 2), 128, 4096, 4096, FP8, "takes the 64 x 64 tile only"),
    (WsRingConfig(64, 64, 3, 1, 0, 3), 128, 4096, 4096, FP8, "per_sm=3 must be 1 or 2"),
    (WsRingConfig(64, 64, 3, 1, 0, 1, 2), 128, 4096, 4096, FP8, "pdl=2 must be"),
    (WsRingConfig(64, 64, 3, 1, w_ahead=1), 128, 4096, 4096, FP8, "which takes PDL (P1)"),
    (WsRingConfig(64, 64, 3, 1, 0, 1, 1, 1, w_ahead=2), 128, 4096, 4096, FP8, "a program a unit"),
    (WsRingConfig(64, 64, 3, 1, 0, 1, 1, w_ahead=3), 128, 4096, 4096, FP8, "w_ahead=3"),
    (WsRingConfig(64, 64, 3, 1, 0, 1, 0, 2), 128, 4096, 4096, FP8, "persistent=2 must be"),
    (WsRingConfig(64, 64, 3, 1, 0, 1, 0, 0, 2), 128, 4096, 4096, FP8, "m_first=2 must be"),
    (WsRingConfig(64, 64, 3, 1, 0, 1, 0, 0, 1), 128, 64 * 65536, 4096, FP8, "third axis"),
    # persistent: the end's fp32 tile beside the ring (which holds the next unit's steps)
    (WsRingConfig(128, 128, 6, 1, 0, 1, 0, 1), 128, 4096, 4096, FP8, "use fewer stages"),
    (WsRingConfig(64, 64, 2, 1), 128, 4096, 0, FP8, "K=0"),
    (WsRingConfig(128, 128, 4, 1, 1), 128, 4096, 4096, FP8, "add_splits=1 needs split_k > 1"),
])
def test_configs_that_cannot_run_say_why(config, M, N, K, dtype, says):
    assert says in gemm_wsring.why_not_fits(config, M, N, K, dtype)


@pytest.mark.parametrize("M, N, K", [(65, 576, 7168), (128, 4096, 4096), (200, 1040, 2320),
                                     (256, 151936, 5120), (256, 7168, 256), (64, 4096, 4096),
                                     (16, 4096, 4096), (15, 4096, 4096), (300, 4096, 4096),
                                     (16, 4096, 512), (32, 3072, 1536), (64, 3072, 1536)])
def test_candidates_and_default_fit(M, N, K):
    plain = gemm_wsring.candidates(M, N, K, FP8, num_sms=132)
    found = gemm_wsring.candidates(M, N, K, FP8, num_sms=132, pdl=1)
    # With PDL asked for: every config of a program a unit both ways, with PDL loading w's
    # first slots before the wait and releasing the next kernel at the start (w_ahead 1);
    # persistent ones (whose setup is paid once) with PDL alone, waiting first.
    assert {(c.pdl, c.w_ahead) for c in plain} <= {(0, 0)}
    assert {dataclasses.replace(c, pdl=0, w_ahead=0) for c in found} == set(plain)
    assert ({c for c in found if not c.persistent and c.pdl} ==
            {dataclasses.replace(c, pdl=1, w_ahead=gemm_wsring.W_AHEAD_START)
             for c in plain if not c.persistent})
    assert all(c.w_ahead == 0 for c in found if c.persistent)
    assert bool(found) == (gemm_wsring.MIN_M <= M <= gemm_wsring.MAX_M), (M, N, K)
    if not found:
        return
    # Every tile (128 rows of x past 64 only; 16 and 32 rows of w up to 32 rows of x where
    # they make one wave over a short K, unsplit and a program a tile), and each split config
    # both ways: its partials summed in order and added.
    assert {(c.block_m, c.block_n) for c in found} == {
        (m, n) for m in gemm_wsring.BLOCK_MS for n in gemm_wsring.BLOCK_NS
        if (m == 64 or M > 64) and (n not in gemm_wsring.NARROW_NS or (
            M <= 32 and -(-N // n) <= 132 and -(-K // 128) <= gemm_wsring.NARROW_MAX_STEPS))}
    assert all(c.split_k == 1 and not c.persistent
               for c in found if c.block_n in gemm_wsring.NARROW_NS)
    split = {dataclasses.replace(c, add_splits=0) for c in found if c.split_k > 1}
    assert {dataclasses.replace(c, add_splits=1) for c in split} <= set(found)
    for cfg in found:
        assert gemm_wsring.fits(cfg, M, N, K, FP8), cfg.name
        # Each program's block reserves 1 KiB of the SM's 228 beside its own.
        assert (gemm_wsring.smem_bytes(cfg) + 1024) * cfg.per_sm <= 228 * 1024
    # Two programs an SM: the 64 x 64 tile's alone (the registers of the others hold one).
    assert {(c.block_m, c.block_n) for c in found if c.per_sm == 2} <= {(64, 64)}
    # Persistent programs: the deepest ring that its programs an SM hold beside the end's fp32
    # tile (the ring runs on across units), PDL, and beside a program a unit of the same tile
    # and split.
    for c in (c for c in found if c.persistent and not c.stream_k):
        deeper = [s for s in gemm_wsring._STAGES if s > c.stages]
        assert c.stages in gemm_wsring._STAGES and c.pdl == 1, c.name
        assert not any(gemm_wsring.smem_fits(dataclasses.replace(c, stages=s))
                       for s in deeper), c.name
        assert any(not o.persistent and (o.block_m, o.block_n, o.split_k, o.per_sm) ==
                   (c.block_m, c.block_n, c.split_k, c.per_sm) for o in found), c.name
    # Stream-K lost everywhere it was timed: not offered. By name (``streamed_configs``):
    # persistent, unsplit, 4 slots, PDL, each launch order, both programs an SM for the 64 x 64
    # tile.
    assert not any(c.stream_k for c in found)
    for bm, bn in {(c.block_m, c.block_n) for c in found}:
        streamed = list(gemm_wsring.streamed_configs(bm, bn, True, 1))
        assert all((c.persistent, c.split_k, c.add_splits, c.stages, c.pdl, c.stream_k) ==
                   (1, 1, 0, 4, 1, 1) for c in streamed)
        assert {(c.per_sm, c.m_first) for c in streamed} == {
            (n, first) for n in ((1, 2) if (bm, bn) == (64, 64) else (1,)) for first in (0, 1)}
    # x's blocks first beside w's wherever M takes several blocks of x, and only there.
    several = {c for c in found if -(-M // c.block_m) > 1}
    assert {c for c in found if c.m_first} == {dataclasses.replace(c, m_first=1)
                                               for c in several if not c.m_first}
    assert len({c.name for c in found}) == len(found)
    assert gemm_wsring.fits(gemm_wsring.default_config(M, N, K, FP8, num_sms=132), M, N, K, FP8)


def test_refuses_the_interpreter_and_other_gpus(monkeypatch):
    """It says what to use instead: in the interpreter and off Hopper."""
    from gemmtune.kernels.triton import _checks

    cfg = WsRingConfig(128, 128, 4, 1)
    monkeypatch.setattr(_checks, "interpreted", lambda: True)
    assert "interpreter" in gemm_wsring.why_not_supported(cfg, 128, 64, 256, FP8,
                                                          torch.bfloat16)
    with pytest.raises(ValueError, match="interpreter"):
        gemm_wsring.gemm_wsring(torch.zeros(128, 256).to(FP8), torch.zeros(64, 256).to(FP8))
    monkeypatch.setattr(_checks, "interpreted", lambda: False)
    monkeypatch.setattr(_swapped, "runs_here", lambda: False)
    assert "written for Hopper" in gemm_wsring.why_not_supported(cfg, 128, 64, 256, FP8,
                                                                  torch.bfloat16)


def test_registries_that_take_it(monkeypatch):
    """The block-scale and FP8 per-row families run it (as on a Hopper, faked); the pre-shuffled
    family (w in tiles, not rows) and bf16 (not FP8) refuse it, saying why."""
    from gemmtune.dispatch import KernelNameError
    from gemmtune.families.a8w8.op import REGISTRY as A8W8
    from gemmtune.families.a8w8_blockscale.op import REGISTRY as BLOCKSCALE
    from gemmtune.families.a8w8_bpreshuffle.op import REGISTRY as SHUFFLED
    from gemmtune.families.bf16.op import REGISTRY as BF16
    from gemmtune.kernels.problem import GemmProblem, Scaling

    monkeypatch.setattr(gemm_wsring, "why_not_here", lambda kernel, instead: None)
    name = WsRingConfig(128, 128, 4, 4).name
    blocked = GemmProblem(128, 1536, 7168, FP8, torch.bfloat16, scaling=Scaling.block)
    rowwise = GemmProblem(128, 1536, 7168, FP8, torch.bfloat16, scaling=Scaling.rowwise)
    assert BLOCKSCALE.can_run(name, blocked)
    assert A8W8.can_run(name, rowwise)
    # Fast accumulation: per-row scales only; block scales refuse it, saying why.
    fast = WsRingConfig(128, 128, 4, 4, fast_accumulation=1).name
    assert A8W8.can_run(fast, rowwise) and not BLOCKSCALE.can_run(fast, blocked)
    with pytest.raises(KernelNameError, match="fast_accumulation=1 sums the K steps"):
        BLOCKSCALE.resolve_for(fast, blocked)
    with pytest.raises(KernelNameError, match="triton.wsring"):
        SHUFFLED.resolve_for(name, dataclasses.replace(rowwise, preshuffled=True))
    with pytest.raises(KernelNameError, match="float8_e4m3fn only"):
        BF16.resolve_for(name, GemmProblem(128, 1536, 7168, torch.bfloat16, torch.bfloat16))


def test_tuners_offer_it_from_min_m_rows_where_it_runs(monkeypatch):
    """On a Hopper (faked) the block-scale tuner's Gluon candidates include its configs for
    MIN_M <= M <= MAX_M and none below or above."""
    from gemmtune.families._gemm_tuner import gluon_candidates
    from gemmtune.families.a8w8_blockscale.op import REGISTRY as BLOCKSCALE
    from gemmtune.kernels.problem import GemmProblem, Scaling
    from gemmtune.kernels.triton import _checks, _splits, gemm_frag, gemm_ring

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_checks, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(_splits, "pdl_where_supported", lambda: 0)
    for module in (gemm_frag, gemm_ring, gemm_wsring):
        monkeypatch.setattr(module, "why_not_here", lambda *args: None)

    def names(M):
        problem = GemmProblem(M, 4096, 4096, FP8, torch.bfloat16, scaling=Scaling.block)
        return [c.name for c in gluon_candidates(problem, BLOCKSCALE)
                if c.name.startswith(gemm_wsring.KERNEL_PREFIX + ":")]

    assert names(128) and names(256) and names(gemm_wsring.MIN_M)
    assert set(names(128)) == {c.name for c in gemm_wsring.candidates(128, 4096, 4096, FP8, 132)}
    assert not names(gemm_wsring.MIN_M - 1) and not names(gemm_wsring.MAX_M + 1)


def test_a8w8_tuner_runs_fast_twins_marked_as_split_k_fast_configs(monkeypatch):
    """Per-row scales (a8w8): each config whose splits sum two or more steps beside its fast
    twin, marked as split-K's fast configs (FAST_FP8_SIMPLICITY: a tie within the noise does
    not keep it); block scales: none."""
    from gemmtune.families._gemm_tuner import FAST_FP8_SIMPLICITY, gluon_candidates
    from gemmtune.families.a8w8.op import REGISTRY as A8W8
    from gemmtune.families.a8w8_blockscale.op import REGISTRY as BLOCKSCALE
    from gemmtune.kernels.problem import GemmProblem, Scaling
    from gemmtune.kernels.triton import _checks, _splits, gemm_frag, gemm_ring

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_checks, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(_splits, "pdl_where_supported", lambda: 0)
    for module in (gemm_frag, gemm_ring, gemm_wsring):
        monkeypatch.setattr(module, "why_not_here", lambda *args: None)

    def wsring(registry, scaling):
        problem = GemmProblem(128, 4096, 4096, FP8, torch.bfloat16, scaling=scaling)
        return {c.name: c for c in gluon_candidates(problem, registry)
                if c.name.startswith(gemm_wsring.KERNEL_PREFIX + ":")}

    rowwise = wsring(A8W8, Scaling.rowwise)
    fast = {n: c for n, c in rowwise.items() if WsRingConfig.from_name(n).fast_accumulation}
    promoted = gemm_wsring.candidates(128, 4096, 4096, FP8, 132)
    assert set(rowwise) - set(fast) == {c.name for c in promoted}
    assert set(fast) == {t.name for t in map(lambda c: gemm_wsring.fast_twin(c, 4096), promoted)
                         if t is not None}
    assert fast and all(c.simplicity == FAST_FP8_SIMPLICITY for c in fast.values())
    assert not any(WsRingConfig.from_name(n).fast_accumulation
                   for n in wsring(BLOCKSCALE, Scaling.block))


@pytest.mark.parametrize("M, N, K, persistent", [
    (256, 28672, 4096, {(64, 64), (64, 128), (128, 64), (128, 128)}),  # more tiles than SMs
    # 2 steps: still the deepest ring (it runs on across units)
    (256, 7168, 256, {(64, 64), (64, 128), (128, 64), (128, 128)}),
    (64, 512, 256, set()),  # 16 units at most: all fit at once
])
def test_persistent_where_units_outnumber_the_programs(M, N, K, persistent):
    found = gemm_wsring.candidates(M, N, K, FP8, num_sms=132, pdl=1)
    assert {(c.block_m, c.block_n) for c in found if c.persistent and not c.stream_k} == \
        persistent


def test_splits_from_above_and_below_the_programs_per_sm():
    """24 tiles of 56 steps on 132 SMs: a split of 6 (144 programs) spills 12 into a second
    wave, so 5 (120) is offered too; at two an SM 11 gives 264 exactly. The below one is
    offered with the rings that fit (4 and 6 slots of 128 x 128) and the PDL mode asked for
    only."""
    from gemmtune.kernels.triton._splits import WaveSplit, splits_around

    assert splits_around(24, 56, 132, (1, 2)) == [WaveSplit(1, 6, True), WaveSplit(1, 5, False),
                                                  WaveSplit(2, 11, True)]
    # More tiles than programs: no split from either side; the split's cap holds both.
    assert splits_around(448, 32, 132, (1, 2)) == [WaveSplit(1, 1, True), WaveSplit(2, 1, True)]
    assert splits_around(4, 56, 132, (1,), 16) == [WaveSplit(1, 16, True)]
    found = gemm_wsring.candidates(256, 1536, 7168, FP8, num_sms=132, pdl=1)
    below = {c for c in found if (c.block_m, c.block_n, c.split_k) == (128, 128, 5)}
    assert below and all(c.pdl == 1 for c in below)
    assert {c.stages for c in below} == {4, 6}
    assert {c.split_k for c in found
            if (c.block_m, c.block_n) == (128, 128) and not c.stream_k} == {5, 6, 11}
    # A split from below of fewer steps than slots: its deepest ring is its steps.
    found = gemm_wsring.candidates(64, 7168, 256, FP8, num_sms=132, pdl=1)
    assert {(c.stages, c.pdl) for c in found
            if (c.block_m, c.block_n, c.split_k, c.persistent) == (64, 64, 1, 0)} == {(2, 1)}


def test_narrow_tiles_where_one_wave_streams_a_short_k():
    """16 and 32 rows of w up to 32 rows of x where their tiles make one wave and K is at most
    NARROW_MAX_STEPS steps: at 16 x 4096 x 512 the 32-row tiles make 128 programs of 4 steps,
    unsplit, a program a tile (4 slots: the steps use no more; both launch modes); not the
    16-row ones (256 tiles), nor at a longer K, more tiles than SMs, or M = 64."""
    found = gemm_wsring.candidates(16, 4096, 512, FP8, num_sms=132, pdl=1)
    narrow = {(c.block_n, c.split_k, c.stages, c.persistent, c.pdl) for c in found
              if c.block_n in gemm_wsring.NARROW_NS}
    assert narrow == {(32, 1, 4, 0, 0), (32, 1, 4, 0, 1)}
    # 32 steps, the most offered: the 32-row tiles, with each ring depth
    assert {(c.block_n, c.split_k, c.stages) for c in gemm_wsring.candidates(
        16, 4096, 4096, FP8, num_sms=132) if c.block_n in gemm_wsring.NARROW_NS} == {
        (32, 1, 4), (32, 1, 6), (32, 1, 8)}
    assert {c.block_n for c in gemm_wsring.candidates(32, 3072, 1536, FP8, num_sms=132)
            if c.block_n in gemm_wsring.NARROW_NS} == {32}  # 16 rows: 192 tiles
    for M, N, K in ((16, 4096, 4224), (16, 4256, 512), (64, 4096, 512)):
        assert not any(c.block_n in gemm_wsring.NARROW_NS
                       for c in gemm_wsring.candidates(M, N, K, FP8, num_sms=132, pdl=1))


@pytest.mark.parametrize("M, block_m, rows", [
    (1, 64, 16), (16, 64, 16), (17, 64, 32), (32, 64, 32), (33, 64, 64), (64, 64, 64),
    (200, 64, 64), (40, 128, 64), (100, 128, 128), (256, 128, 128)])
def test_x_loads_bring_the_rows_m_fills(M, block_m, rows):
    """Where M is under the MMA's rows a load brings the fewest rows (a power of two, at
    least 16) holding M, so TMA fills no more zeros than that."""
    assert gemm_wsring.x_box_rows(M, block_m) == rows


@pytest.mark.parametrize("M, rows", [(16, 16), (20, 32), (64, 64)])
def test_the_launch_takes_x_in_boxes_of_those_rows(M, rows):
    """The launch's TMA descriptor of x has boxes of ``x_box_rows`` rows (w's of the tile's)."""
    x = torch.zeros(M, 1024, dtype=FP8)
    w = torch.zeros(512, 1024, dtype=FP8)
    out = torch.empty(M, 512, dtype=torch.bfloat16)
    call = gemm_wsring.wsring_call(x, w, None, out, torch.ones(1), torch.ones(1),
                                   WsRingConfig(64, 32, 8, 1))
    w_desc, x_desc = call.args[:2]
    assert (list(x_desc.block_shape), list(w_desc.block_shape)) == ([rows, 128], [32, 128])


# --- GPU -----------------------------------------------------------------------------------

# (M, N, K, config): one and two math warpgroups, 64 and 128 rows of w; M, N and K past whole
# tiles and steps (TMA's zero fill), rings longer than a split's steps, splits that divide the
# steps and that do not, summed in order and added.
GPU_CASES = [
    (65, 576, 7168, WsRingConfig(128, 64, 4, 8)),
    (100, 1040, 2320, WsRingConfig(64, 128, 3, 3)),
    (128, 4096, 4096, WsRingConfig(128, 128, 4, 4)),
    (200, 256, 7168, WsRingConfig(128, 128, 5, 28)),
    (256, 1040, 1040, WsRingConfig(64, 64, 6, 1)),
    (129, 4096, 512, WsRingConfig(128, 64, 6, 1)),
    (256, 4096, 4096, WsRingConfig(64, 64, 6, 3, 0, 2)),
    (160, 1280, 2048, WsRingConfig(128, 128, 4, 3, 1, 1, 1)),
    # splits of 1-2 steps on 2 slots (a shipped H200 row's config), 1 step a split, 3 steps
    (128, 256, 7168, WsRingConfig(64, 64, 2, 32, 1, 2, 1)),
    (128, 512, 384, WsRingConfig(128, 128, 2, 3)),
    (200, 1040, 384, WsRingConfig(64, 128, 2, 1)),
    # persistent programs (not yet run on a GPU): more units than programs (each program
    # several, the ring's positions running on across them), fewer; splits added, in order
    (256, 16384, 512, WsRingConfig(128, 128, 4, 1, 0, 1, 0, 1)),
    (200, 1040, 2320, WsRingConfig(64, 64, 4, 3, 1, 2, 1, 1)),
    (130, 4096, 1040, WsRingConfig(128, 64, 3, 3, 0, 1, 0, 1)),
    # x's blocks first: a program a unit (M in 4 and 2 blocks, split), and looping
    (256, 4096, 2048, WsRingConfig(64, 128, 4, 2, 1, 1, 1, 0, 1)),
    (200, 1040, 1040, WsRingConfig(128, 64, 4, 1, 0, 1, 0, 0, 1)),
    (256, 16384, 512, WsRingConfig(64, 64, 4, 1, 0, 2, 0, 1, 1)),
    (65, 576, 7168, WsRingConfig(128, 64, 4, 8, 1)),
    (200, 256, 7168, WsRingConfig(128, 128, 5, 28, 1)),
    (100, 1040, 2320, WsRingConfig(64, 128, 3, 3, 1)),
    # stream-K: parts of tiles across programs (runs of 15.5, 2.6 and 1.9 steps of tiles of 32,
    # 19 and 56), x's blocks first, two programs an SM
    (256, 4096, 4096, WsRingConfig(128, 128, 4, 1, 0, 1, 1, 1, stream_k=1)),
    (100, 1040, 2320, WsRingConfig(64, 128, 4, 1, 0, 1, 0, 1, 1, stream_k=1)),
    (33, 576, 7168, WsRingConfig(64, 64, 4, 1, 0, 2, 1, 1, stream_k=1)),
    # runs of 7.75 steps of 4-step tiles: parts, whole tiles, parts
    (256, 16384, 512, WsRingConfig(128, 128, 4, 1, 0, 1, 0, 1, stream_k=1)),
    # 8-slot rings: around more than twice (19 steps), 9 steps on 8, persistent, two warpgroups
    (100, 1040, 2320, WsRingConfig(64, 64, 8, 1)),
    (130, 4096, 1040, WsRingConfig(128, 64, 8, 1, 0, 1, 1)),
    (200, 1040, 2320, WsRingConfig(64, 128, 8, 3, 1, 1, 1, 1)),
    # persistent, two an SM, 6 slots: the most shared memory two programs hold
    (200, 4096, 2320, WsRingConfig(64, 64, 6, 1, 0, 2, 1, 1)),
    # 16 and 32 rows of w (ragged N): unsplit, split added and in order
    (16, 1000, 2320, WsRingConfig(64, 16, 8, 1)),
    (33, 4096, 1040, WsRingConfig(64, 32, 6, 2, 1)),
    (64, 1040, 2320, WsRingConfig(64, 32, 8, 3, 0, 1, 1)),
    # fewer rows of x than the MMA's 64: loads of 16 and 32 rows (x_box_rows), the slots' other
    # rows zeroed; 33 rows load all 64 (TMA's zeros below them): split, added, persistent
    (16, 1040, 2320, WsRingConfig(64, 128, 3, 3)),
    (33, 576, 7168, WsRingConfig(64, 64, 4, 8, 1)),
    (1, 4096, 1040, WsRingConfig(64, 64, 4, 1, 0, 2, 1, 1)),
    (20, 1040, 2320, WsRingConfig(64, 64, 8, 1)),
    (16, 4096, 2320, WsRingConfig(64, 64, 6, 1, 0, 2, 1, 1)),
    (32, 1040, 1040, WsRingConfig(64, 32, 8, 3, 1)),
    # 128 rows of x, 40 of them loaded (64 a load); stream-K at 20 rows
    (40, 1040, 1040, WsRingConfig(128, 64, 4, 2)),
    (20, 1040, 2320, WsRingConfig(64, 64, 4, 1, 0, 2, 1, 1, stream_k=1)),
    # PDL with w's first slots before the wait (the next kernel released at the start, A1,
    # or after the loop, A2): split and added (fewer steps than slots), x's blocks first, 16
    # rows of x a load
    (33, 576, 7168, WsRingConfig(64, 64, 8, 8, 1, 1, 1, w_ahead=1)),
    (200, 1040, 2320, WsRingConfig(128, 64, 8, 3, 0, 1, 1, 0, 1, w_ahead=2)),
    (16, 1040, 2320, WsRingConfig(64, 64, 6, 1, 0, 2, 1, w_ahead=1)),
]


def _reproducible(config: WsRingConfig) -> bool:
    """Whether a second launch must give the same bits: not where parts of a tile are added in
    their arrival order (added splits, stream-K)."""
    return not (config.add_splits or config.stream_k)


@pytest.mark.gpu
@GPU_TIMEOUT
@pytest.mark.parametrize("M, N, K, config", GPU_CASES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("layout", ["tensor", "token_channel"])
def test_gpu_matches_reference(M, N, K, config, layout):
    def gemm(xq, wq, bias, out_dtype, x_scale, w_scale, out):
        return gemm_wsring.gemm_wsring(xq, wq, bias, out_dtype, x_scale, w_scale, config,
                                       out=out)

    assert_fp8_decode_launches(gemm, M, N, K, layout, config.name, _reproducible(config))


@pytest.mark.gpu
@GPU_TIMEOUT
@pytest.mark.parametrize("M, N, K, config", GPU_CASES, ids=lambda v: getattr(v, "name", v))
def test_gpu_block_scales_match_the_dequantised_reference(M, N, K, config):
    def gemm(xq, wq, bias, out_dtype, x_scale, w_scale, out):
        return gemm_wsring.gemm_wsring(xq, wq, bias, out_dtype, x_scale, w_scale, config,
                                       out=out, block_scales=True)

    assert_block_scaled_decode_launches(gemm, M, N, K, config.name, _reproducible(config))


@pytest.mark.gpu
@GPU_TIMEOUT
@pytest.mark.parametrize("M, config, block_scales", [
    # w's first slots before the wait, the next kernel released at the start or after the
    # loop: 16 rows a load, split; more slots than a split's steps, added; per-token scales
    # (the end's)
    (16, WsRingConfig(64, 64, 4, 2, pdl=1, w_ahead=1), True),
    (16, WsRingConfig(64, 64, 4, 2, pdl=1, w_ahead=2), True),
    (48, WsRingConfig(64, 32, 8, 4, 1, pdl=1, w_ahead=1), True),
    (64, WsRingConfig(64, 128, 3, 1, pdl=1, w_ahead=2), False),
    # waiting before any load: a program a unit, and persistent
    (16, WsRingConfig(64, 64, 4, 2, pdl=1), True),
    (40, WsRingConfig(64, 64, 4, 2, 0, 2, 1, 1), True),
], ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_pdl_chain_reads_its_input_after_the_producer(M, config, block_scales, graph):
    """Each GEMM's x and x's scales quantised from the previous one's output and written into
    their buffers (poisoned) by two kernels in turn, the second letting the GEMM start ~20 us
    before it writes (it waits for the first): x last on every other link, its scales last on
    the others. With PDL only w may load before the wait (``w_ahead``: the producer's first
    slots): x after the producer's wait, x's block scales after the math warps' (per-token
    scales are read at the end, after x, so there only x's order is checked)."""
    def launch(x, w, bias, out, scale_a, scale_b, config):
        return gemm_wsring.launch_gemm_wsring(x, w, bias, out, scale_a, scale_b, config,
                                              block_scales=block_scales)

    gemm_checks.pdl_chain_reads_its_input_after_the_producer(
        launch, config, M, 2048, graph, 70 + M,
        weight=gemm_checks.fp8_chain_weight(block_scales, config.name),
        between=gemm_checks.fp8_quantised_late(block_scales, scales_late=True))


# Fast accumulation: one and two warpgroups, split (in order and added) and not, two programs
# an SM with PDL, persistent, x's blocks first, fewer rows of x than the MMA's.
FAST_GPU_CASES = [
    (128, 4096, 4096, WsRingConfig(128, 128, 4, 4, fast_accumulation=1)),
    (100, 1040, 2320, WsRingConfig(64, 128, 3, 3, 1, fast_accumulation=1)),
    (33, 576, 7168, WsRingConfig(64, 64, 4, 8, 1, 2, 1, fast_accumulation=1)),
    (256, 16384, 512, WsRingConfig(128, 128, 4, 1, 0, 1, 0, 1, fast_accumulation=1)),
    (200, 1040, 1040, WsRingConfig(128, 64, 4, 1, 0, 1, 0, 0, 1, fast_accumulation=1)),
    (130, 4096, 1040, WsRingConfig(128, 64, 3, 3, 0, 1, 0, 1, fast_accumulation=1)),
    # 2-slot rings: a step a split, and two
    (128, 512, 384, WsRingConfig(128, 128, 2, 3, fast_accumulation=1)),
    (200, 1040, 512, WsRingConfig(64, 128, 2, 2, 1, fast_accumulation=1)),
    (200, 1040, 1040, WsRingConfig(128, 64, 4, 1, 0, 1, 0, 1, 1, 1, 1)),  # stream-K
    # 8-slot rings: 19 steps around them, and 9 steps of two warpgroups
    (100, 1040, 2320, WsRingConfig(64, 64, 8, 1, 0, 1, 1, fast_accumulation=1)),
    (130, 4096, 1040, WsRingConfig(128, 64, 8, 1, fast_accumulation=1)),
    # 16 and 32 rows of w (N a multiple of 16, as cuBLAS's fast reference takes)
    (16, 1008, 2320, WsRingConfig(64, 32, 8, 1, 0, 1, 1, fast_accumulation=1)),
    (40, 1008, 1040, WsRingConfig(64, 16, 6, 2, 1, fast_accumulation=1)),
    # 16 and 32 rows of x a load (x_box_rows), the slots' other rows zeroed
    (16, 4096, 4096, WsRingConfig(64, 64, 8, 1, fast_accumulation=1)),
    (24, 1008, 2320, WsRingConfig(64, 64, 6, 3, 1, 2, 1, 1, fast_accumulation=1)),
    # PDL with w's first slots before the wait
    (130, 4096, 1040, WsRingConfig(128, 64, 4, 2, 0, 1, 1, 0, 1, 1, w_ahead=1)),
]


@pytest.mark.gpu
@GPU_TIMEOUT
@pytest.mark.parametrize("M, N, K, config", FAST_GPU_CASES,
                         ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("layout", ["tensor", "token_channel"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_fast_accumulation_matches_reference(M, N, K, config, layout, out_dtype):
    """Within what cuBLAS's fast accumulation errs on the same operands, bias included."""
    fast_accumulated_scaled(gemm_wsring.gemm_wsring, M, N, K, layout, out_dtype, config)


@pytest.mark.gpu
@GPU_TIMEOUT
def test_gpu_fast_accumulation_is_the_less_precise_sum_at_long_k():
    """The fast config runs its own loop: at K = 8192 in one split its fp32 result is further
    from the reference than the promoted config's, which stays within 3x cuBLAS's (as
    ``assert_long_k_as_precise_as_cublas`` holds the promoted Gluon kernels)."""
    M, N, K = 64, 512, 8192
    xq, wq, x_scale, w_scale = quantised_operands(M, N, K, FP8, "token_channel", generator(K))
    ref = (xq.double() @ wq.double().T) * (x_scale.reshape(-1, 1) * w_scale.reshape(1, -1))
    cublas = torch._scaled_mm(xq, wq.T, scale_a=x_scale.reshape(-1, 1).contiguous(),
                              scale_b=w_scale.reshape(1, -1).contiguous(),
                              out_dtype=torch.float32)
    errors = {}
    for fast in (0, 1):
        config = WsRingConfig(64, 128, 4, 1, fast_accumulation=fast)
        y = gemm_wsring.gemm_wsring(xq, wq, None, torch.float32, x_scale, w_scale, config,
                                    out=poisoned(M, N, torch.float32))
        errors[fast] = float((y.double() - ref).norm() / ref.norm())
    theirs = float((cublas.double() - ref).norm() / ref.norm())
    assert errors[0] <= 3 * theirs + 1e-7 and errors[0] < errors[1], (errors, theirs)


@pytest.mark.gpu
@GPU_TIMEOUT
def test_gpu_through_dispatch_replays_on_new_inputs():
    """Named as gemm_a8w8_blockscale's kernel: the first call checks, plans and launches, the
    later ones replay (descriptors rebuilt around each call's x and w), right on new inputs
    and on a second weight of the same shape."""
    import gemmtune

    M, N, K = 160, 1280, 2048
    weights = [block_scaled_operands(M, N, K, generator(s)) for s in (1, 2)]
    name = WsRingConfig(128, 128, 4, 3).name
    for step in range(4):
        xq, _, x_scale, _ = block_scaled_operands(M, N, K, generator(10 + step))
        _, wq, _, w_scale = weights[step % 2]
        y = gemmtune.gemm_a8w8_blockscale(xq, wq, x_scale, w_scale, kernel=name)
        check_block_scaled_decode(y, xq, wq, x_scale, w_scale, None, f"call {step}")

"""gemm_a4w4_blockscale: both operands MXFP4, dispatched through a4w4_blockscale_tuned_gemm.csv;
every backend against the fp32 product of the dequantised operands."""

from __future__ import annotations

import pytest
import torch

import gemmtune
from gemm_checks import DEVICE, generator, install_user_table, mxfp4_default_kernel, randn
from gemmtune import quant
from gemmtune.device import DeviceId
from gemmtune.families.a4w4_blockscale.op import DISPATCH, A4w4Key
from gemmtune.kernels.torch_ref import TORCH_DEQUANT_MM, TORCH_UNPACK_DEQUANT_MM, gemm_a4w4_ref
from gemmtune.tables.lookup import Rule

# As tables were written before the family took packed weights: their rows are as quantised.
HEADER = "arch,cu_num,M,N,K,libtype,solidx,splitK,us,kernelName,err_ratio,tflops,bw\n"
PACKED_HEADER = HEADER.replace("M,N,K,", "M,N,K,packed,")
W4 = "triton.w4:BM16.BN32.BK64.W4.S1"


@pytest.fixture
def a4w4_table(tmp_path, monkeypatch):
    def install(*rows: tuple) -> None:  # (M, N, K[, packed], kernelName)
        header = HEADER if all(len(row) == 4 for row in rows) else PACKED_HEADER
        rows = [row if header == HEADER or len(row) == 5 else (*row[:3], False, row[3])
                for row in rows]
        install_user_table(monkeypatch, tmp_path / "a4w4_user.csv",
                           "GEMMTUNE_CONFIG_A4W4_BLOCKSCALE", header, rows)

    return install


def operands(M, N, K, seed=0):
    """x per token row and w, their blocks of different magnitudes, in MXFP4."""
    gen = generator(seed)
    blocks = torch.logspace(-2, 1, K // 32, device=DEVICE).repeat_interleave(32)
    x = randn(M, K, gen=gen) * (1 + 4 * torch.rand(M, 1, generator=gen, device=DEVICE))
    w = randn(N, K, gen=gen) * blocks
    return (*quant.mxfp4(x), *quant.mxfp4(w))


def assert_close_to_reference(y, xq, xs, wq, ws):
    ref = gemm_a4w4_ref(xq.reshape(-1, xq.shape[-1]), wq, xs.reshape(-1, xs.shape[-1]), ws)
    ref = ref.reshape(y.shape)
    assert not torch.isnan(y).any()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel  # the output's rounding: ~2e-3 in norm for bf16


def test_calls_on_the_cpu_and_other_devices_default_to_torch():
    """The default's Triton kernels are for a Hopper's tensors: a call with CPU tensors runs the
    torch backend whatever GPU the process has, and so does a key looked up for another arch."""
    cpu = [t.cpu() for t in operands(5, 40, 256, seed=7)]
    xq, xs, wq, ws = cpu
    assert_close_to_reference(gemmtune.gemm_a4w4_blockscale(xq, wq, xs, ws), *cpu)
    (plan,) = [p for p in DISPATCH.plans.values() if p.decision.key.M == 5]
    assert plan.decision.kernel_name == TORCH_DEQUANT_MM
    for packed, name in ((False, TORCH_DEQUANT_MM), (True, TORCH_UNPACK_DEQUANT_MM)):
        key = A4w4Key(5, 40, 256, packed)
        assert DISPATCH.decide(key, DeviceId("sm_80", 108)).kernel_name == name


@pytest.mark.parametrize("M, N, K", [(0, 40, 96), (3, 0, 96), (3, 40, 0)])
def test_empty_gemms_need_no_kernel(M, N, K):
    """No table holds an empty GEMM: the default runs it (zeros where K is 0)."""
    xq = torch.zeros(M, K // 2, dtype=torch.uint8, device=DEVICE)
    xs = torch.zeros(M, K // 32, dtype=torch.uint8, device=DEVICE)
    wq = torch.zeros(N, K // 2, dtype=torch.uint8, device=DEVICE)
    ws = torch.zeros(N, K // 32, dtype=torch.uint8, device=DEVICE)
    y = gemmtune.gemm_a4w4_blockscale(xq, wq, xs, ws)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16 and not y.any()


@pytest.mark.parametrize("M", [6, 130])
def test_default_matches_reference(M):
    """Without a row: on a Hopper, the decode kernel's default config up to M = 128; elsewhere
    (larger M, the CPU) the torch backend."""
    xq, xs, wq, ws = operands(M, 40, 96)
    y = gemmtune.gemm_a4w4_blockscale(xq.reshape(2, M // 2, 48), wq, xs.reshape(2, M // 2, 3),
                                      ws)
    assert y.dtype == torch.bfloat16 and y.shape == (2, M // 2, 40)
    assert_close_to_reference(y, xq, xs, wq, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.default
    assert plan.decision.kernel_name == mxfp4_default_kernel(M, 40, 96, torch.uint8, False,
                                                             TORCH_DEQUANT_MM)


@pytest.mark.parametrize("kernel", ["triton.w4:BM16.BN32.BK64.W4.S1",
                                    "triton.w4:BM16.BN32.BK32.W4.S1.SK3",
                                    "triton.w4:BM16.BN32.BK64.W4.S1.SK2.DS1",
                                    "triton.w4deq:BN16.BK64.W4"])  # dequantise both, cuBLAS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_table_row_picks_the_triton_kernel(a4w4_table, kernel, dtype):
    M, N, K = 5, 70, 160
    a4w4_table((M, N, K, kernel))
    xq, xs, wq, ws = operands(M, N, K, seed=1)
    for _ in range(2):  # the planned call, then the bound one
        y = gemmtune.gemm_a4w4_blockscale(xq, wq, xs, ws, dtype=dtype)
        assert y.dtype == dtype
        assert_close_to_reference(y, xq, xs, wq, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact and plan.decision.kernel_name == kernel
    assert plan.decision.key == A4w4Key(M, N, K)


def test_the_products_of_codes_are_exact_in_fp32_output():
    """Both operands' codes multiply exactly (fp16 products of E2M1 values, fp32 sums) and are
    scaled in fp32: fp32 output matches the fp32 reference to fp32's rounding."""
    xq, xs, wq, ws = operands(4, 48, 128, seed=2)
    y = gemmtune.gemm_a4w4_blockscale(xq, wq, xs, ws, dtype=torch.float32,
                                      kernel="triton.w4:BM16.BN16.BK64.W4.S1")
    ref = gemm_a4w4_ref(xq, wq, xs, ws)
    mag = quant.dequant_mxfp4(xq, xs).abs() @ quant.dequant_mxfp4(wq, ws).abs().T
    assert ((y - ref).abs() <= 2 ** -20 * mag).all()


@pytest.mark.parametrize("bad, says", [
    (lambda xq, xs, wq, ws: (xq.to(torch.int8), wq, xs, ws), "must be uint8"),
    (lambda xq, xs, wq, ws: (xq, wq[:, :-1], xs, ws), "needs wq"),
    (lambda xq, xs, wq, ws: (xq, wq, xs[:, :-1], ws), "needs wq"),
    (lambda xq, xs, wq, ws: (xq[:, :8], wq[:, :8], xs[:, :1], ws[:, :1]), "multiple of 32"),
])
def test_bad_operands_say_what_is_wrong(bad, says):
    with pytest.raises((TypeError, ValueError), match=says):
        gemmtune.gemm_a4w4_blockscale(*bad(*operands(3, 40, 64)))
    xq, xs, wq, ws = operands(3, 40, 64)
    with pytest.raises(TypeError, match="not an output dtype"):
        gemmtune.gemm_a4w4_blockscale(xq, wq, xs, ws, dtype=torch.int8)


def test_under_torch_compile_it_is_one_custom_op():
    xq, xs, wq, ws = operands(4, 40, 64)

    @torch.compile(fullgraph=True, backend="eager")
    def f(xq):
        return gemmtune.gemm_a4w4_blockscale(xq, wq, xs, ws) * 2

    assert_close_to_reference(f(xq) / 2, xq, xs, wq, ws)


def _tune(tmp_path, untuned: str):
    """``gemmtune tune a4w4-blockscale`` of the rows ``untuned`` (CSV text) into tmp_path's t.csv
    and prof.csv, a few iterations: its summary and log."""
    import io

    from gemmtune.families.a4w4_blockscale.tuner import A4w4BlockscaleTuner
    from gemmtune.tune.engine import TuneConfig, Tuner, default_gpus
    from gemmtune.tune.family import TuneOptions

    inp = tmp_path / "u.csv"
    inp.write_text(untuned)
    out = io.StringIO()
    config = TuneConfig(input=inp, output=tmp_path / "t.csv", profile=tmp_path / "prof.csv",
                        timeout=120, options=TuneOptions(iters=3, warmup=1),
                        gpus=default_gpus(), workers=4 if default_gpus() else 1)
    return Tuner(A4w4BlockscaleTuner, config, out=out).run(), out.getvalue()


def test_tuner_checks_every_candidate_against_the_dequantised_reference(tmp_path):
    """``gemmtune tune a4w4-blockscale``: torch and the MXFP4 kernel's configs (two on the CPU)
    pass the gate; a K that is not a multiple of 32 fails that shape alone."""
    import csv

    from gemmtune.families.a4w4_blockscale.tuner import A4w4BlockscaleTuner
    from gemmtune.tables.store import read_table

    summary, log = _tune(tmp_path, "M,N,K\n5,40,96\n2,32,80\n")
    assert summary.tuned == 1 and len(summary.failed) == 1, log
    assert "multiple of 32" in log
    (row,) = read_table(tmp_path / "t.csv", A4w4BlockscaleTuner.schema).rows
    assert row.key == A4w4Key(5, 40, 96)
    with open(tmp_path / "prof.csv") as f:
        profiled = [(r["kernelName"], r["status"]) for r in csv.DictReader(f) if r["M"] == "5"]
    assert profiled[0] == (TORCH_DEQUANT_MM, "ok")
    assert all(status == "ok" for _, status in profiled), profiled
    assert sum(name.startswith("triton.w4:") for name, _ in profiled) >= 2


@pytest.mark.gpu
@pytest.mark.parametrize("M, kernel", [(1, "triton.w4:BM16.BN64.BK128.W4.S3"),
                                       (16, "triton.w4:BM16.BN64.BK128.W4.S3"),
                                       (100, "triton.w4:BM16.BN64.BK128.W4.S3"),
                                       (1, "triton.w4frag:BM8.BK64.SK5.P1.R1"),
                                       (16, "triton.w4frag:BM16.BK64.SK3"),
                                       (8, "triton.w4frag:BM8.BK128.SK4.P1.R1.L0.X1"),
                                       (1024, "triton.w4deq:BN8.BK512.W4")])
def test_gpu_real_sizes_through_a_row(a4w4_table, M, kernel):
    """Through a row naming each MXFP4 kernel (the register-direct one decodes x's codes as
    it does w's: up to 32 rows; dequantise-then-cuBLAS for prefill)."""
    if kernel.startswith("triton.w4frag") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("triton.w4frag is a Gluon kernel for Hopper (sm_90)")
    N, K = 2880, 2880
    a4w4_table((M, N, K, kernel))
    xq, xs, wq, ws = operands(M, N, K, seed=M)
    for _ in range(3):  # planned, bound, replayed
        y = gemmtune.gemm_a4w4_blockscale(xq, wq, xs, ws)
        assert_close_to_reference(y, xq, xs, wq, ws)


@pytest.mark.gpu
@pytest.mark.parametrize("M, kernel", [(1, "triton.w4frag:BM8.BK128.SK5.P1.R1.L1"),
                                       (16, "triton.w4frag:BM16.BK256.SK3.P0.R0.L1"),
                                       (8, "triton.w4frag:BM8.BK128.SK4.P1.R1.L1.X1"),
                                       (13, "triton.w4xa:T2.W4.SK5.P1"),
                                       (1024, "triton.w4deq:BN8.BK512.W4.L1.A1")])
def test_gpu_packed_weights_through_a_row(a4w4_table, M, kernel):
    """A packed weight (prepack_mxfp4) through a row naming a kernel that reads it: planned,
    bound and replayed, right each time."""
    if kernel.startswith(("triton.w4frag", "triton.w4xa")) and \
            torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{kernel.split(':')[0]} is a Gluon kernel for Hopper (sm_90)")
    N, K = 2880, 4096
    a4w4_table((M, N, K, True, kernel))
    xq, xs, wq, ws = operands(M, N, K, seed=M)
    packed, _ = quant.prepack_mxfp4(wq, ws)
    for _ in range(3):
        y = gemmtune.gemm_a4w4_blockscale(xq, packed, xs, ws, packed=True)
        assert_close_to_reference(y, xq, xs, wq, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact and plan.decision.kernel_name == kernel


@pytest.mark.parametrize("kernel", [
    "triton.w4:BM16.BN32.BK64.W4.S1",
    # the two powers of two make 2^6 before they scale a block's product
    pytest.param("triton.w4frag:BM8.BK64.SK1", marks=pytest.mark.gpu)])
def test_one_huge_and_one_tiny_scale_multiply_without_overflow(kernel):
    """x's blocks at scale 2^124 and w's at 2^-118: each product is finite (2^6 times the
    codes'), and so is the output, equal to the reference's (a block's codes' dot times 2^124
    alone passes fp32's largest number from 16 on)."""
    if kernel.startswith("triton.w4frag") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("triton.w4frag is a Gluon kernel for Hopper (sm_90)")
    xq, xs, wq, ws = operands(3, 32, 64, seed=9)
    xs.fill_(127 + 124)
    ws.fill_(127 - 118)
    y = gemmtune.gemm_a4w4_blockscale(xq, wq, xs, ws, dtype=torch.float32, kernel=kernel)
    ref = gemm_a4w4_ref(xq, wq, xs, ws)
    assert torch.isfinite(ref).all() and torch.equal(y, ref)


# --- the packed layout -------------------------------------------------------------------------


def test_packed_weights_default_to_a_kernel_that_reads_them():
    """Without a row: the decode kernel's default config reading packed weights on a Hopper,
    else the unpacking torch backend."""
    xq, xs, wq, ws = operands(5, 40, 256, seed=3)
    packed, _ = quant.prepack_mxfp4(wq, ws)
    y = gemmtune.gemm_a4w4_blockscale(xq, packed, xs, ws, packed=True)
    assert_close_to_reference(y, xq, xs, wq, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.kernel_name == mxfp4_default_kernel(5, 40, 256, torch.uint8, True,
                                                             TORCH_UNPACK_DEQUANT_MM)
    assert plan.decision.key == A4w4Key(5, 40, 256, True)


@pytest.mark.parametrize("packed", [False, True])
def test_a_row_per_layout_runs_its_kernel(a4w4_table, packed):
    """A table with the ``packed`` column: each layout's row names the dequantise-then-cuBLAS
    kernel reading that layout, right for the planned and the bound call."""
    M, N, K = 6, 48, 256
    kernel = "triton.w4deq:BN16.BK128.W4" + (".L1" if packed else "")
    other = "triton.w4deq:BN16.BK128.W4" + ("" if packed else ".L1")
    a4w4_table((M, N, K, packed, kernel), (M, N, K, not packed, other))
    xq, xs, wq, ws = operands(M, N, K, seed=7)
    stored = quant.prepack_mxfp4(wq, ws)[0] if packed else wq
    for _ in range(2):
        y = gemmtune.gemm_a4w4_blockscale(xq, stored, xs, ws, packed=packed)
        assert_close_to_reference(y, xq, xs, wq, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact and plan.decision.kernel_name == kernel
    assert plan.decision.key == A4w4Key(M, N, K, packed)


def test_a_row_for_the_other_layout_is_not_used(a4w4_table):
    """Rows are per layout: a packed weight never runs a kernel that reads unpacked ones (nor
    the unpacked torch backend), and the other way round."""
    M, N, K = 5, 40, 256
    a4w4_table((M, N, K, True, W4), (M, N, K, False, TORCH_UNPACK_DEQUANT_MM))
    xq, xs, wq, ws = operands(M, N, K, seed=4)
    packed, _ = quant.prepack_mxfp4(wq, ws)
    with pytest.warns(UserWarning, match="this problem's are packed"):
        y = gemmtune.gemm_a4w4_blockscale(xq, packed, xs, ws, packed=True)
    assert_close_to_reference(y, xq, xs, wq, ws)
    with pytest.warns(UserWarning, match="takes packed weights; use torch.dequant_mm"):
        y = gemmtune.gemm_a4w4_blockscale(xq, wq, xs, ws)
    assert_close_to_reference(y, xq, xs, wq, ws)
    names = {plan.decision.kernel_name for plan in DISPATCH.plans.values()}
    # the family's defaults for each layout (the torch backends but on a Hopper)
    assert names == {mxfp4_default_kernel(M, N, K, torch.uint8, False, TORCH_DEQUANT_MM),
                     mxfp4_default_kernel(M, N, K, torch.uint8, True, TORCH_UNPACK_DEQUANT_MM)}


def test_packed_needs_k_a_multiple_of_128_and_compiles_to_the_custom_op():
    xq, xs, wq, ws = operands(3, 40, 96)
    with pytest.raises(ValueError, match="packed=True, but K=96"):
        gemmtune.gemm_a4w4_blockscale(xq, wq, xs, ws, packed=True)
    xq, xs, wq, ws = operands(4, 40, 128, seed=5)
    packed, _ = quant.prepack_mxfp4(wq, ws)

    @torch.compile(fullgraph=True, backend="eager")
    def f(xq):
        return gemmtune.gemm_a4w4_blockscale(xq, packed, xs, ws, packed=True) * 2

    assert_close_to_reference(f(xq) / 2, xq, xs, wq, ws)


def test_tuner_packed_keys_time_packed_weights_and_only_kernels_that_read_them(tmp_path):
    """A key with ``packed``: w is packed before the candidates run; the baseline is the
    unpacking torch backend, triton.w4 (which reads weights as quantised) is not offered, and
    a K without a packed layout fails that shape alone, saying why."""
    import csv

    from gemmtune.families.a4w4_blockscale.tuner import A4w4BlockscaleTuner
    from gemmtune.tables.store import read_table

    summary, log = _tune(tmp_path, "M,N,K,packed\n5,40,128,True\n5,40,96,True\n")
    assert summary.tuned == 1 and len(summary.failed) == 1, log
    assert "not a multiple of 128" in log
    (row,) = read_table(tmp_path / "t.csv", A4w4BlockscaleTuner.schema).rows
    assert row.key == A4w4Key(5, 40, 128, True)
    with open(tmp_path / "prof.csv") as f:
        profiled = [(r["kernelName"], r["status"]) for r in csv.DictReader(f) if r["K"] == "128"]
    assert profiled[0] == (TORCH_UNPACK_DEQUANT_MM, "ok")
    assert all(status == "ok" for _, status in profiled), profiled
    assert not any(name.startswith("triton.w4:") for name, _ in profiled)
    if not torch.cuda.is_available():
        assert row.kernel_names(A4w4BlockscaleTuner.schema) == (TORCH_UNPACK_DEQUANT_MM,)


def test_the_bench_stores_the_weight_in_the_layout_the_rows_favour(a4w4_table, tmp_path):
    """``gemmtune bench a4w4-blockscale`` packs a weight whose packed rows take no longer than
    its unpacked ones (here as long) and runs the packed row, its torch and reference columns
    unpacking the weight (and staying right); a weight without packed rows stays as
    quantised."""
    import csv

    from gemmtune.cli import main
    from gemmtune.families.a4w4_blockscale.op import packed_layout_tuned

    packed_row = "triton.w4deq:BN16.BK128.W4.L1"
    a4w4_table((2, 64, 128, True, packed_row), (2, 64, 128, False, TORCH_DEQUANT_MM))
    assert packed_layout_tuned(64, 128) and not packed_layout_tuned(64, 256)
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("M,N,K\n2,64,128\n")
    out = tmp_path / "out"
    assert main(["bench", "a4w4-blockscale", "--shapes", str(shapes), "-o", str(out)]) == 0
    (row,) = csv.DictReader(open(out / "bench_a4w4_blockscale.csv"))
    assert row["kernel"] == packed_row and row["ok"] == "True"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_the_torch_backend_keeps_the_outputs_precision(dtype):
    """Without a row the torch backend runs: in fp32 for fp16 and fp32 outputs (bf16 would
    round to 2^-8), so an fp32 output is the reference to fp32's rounding."""
    xq, xs, wq, ws = operands(4, 48, 128, seed=3)
    y = gemmtune.gemm_a4w4_blockscale(xq, wq, xs, ws, dtype=dtype)
    ref = gemm_a4w4_ref(xq, wq, xs, ws)
    mag = quant.dequant_mxfp4(xq, xs).abs() @ quant.dequant_mxfp4(wq, ws).abs().T
    rounding = {torch.float16: 2 ** -11, torch.float32: 2 ** -20}[dtype]
    assert ((y.float() - ref).abs() <= rounding * (ref.abs() + mag)).all()


def test_both_mxfp4_tuners_offer_the_gluon_kernels_on_hopper(monkeypatch):
    """On a Hopper (faked here) the a4w4 and a16w4 tuners offer triton.w4frag's configs at
    decode, each for the weight layout of its key (triton.w4 only for weights as quantised),
    and triton.w4xa's at 9-16 rows for packed weights; the a4w4 tuner triton.w4deq's at
    prefill and the a16w4 tuner also triton.w4wg's, for the key's layout; the a4w4 tuner once
    offered only triton.w4 (its registry was not passed), so its tuned rows were the slower
    kernel's."""
    from gemmtune.families.a4w4_blockscale.tuner import A4w4BlockscaleTuner
    from gemmtune.families.a16w4.op import A16w4Key
    from gemmtune.families.a16w4.tuner import A16w4Tuner
    from gemmtune.kernels.triton import _checks, _splits, _swapped, gemm_w4deq, gemm_w4frag, \
        gemm_w4wg

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_checks, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(_splits, "pdl_where_supported", lambda: _splits.PDL_WAIT)
    for module in (_swapped, gemm_w4wg):
        monkeypatch.setattr(module, "why_not_here", lambda kernel, instead: None)
    for packed in (False, True):
        a4w4 = [c.name for c in A4w4BlockscaleTuner().candidates(A4w4Key(8, 4096, 4096, packed),
                                                                 frozenset())]
        assert a4w4[0] == (TORCH_UNPACK_DEQUANT_MM if packed else TORCH_DEQUANT_MM)
        frags = [gemm_w4frag.W4FragConfig.from_name(n) for n in a4w4
                 if n.startswith("triton.w4frag:BM8.")]
        assert frags and all(c.packed == packed for c in frags), a4w4
        assert any(n.startswith("triton.w4:") for n in a4w4) != packed, a4w4
        prefill = [c.name for c in A4w4BlockscaleTuner().candidates(
            A4w4Key(1024, 4096, 4096, packed), frozenset())]
        deq = [gemm_w4deq.W4DeqConfig.from_name(n) for n in prefill
               if n.startswith("triton.w4deq:")]
        assert deq and all(c.packed == packed for c in deq), prefill
        a16w4 = [c.name for c in A16w4Tuner().candidates(
            A16w4Key(16, 4096, 4096, "torch.bfloat16", packed), frozenset())]
        frags = [gemm_w4frag.W4FragConfig.from_name(n) for n in a16w4
                 if n.startswith("triton.w4frag:BM16.")]
        assert frags and all(c.packed == packed for c in frags), a16w4
        assert {c.add_splits for c in frags} == {0, 1}, a16w4  # split sums in order, added
        for names in (a16w4, [c.name for c in A4w4BlockscaleTuner().candidates(
                A4w4Key(12, 4096, 4096, packed), frozenset())]):
            assert any(n.startswith("triton.w4xa:") for n in names) == packed, names
        prefill = [c.name for c in A16w4Tuner().candidates(
            A16w4Key(1024, 4096, 4096, "torch.bfloat16", packed), frozenset())]
        prefill_wg = [gemm_w4wg.W4WgConfig.from_name(n) for n in prefill
                      if n.startswith("triton.w4wg:")]
        assert prefill_wg and all(c.packed == packed for c in prefill_wg), prefill
        assert any(n.startswith("triton.w4deq:") for n in prefill), prefill


def test_the_mxfp4_benches_peak_is_f_linear_not_the_torch_dequantise():
    """The bench's compute ceiling for the MXFP4 families is F.linear in the dtype their
    kernels multiply in (the torch column dequantises in torch first: timed at 8192^3 it gave
    a ceiling of ~200 TFLOP/s, and every prefill shape came out "faster than the floor")."""
    from gemmtune.families import a4w4_blockscale, a16w4

    assert a16w4.FAMILY.bench("bf16").math_dtype == torch.bfloat16
    assert a16w4.FAMILY.bench("fp16").math_dtype == torch.float16
    for dtype in a4w4_blockscale.FAMILY.bench_dtypes:
        assert a4w4_blockscale.FAMILY.bench(dtype).math_dtype == torch.bfloat16

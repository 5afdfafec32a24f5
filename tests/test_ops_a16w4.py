"""gemm_a16w4: bf16 / fp16 activations times MXFP4 weights, dispatched through
a16w4_tuned_gemm.csv; every backend against the fp32 product with the dequantised weight."""

from __future__ import annotations

import pytest
import torch

import gemmtune
from gemm_checks import DEVICE, generator, install_user_table, mxfp4_default_kernel, randn
from gemmtune import quant
from gemmtune.device import DeviceId
from gemmtune.dispatch import KernelNameError
from gemmtune.families.a16w4.op import DISPATCH, REGISTRY, A16w4Key
from gemmtune.kernels.torch_ref import (TORCH_DEQUANT_LINEAR, TORCH_DEQUANT_MM,
                                        TORCH_UNPACK_DEQUANT_LINEAR, TORCH_UNPACK_DEQUANT_MM,
                                        gemm_a16w4_ref)
from gemmtune.tables.lookup import Rule

HEADER = ("arch,cu_num,M,N,K,dtype,packed,libtype,solidx,splitK,us,kernelName,err_ratio,tflops,"
          "bw\n")
W4 = "triton.w4:BM16.BN32.BK64.W4.S1"


@pytest.fixture
def a16w4_table(tmp_path, monkeypatch):
    def install(*rows: tuple) -> None:  # (M, N, K, dtype[, packed], kernelName)
        rows = [row if len(row) == 6 else (*row[:4], False, row[4]) for row in rows]
        install_user_table(monkeypatch, tmp_path / "a16w4_user.csv", "GEMMTUNE_CONFIG_A16W4",
                           HEADER, rows)

    return install


def operands(M, N, K, dtype=torch.bfloat16, seed=0, with_bias=True):
    """x, and a weight whose blocks' scales differ along N and K, in MXFP4."""
    gen = generator(seed)
    x = randn(M, K, gen=gen).to(dtype)
    w = randn(N, K, gen=gen) * torch.logspace(-2, 1, K // 32, device=DEVICE).repeat_interleave(32)
    wq, ws = quant.mxfp4(w)
    bias = randn(N, gen=gen).to(dtype) if with_bias else None
    return x, wq, ws, bias


def assert_close_to_reference(y, x, wq, ws, bias):
    ref = gemm_a16w4_ref(x.reshape(-1, x.shape[-1]), wq, ws, bias).reshape(y.shape)
    assert not torch.isnan(y).any()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel  # the output's rounding: ~2e-3 in norm for bf16


@pytest.mark.parametrize("M, dtype", [(7, torch.bfloat16), (7, torch.float16),
                                      (129, torch.bfloat16)])
def test_default_matches_reference(M, dtype):
    """Without a row: on a Hopper, the decode kernel's default config up to M = 128 for bf16 x;
    elsewhere (fp16 x, larger M, the CPU) the torch backend."""
    x, wq, ws, bias = operands(M, 40, 96, dtype)
    y = gemmtune.gemm_a16w4(x.reshape(M, 1, 96), wq, ws, bias)
    assert y.dtype == dtype and y.shape == (M, 1, 40)
    assert_close_to_reference(y, x, wq, ws, bias)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.default
    assert plan.decision.kernel_name == mxfp4_default_kernel(M, 40, 96, dtype, False,
                                                             TORCH_DEQUANT_LINEAR)


def test_calls_on_the_cpu_and_other_devices_default_to_torch():
    """The default's Triton kernels are for a Hopper's tensors: a call with CPU tensors runs the
    torch backend whatever GPU the process has, and so does a key looked up for another arch."""
    x, wq, ws, bias = operands(5, 40, 256, seed=7)
    cpu = [t.cpu() for t in (x, wq, ws, bias)]
    assert_close_to_reference(gemmtune.gemm_a16w4(*cpu), *cpu)
    (plan,) = [p for p in DISPATCH.plans.values() if p.decision.key.M == 5]
    assert plan.decision.kernel_name == TORCH_DEQUANT_LINEAR
    for packed, name in ((False, TORCH_DEQUANT_LINEAR), (True, TORCH_UNPACK_DEQUANT_LINEAR)):
        key = A16w4Key(5, 40, 256, "torch.bfloat16", packed)
        assert DISPATCH.decide(key, DeviceId("sm_80", 108)).kernel_name == name


@pytest.mark.parametrize("x_dtype, torch_names", [
    (torch.bfloat16, (TORCH_DEQUANT_LINEAR, TORCH_UNPACK_DEQUANT_LINEAR)),
    (torch.uint8, (TORCH_DEQUANT_MM, TORCH_UNPACK_DEQUANT_MM))])
def test_the_default_on_a_hopper(monkeypatch, x_dtype, torch_names):
    """Where every kernel can run (as on a Hopper, here pretended): triton.w4frag's default
    config for the device's SMs in the weight's layout up to M = 128, triton.w4deq's PTX config
    above; the torch backend of the layout for another arch and for empty GEMMs."""
    from gemmtune.dispatch import KernelRegistry
    from gemmtune.families._mxfp4_default import default_kernel_name
    from gemmtune.families._mxfp4_layout import TorchBackends
    from gemmtune.kernels.problem import GemmProblem, Scaling
    from gemmtune.kernels.triton.gemm_w4frag import W4FragConfig, default_config

    monkeypatch.setattr(KernelRegistry, "can_run", lambda self, name, problem: True)
    names = TorchBackends(*torch_names)
    hopper, ampere = DeviceId("sm_90", 132, "H200"), DeviceId("sm_80", 108)
    out = torch.bfloat16 if x_dtype == torch.uint8 else x_dtype
    for packed in (False, True):
        def default(m, n, k, device=hopper):
            problem = GemmProblem(m, n, k, x_dtype, out, scaling=Scaling.mxfp4,
                                  preshuffled=packed)
            return default_kernel_name(REGISTRY, names, problem, device)

        c = default_config(5, 4096, 4096, x_dtype, num_sms=132)
        assert default(5, 4096, 4096) == W4FragConfig(c.block_m, c.block_k, c.split_k,
                                                      packed=int(packed)).name
        assert default(130, 4096, 4096) == f"triton.w4deq:BN8.BK512.W4.L{int(packed)}.A1"
        for m, n, k, device in ((5, 4096, 4096, ampere), (0, 4096, 4096, hopper),
                                (5, 0, 4096, hopper), (5, 4096, 0, hopper)):
            assert default(m, n, k, device) == names.of(packed)
    monkeypatch.setattr(KernelRegistry, "can_run", lambda self, name, problem: False)
    assert default(5, 4096, 4096) == names.of(True)


@pytest.mark.parametrize("M, N, K", [(0, 40, 96), (3, 0, 96), (3, 40, 0)])
def test_empty_gemms_need_no_kernel(M, N, K):
    """No table holds an empty GEMM: the default runs it (the bias where K is 0)."""
    x, _, _, _ = operands(M, N, 96, seed=5)
    wq = torch.zeros(N, K // 2, dtype=torch.uint8, device=DEVICE)
    ws = torch.zeros(N, K // 32, dtype=torch.uint8, device=DEVICE)
    bias = randn(N, gen=generator(6)).to(torch.bfloat16)
    y = gemmtune.gemm_a16w4(x[:, :K].contiguous(), wq, ws, bias)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    assert torch.equal(y, bias.expand(M, N))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_table_row_picks_the_triton_kernel(a16w4_table, dtype):
    M, N, K = 5, 70, 160
    a16w4_table((M, N, K, str(dtype), W4))
    x, wq, ws, bias = operands(M, N, K, dtype, seed=1)
    for _ in range(2):  # the planned call, then the bound one
        y = gemmtune.gemm_a16w4(x, wq, ws, bias)
        assert y.dtype == dtype
        assert_close_to_reference(y, x, wq, ws, bias)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact and plan.decision.kernel_name == W4
    assert plan.decision.key == A16w4Key(M, N, K, str(dtype), False)


def test_named_kernel_without_bias_and_other_families_refuse_it():
    x, wq, ws, _ = operands(3, 40, 64, with_bias=False)
    y = gemmtune.gemm_a16w4(x, wq, ws, kernel=W4)
    assert_close_to_reference(y, x, wq, ws, None)
    with pytest.raises(KernelNameError, match="no backend"):
        gemmtune.gemm_a16w4(x, wq, ws, kernel="triton.splitk:BM16.BN32.BK64.SK1.W4.S2")
    with pytest.raises(KernelNameError, match="no backend"):
        gemmtune.gemm_a16w16(x, torch.randn(40, 64, dtype=torch.bfloat16, device=DEVICE),
                             kernel=W4)


def test_the_w4_kernel_refuses_problems_without_mxfp4_weights():
    from gemmtune.kernels.problem import GemmProblem, Scaling
    from gemmtune.kernels.triton.dispatchable import TritonKernel

    kernel = TritonKernel(W4)
    bf16 = torch.bfloat16
    assert kernel.check(GemmProblem(3, 40, 64, bf16, bf16, scaling=Scaling.mxfp4)) is None
    assert "MXFP4 weights only" in kernel.check(GemmProblem(3, 40, 64, bf16, bf16))
    assert "x's dtype" in kernel.check(GemmProblem(3, 40, 64, bf16, torch.float32,
                                                   scaling=Scaling.mxfp4))
    splitk = TritonKernel("triton.splitk:BM16.BN32.BK64.SK1.W4.S2")
    assert "does not take MXFP4" in splitk.check(GemmProblem(3, 40, 64, bf16, bf16,
                                                             scaling=Scaling.mxfp4))


@pytest.mark.parametrize("bad, says", [
    (lambda x, wq, ws, b: (x.float(), wq, ws, b), "bf16 or fp16"),
    (lambda x, wq, ws, b: (x, wq.to(torch.int8), ws, b), "must be uint8"),
    (lambda x, wq, ws, b: (x, wq[:, :-1], ws, b), "needs wq"),
    (lambda x, wq, ws, b: (x, wq, ws[:, :-1], b), "needs wq"),
    (lambda x, wq, ws, b: (x[:, :-32], wq, ws, b), "needs wq"),
    (lambda x, wq, ws, b: (x, wq, ws, b[:-1]), "bias has shape"),
])
def test_bad_operands_say_what_is_wrong(bad, says):
    with pytest.raises((TypeError, ValueError), match=says):
        gemmtune.gemm_a16w4(*bad(*operands(3, 40, 64)))


def test_under_torch_compile_it_is_one_custom_op():
    x, wq, ws, bias = operands(4, 40, 64)

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return gemmtune.gemm_a16w4(x, wq, ws, bias) * 2

    assert_close_to_reference(f(x) / 2, x, wq, ws, bias)
    fake = torch.ops.gemmtune.gemm_a16w4.default(x, wq, ws, bias)
    assert fake.shape == (4, 40) and fake.dtype == x.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 100])
def test_gpu_real_sizes_through_a_row(a16w4_table, M):
    N, K = 2880, 2880
    a16w4_table((M, N, K, "torch.bfloat16", "triton.w4:BM16.BN64.BK128.W4.S3"))
    x, wq, ws, bias = operands(M, N, K, seed=M)
    for _ in range(3):  # planned, bound, replayed
        y = gemmtune.gemm_a16w4(x, wq, ws, bias)
        assert_close_to_reference(y, x, wq, ws, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("M, kernel", [(1, "triton.w4frag:BM16.BK128.SK4.P0.R0.L1"),
                                       (16, "triton.w4frag:BM16.BK128.SK4.P0.R0.L1"),
                                       (12, "triton.w4xa:T4.W4.SK4.P1.R1")])
def test_gpu_packed_weights_through_a_row(a16w4_table, M, kernel):
    """A packed weight (prepack_mxfp4) and a row naming a kernel for packed weights (the
    register-direct one, the x-as-A one): planned, bound and replayed, right each time."""
    N, K = 2880, 4096
    a16w4_table((M, N, K, "torch.bfloat16", True, kernel))
    x, wq, ws, bias = operands(M, N, K, seed=M)
    packed, _ = quant.prepack_mxfp4(wq, ws)
    for _ in range(3):
        y = gemmtune.gemm_a16w4(x, packed, ws, bias, packed=True)
        assert_close_to_reference(y, x, wq, ws, bias)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.kernel_name == kernel


@pytest.mark.parametrize("packed", [False, True])
def test_a_prefill_row_dequantises_then_runs_cublas(a16w4_table, packed):
    """A triton.w4deq row (the weight dequantised by a Triton kernel, then torch.mm), for
    weights as quantised and packed: right for the planned and the bound call."""
    M, N, K = 70, 48, 256
    kernel = "triton.w4deq:BN16.BK128.W4" + (".L1" if packed else "")
    a16w4_table((M, N, K, "torch.bfloat16", packed, kernel))
    x, wq, ws, bias = operands(M, N, K, seed=6)
    stored = quant.prepack_mxfp4(wq, ws)[0] if packed else wq
    for _ in range(2):
        y = gemmtune.gemm_a16w4(x, stored, ws, bias, packed=packed)
        assert_close_to_reference(y, x, wq, ws, bias)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact and plan.decision.kernel_name == kernel


# --- the packed layout -------------------------------------------------------------------------


def test_packed_weights_default_to_a_kernel_that_reads_them():
    """Without a row: the decode kernel's default config reading packed weights on a Hopper,
    else the unpacking torch backend."""
    x, wq, ws, bias = operands(5, 40, 256, seed=3)
    packed, _ = quant.prepack_mxfp4(wq, ws)
    y = gemmtune.gemm_a16w4(x, packed, ws, bias, packed=True)
    assert_close_to_reference(y, x, wq, ws, bias)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.kernel_name == mxfp4_default_kernel(5, 40, 256, torch.bfloat16, True,
                                                             TORCH_UNPACK_DEQUANT_LINEAR)
    assert plan.decision.key == A16w4Key(5, 40, 256, "torch.bfloat16", True)


def test_a_row_for_the_other_layout_is_not_used(a16w4_table):
    """Rows are per layout: a packed weight never runs a kernel that reads unpacked ones (nor
    the unpacked torch backend), and the other way round."""
    M, N, K = 5, 40, 256
    a16w4_table((M, N, K, "torch.bfloat16", True, W4),
                (M, N, K, "torch.bfloat16", False, TORCH_UNPACK_DEQUANT_LINEAR))
    x, wq, ws, bias = operands(M, N, K, seed=4)
    packed, _ = quant.prepack_mxfp4(wq, ws)
    with pytest.warns(UserWarning, match="this problem's are packed"):
        y = gemmtune.gemm_a16w4(x, packed, ws, bias, packed=True)
    assert_close_to_reference(y, x, wq, ws, bias)
    with pytest.warns(UserWarning, match="takes packed weights; use torch.dequant_linear"):
        y = gemmtune.gemm_a16w4(x, wq, ws, bias)
    assert_close_to_reference(y, x, wq, ws, bias)
    names = {plan.decision.kernel_name for plan in DISPATCH.plans.values()}
    # the family's defaults for each layout (the torch backends but on a Hopper)
    bf16 = torch.bfloat16
    assert names == {mxfp4_default_kernel(M, N, K, bf16, False, TORCH_DEQUANT_LINEAR),
                     mxfp4_default_kernel(M, N, K, bf16, True, TORCH_UNPACK_DEQUANT_LINEAR)}


def test_packed_needs_k_a_multiple_of_128_and_passes_gradients():
    x, wq, ws, _ = operands(3, 40, 96)
    with pytest.raises(ValueError, match="packed=True, but K=96"):
        gemmtune.gemm_a16w4(x, wq, ws, packed=True)
    x, wq, ws, bias = operands(3, 40, 128, seed=5)
    packed, _ = quant.prepack_mxfp4(wq, ws)
    x.requires_grad_(True)
    gemmtune.gemm_a16w4(x, packed, ws, bias, packed=True).float().sum().backward()
    want = torch.ones(3, 40, device=DEVICE) @ quant.dequant_mxfp4(wq, ws)
    torch.testing.assert_close(x.grad.float(), want, rtol=2e-2, atol=2e-2)


# --- the tuner ---------------------------------------------------------------------------------


def _tune(tmp_path, untuned: str):
    """``gemmtune tune a16w4`` of the rows ``untuned`` (CSV text) into tmp_path's t.csv and
    prof.csv, a few iterations: its summary and log."""
    import io

    from gemmtune.families.a16w4.tuner import A16w4Tuner
    from gemmtune.tune.engine import TuneConfig, Tuner, default_gpus
    from gemmtune.tune.family import TuneOptions

    inp = tmp_path / "u.csv"
    inp.write_text(untuned)
    out = io.StringIO()
    config = TuneConfig(input=inp, output=tmp_path / "t.csv", profile=tmp_path / "prof.csv",
                        timeout=120, options=TuneOptions(iters=3, warmup=1),
                        gpus=default_gpus(), workers=4 if default_gpus() else 1)
    return Tuner(A16w4Tuner, config, out=out).run(), out.getvalue()


def test_tuner_checks_every_candidate_against_the_dequantised_reference(tmp_path):
    """``gemmtune tune a16w4``: torch and the MXFP4 kernel's configs pass the gate against the
    fp32 product with the dequantised weight (on the CPU two configs in fp16, bf16 ones refused
    with the interpreter's reason); a K that is not a multiple of 32 fails that shape alone."""
    import csv
    from gemmtune.families.a16w4.tuner import A16w4Tuner
    from gemmtune.tables.store import read_table

    summary, log = _tune(tmp_path, "M,N,K,dtype\n5,40,96,torch.float16\n"
                                   "3,48,64,torch.bfloat16\n2,32,80,torch.float16\n")
    assert summary.tuned == 2 and len(summary.failed) == 1, log
    assert "multiple of 32" in log
    rows = {r.key: r for r in read_table(tmp_path / "t.csv", A16w4Tuner.schema).rows}
    assert set(rows) == {A16w4Key(5, 40, 96, "torch.float16", False),
                         A16w4Key(3, 48, 64, "torch.bfloat16", False)}
    with open(tmp_path / "prof.csv") as f:
        profiled = [(r["M"], r["dtype"], r["kernelName"], r["status"]) for r in csv.DictReader(f)]
    fp16 = [(name, status) for m, dtype, name, status in profiled if dtype == "torch.float16"
            and m == "5"]
    assert fp16[0] == (TORCH_DEQUANT_LINEAR, "ok")
    assert all(status == "ok" for _, status in fp16), fp16
    assert sum(name.startswith("triton.w4:") for name, _ in fp16) >= 2
    if not torch.cuda.is_available():
        bf16 = [status for m, dtype, name, status in profiled
                if dtype == "torch.bfloat16" and name.startswith("triton.w4:")]
        assert bf16 and all(status == "refused" for status in bf16), bf16


def test_tuner_packed_keys_time_packed_weights_and_only_kernels_that_read_them(tmp_path):
    """A key with ``packed``: the weight is packed before the candidates run; the baseline is
    the unpacking torch backend, triton.w4 (which reads weights as quantised) is not offered,
    and a K without a packed layout fails that shape alone, saying why."""
    import csv
    from gemmtune.families.a16w4.tuner import A16w4Tuner
    from gemmtune.tables.store import read_table

    summary, log = _tune(tmp_path, "M,N,K,dtype,packed\n5,40,128,torch.float16,True\n"
                                   "5,40,96,torch.float16,True\n")
    assert summary.tuned == 1 and len(summary.failed) == 1, log
    assert "not a multiple of 128" in log
    (row,) = read_table(tmp_path / "t.csv", A16w4Tuner.schema).rows
    assert row.key == A16w4Key(5, 40, 128, "torch.float16", True)
    with open(tmp_path / "prof.csv") as f:
        names = [r["kernelName"] for r in csv.DictReader(f) if r["K"] == "128"]
    assert names[0] == TORCH_UNPACK_DEQUANT_LINEAR
    assert not any(name.startswith("triton.w4:") for name in names)
    if not torch.cuda.is_available():
        assert row.kernel_names(A16w4Tuner.schema) == (TORCH_UNPACK_DEQUANT_LINEAR,)


def test_gradients_flow_to_x_and_bias_whichever_kernel_runs(a16w4_table):
    """With x (or the bias) requiring grad the call goes through the custom op, whose backward
    gives x's gradient through the dequantised weight and the bias's: the same for the torch
    backend and a triton.w4 row (whose forward has no autograd of its own)."""
    M, N, K = 4, 40, 64
    x, wq, ws, bias = operands(M, N, K, torch.float16, seed=5)
    w = quant.dequant_mxfp4(wq, ws)
    for row in (None, W4):
        if row is not None:
            a16w4_table((M, N, K, "torch.float16", row))
        xg, bg = x.clone().requires_grad_(), bias.clone().requires_grad_()
        y = gemmtune.gemm_a16w4(xg, wq, ws, bg)
        grad = randn(M, N, gen=generator(6)).to(torch.float16)
        y.backward(grad)
        assert_close_to_reference(y.detach(), x, wq, ws, bias)
        ref_x = grad.float() @ w
        assert ((xg.grad.float() - ref_x).norm() / ref_x.norm()).item() < 1e-2, row
        assert torch.allclose(bg.grad.float(), grad.float().sum(0), rtol=1e-2, atol=1e-2), row


def test_a_bias_of_another_dtype_is_added_in_fp32_by_both_backends(a16w4_table):
    """A float32 bias with bf16 x: added in fp32 and rounded once, by the torch backend as by
    the Triton kernel (within the output's rounding of each other)."""
    M, N, K = 3, 40, 64
    x, wq, ws, _ = operands(M, N, K, seed=7, with_bias=False)
    bias = torch.full((N,), 3000.0, device=DEVICE) + randn(N, gen=generator(8))
    ref = gemm_a16w4_ref(x, wq, ws, bias)
    by_torch = gemmtune.gemm_a16w4(x, wq, ws, bias)
    a16w4_table((M, N, K, "torch.bfloat16", W4))
    by_triton = gemmtune.gemm_a16w4(x, wq, ws, bias)
    for y in (by_torch, by_triton):
        assert ((y.float() - ref).abs() <= ref.abs() * 2 ** -8).all()


def test_k_not_a_multiple_of_32_says_so():
    x = torch.randn(2, 48, dtype=torch.bfloat16, device=DEVICE)
    wq = torch.zeros(8, 24, dtype=torch.uint8, device=DEVICE)
    ws = torch.zeros(8, 1, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="K=48 is not a multiple of 32"):
        gemmtune.gemm_a16w4(x, wq, ws)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a stand-in for a compiled kernel; on a GPU, "
                           "test_gpu_real_sizes_through_a_row records and replays real ones")
def test_the_w4_launch_can_be_recorded_for_replay(monkeypatch):
    """A triton.w4 launch puts its tensors first, in roles a recording can place (x, w,
    scale_b, scale_a, bias, out): dispatch replays it like the other kernels' (run on a GPU by
    test_gpu_real_sizes_through_a_row)."""
    from gemmtune.kernels.triton import _replay, gemm_w4
    from gemmtune.kernels.triton._replay import Replay
    from gemmtune.kernels.triton.dispatchable import W4_PREFIX, _kernel_module

    monkeypatch.setattr(_replay, "current_stream", lambda device: 0)
    class Compiled:  # stands in for Triton's compiled kernel (no GPU here)
        function = packed_metadata = None

        def __getitem__(self, grid):
            return None

    x, wq, ws, bias = operands(5, 40, 64)
    y = torch.empty(5, 40, dtype=x.dtype, device=DEVICE)
    module = _kernel_module(W4_PREFIX)
    assert module.module is gemm_w4
    roles = (x, wq, y, bias, None, ws)
    one = gemm_w4.w4_call(x, wq, bias, y, None, ws, gemm_w4.W4Config(16, 32, 64, 4, 1))
    replay = Replay.record(one, Compiled(), roles, 0)
    # x stands in for the absent x scale, the output for the workspace of one split (neither
    # read).
    assert replay is not None and replay._lead_roles == (0, 1, 5, 0, 3, 2, 2, 2)
    split = gemm_w4.w4_call(x, wq, bias, y, None, ws, gemm_w4.W4Config(16, 32, 32, 4, 1, 2))
    # On the CPU the partials are made per call, which a recording must not keep.
    assert Replay.record(split, Compiled(), roles, 0) is None

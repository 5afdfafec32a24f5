"""gemm_a16w16 dispatch through the tables, logging, misses, capture, torch.compile, nn patching."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import gemmtune
from gemmtune.kernels.torch_ref import gemm_a16w16_ref
from gemmtune.families.bf16.op import DISPATCH
from gemmtune.tables.lookup import Rule
from gemmtune.families import get_family
from gemmtune.tables.store import read_table

# A shape without a row runs torch here, even where shipped Triton JSON defaults would name
# a Triton kernel for it on a GPU (tests/test_triton_json.py tests those).
pytestmark = pytest.mark.usefixtures("without_shipped_json")

BF16_SCHEMA = get_family("bf16").schema

HEADER = "arch,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,kernelName,err_ratio,tflops,bw\n"
TILE = "triton.tile:BM16.BN16.BK16.G1.W4.S1"


# Without a GPU the Triton kernels run in the interpreter on CPU tensors; on a GPU machine the
# same tests run the real kernels on the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def row(m, n, k, kernel, dtype="torch.float32", bias=False, us=1.0):
    dev = gemmtune.current_device()
    return (f"{dev.arch},{dev.cu_num},{m},{n},{k},{bias},{dtype},{dtype},False,False,x,0,0,{us},"
            f"{kernel},0,0,0\n")


@pytest.fixture
def user_table(tmp_path, monkeypatch):
    """Install a user table (replacing the shipped ones) and return a writer for its rows."""
    path = tmp_path / "bf16_user.csv"

    def install(*rows: str) -> Path:
        path.write_text(HEADER + "".join(rows))
        monkeypatch.setenv("GEMMTUNE_CONFIG_BF16", f"replace:{path}")
        gemmtune.reset()
        return path

    return install


def fresh(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE).to(dtype)


def plan_for(m, n, k, dtype=torch.float32, bias=False):
    device_index = torch.empty(0, device=DEVICE).get_device()
    return DISPATCH.plans[(m, n, k, bias, dtype, dtype, False, False, device_index)]


def _count_triton_calls(monkeypatch) -> list[str]:
    """The names of the Triton kernels called from now on. fp32 calls (these tests') reach the
    kernel's own ``__call__`` on every device: no bound call replays fp32 launches."""
    from gemmtune.kernels.triton.dispatchable import TritonKernel

    names, real = [], TritonKernel.__call__
    monkeypatch.setattr(TritonKernel, "__call__",
                        lambda self, *a, **kw: names.append(self.name) or real(self, *a, **kw))
    return names


def test_default_is_torch_and_matches_reference():
    x, w, b = fresh(3, 5, 24), fresh(40, 24, seed=1), fresh(40, seed=2)
    y = gemmtune.gemm_a16w16(x, w, b)
    assert y.shape == (3, 5, 40)
    torch.testing.assert_close(y, gemm_a16w16_ref(x, w, b), rtol=1e-5, atol=1e-5)
    plan = plan_for(15, 40, 24, bias=True)
    assert plan.decision.rule is Rule.default and plan.decision.kernel_name == "torch.linear"


def test_row_routes_to_triton_kernel(user_table, monkeypatch):
    user_table(row(16, 40, 24, TILE))
    x, w = fresh(13, 24), fresh(40, 24, seed=1)  # M=13 pads to the M=16 row
    y = gemmtune.gemm_a16w16(x, w)
    torch.testing.assert_close(y, gemm_a16w16_ref(x, w), rtol=1e-4, atol=1e-4)
    plan = plan_for(13, 40, 24)
    assert plan.decision.rule is Rule.padded and plan.run.config.name == TILE
    launches = _count_triton_calls(monkeypatch)
    y2 = gemmtune.gemm_a16w16(x, w)
    assert launches == [TILE]
    torch.testing.assert_close(y2, y)


def test_unparseable_kernel_name_falls_back_with_one_warning(user_table):
    path = user_table(row(8, 16, 16, "triton.tile:BM16.BOGUS"))
    table = path.read_text()
    x, w = fresh(8, 16), fresh(16, 16, seed=1)
    with pytest.warns(UserWarning, match=r"BOGUS.*bf16_user\.csv:2.*family default") as record:
        y1 = gemmtune.gemm_a16w16(x, w)
        y2 = gemmtune.gemm_a16w16(x, w)
    assert len(record) == 1
    torch.testing.assert_close(y1, gemm_a16w16_ref(x, w))
    torch.testing.assert_close(y2, y1)
    decision = plan_for(8, 16, 16).decision
    assert decision.rule is Rule.default and decision.kernel_name == "torch.linear"
    assert path.read_text() == table  # the bad row is skipped, never rewritten or removed


def test_unknown_backend_falls_back(user_table):
    user_table(row(8, 16, 16, "cutlass.sm90:foo"))
    with pytest.warns(UserWarning, match="no backend for kernelName 'cutlass.sm90:foo'"):
        gemmtune.gemm_a16w16(fresh(8, 16), fresh(16, 16, seed=1))


def test_misses_counted_per_call():
    w = fresh(16, 16)
    for _ in range(3):
        gemmtune.gemm_a16w16(fresh(2, 16), w)
    gemmtune.gemm_a16w16(fresh(5, 16), w)
    misses = gemmtune.report_misses()
    assert [(m.shape["M"], m.calls, m.rule) for m in misses] == [(2, 3, Rule.default),
                                                                  (5, 1, Rule.default)]
    assert "torch.linear" in gemmtune.format_misses(misses)


def test_exact_hits_are_not_misses(user_table):
    user_table(row(4, 16, 16, "torch.linear"))
    gemmtune.gemm_a16w16(fresh(4, 16), fresh(16, 16))
    assert gemmtune.report_misses() == []


def test_log_each_decision_once(user_table, monkeypatch, caplog):
    user_table(row(4, 16, 16, "torch.linear"))
    monkeypatch.setenv("AITER_LOG_TUNED_CONFIG", "1")
    with caplog.at_level(logging.INFO, logger="gemmtune"):
        for _ in range(3):
            gemmtune.gemm_a16w16(fresh(4, 16), fresh(16, 16))
    lines = [r.getMessage() for r in caplog.records if r.name == "gemmtune"]
    assert len(lines) == 1
    assert "bf16 M=4 N=16 K=16" in lines[0] and "rule=exact" in lines[0]
    assert "kernelName=torch.linear" in lines[0] and "bf16_user.csv:2" in lines[0]


def test_bad_inputs_have_clear_errors():
    with pytest.raises(ValueError, match=r"x \(2, 8\) and w \(4, 9\) do not multiply"):
        gemmtune.gemm_a16w16(fresh(2, 8), fresh(4, 9))
    with pytest.raises(TypeError, match="cast one to match"):
        gemmtune.gemm_a16w16(fresh(2, 8), fresh(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"bias has shape \(3,\) on .*; expected \(4,\)"):
        gemmtune.gemm_a16w16(fresh(2, 8), fresh(4, 8), fresh(3))


def test_output_dtype_and_scales():
    x, w = fresh(3, 32, dtype=torch.bfloat16), fresh(8, 32, seed=1, dtype=torch.bfloat16)
    y = gemmtune.gemm_a16w16(x, w, otype=torch.float32)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, gemm_a16w16_ref(x, w, out_dtype=torch.float32))
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sa, sb = torch.tensor([0.5], device=DEVICE), torch.tensor([2.0], device=DEVICE)
    y = gemmtune.gemm_a16w16(xq, wq, scale_a=sa, scale_b=sb)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, gemm_a16w16_ref(xq, wq, None, torch.bfloat16, sa, sb))


def test_gradients_flow_through_the_op():
    x = fresh(4, 8).requires_grad_()
    w = fresh(6, 8, seed=1).requires_grad_()
    b = fresh(6, seed=2).requires_grad_()
    gemmtune.gemm_a16w16(x, w, b).square().sum().backward()
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(x2, w2, b2).square().sum().backward()
    for got, want in ((x.grad, x2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------------------- nn
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.blocks = nn.Sequential(nn.Linear(32, 32, bias=False), nn.ReLU())
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return self.down(self.blocks(self.act(self.up(x))))


def test_patch_linear_shares_weights_and_matches():
    torch.manual_seed(0)
    model = Tiny().eval()
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        want = model(x)
    before = [(m, m.weight) for m in model.modules() if isinstance(m, nn.Linear)]
    assert gemmtune.patch_linear(model) == 3
    after = [(m, m.weight) for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(type(m) is gemmtune.TunedLinear for m, _ in after)
    assert all(a is b and wa is wb for (a, wa), (b, wb) in zip(before, after))
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    assert len(gemmtune.report_misses()) == 3  # every call went through the dispatcher
    assert gemmtune.patch_linear(model) == 0  # idempotent


def test_patch_linear_keeps_hooks_and_skips_wrapped_layers():
    model = Tiny().eval()
    seen = []
    model.up.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    original = model.down.forward
    model.down.forward = lambda x: original(x) * 2  # an offloading-style wrapper
    assert gemmtune.patch_linear(model) == 2
    assert type(model.down) is nn.Linear
    with torch.no_grad():
        model(torch.randn(2, 16))
    assert seen == [torch.Size([2, 32])]


def test_patch_linear_under_autocast_matches_linear():
    torch.manual_seed(0)
    model = Tiny().eval()
    x = torch.randn(4, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
        gemmtune.patch_linear(model)
        assert not DISPATCH.plans
        got = model(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    # Each of the three layers ran through gemmtune's op, on inputs autocast made bf16.
    planned = sorted((k[0], k[1], k[2], k[4]) for k in DISPATCH.plans)
    assert planned == [(4, 8, 32, torch.bfloat16), (4, 32, 16, torch.bfloat16),
                       (4, 32, 32, torch.bfloat16)]


def test_autocast_casts_w_first_and_x_after_it():
    """A kernel launched with PDL may read w before it waits for the kernel before it: under
    autocast a w cast for the call is followed by x's cast, or a copy of x where it needs none,
    so that w's cast is never the GEMM's last predecessor."""
    from gemmtune.families.bf16 import op

    x, w = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.profiler.profile(record_shapes=True) as prof:
        x2, w2, bias = op._autocast(x, w, None, None, None)
    assert w2.dtype == x2.dtype == torch.bfloat16 and bias is None
    assert x2.data_ptr() != x.data_ptr() and torch.equal(x2, x)
    copied = [e.input_shapes[0] for e in prof.events() if e.name == "aten::_to_copy"]
    assert copied == [[8, 16], [4, 16]]  # w, then x
    with torch.autocast("cpu", dtype=torch.bfloat16):  # w already bf16: nothing copied
        x3, w3, _ = op._autocast(x, w2, None, None, None)
    assert x3 is x and w3 is w2


def test_torch_compile_fullgraph_with_tuned_linear():
    torch.manual_seed(0)
    model = Tiny().eval()
    gemmtune.patch_linear(model)
    ops_in_graph = []

    def counting_backend(gm, example_inputs):
        ops_in_graph.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, backend=counting_backend, dynamic=True)
    with torch.no_grad():
        for m in (5, 9):  # a second M runs through the fake implementation's symbolic shapes
            x = torch.randn(m, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert ops_in_graph.count(torch.ops.gemmtune.gemm_a16w16.default) == 3


def test_custom_op_is_registered_with_fake():
    x, w = fresh(2, 3, 8), fresh(5, 8)
    y = torch.ops.gemmtune.gemm_a16w16(x, w, None, None, None, None)
    torch.testing.assert_close(y, gemm_a16w16_ref(x, w))
    torch.library.opcheck(torch.ops.gemmtune.gemm_a16w16.default, (x, w, None, None, None, None))


# ---------------------------------------------------------------------------------- capture
CAPTURE_SCRIPT = textwrap.dedent("""
    import sys, torch, gemmtune
    worker = int(sys.argv[1])
    w = torch.randn(16, 8)
    for m in range(1, 26):            # 25 shapes shared by all workers
        gemmtune.gemm_a16w16(torch.randn(m, 8), w)
        gemmtune.gemm_a16w16(torch.randn(m, 8), w)   # a repeat must not be recorded twice
    gemmtune.gemm_a16w16(torch.randn(100 + worker, 8), w)   # one shape of its own
""")


def _env_for_children(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GEMMTUNE_", "AITER_"))}
    env["GEMMTUNE_CACHE_DIR"] = os.environ["GEMMTUNE_CACHE_DIR"]
    env.update(extra)
    return env


def test_capture_from_four_concurrent_processes_loses_no_shape(tmp_path):
    script = tmp_path / "work.py"
    script.write_text(CAPTURE_SCRIPT)
    shards = tmp_path / "shards"
    env = _env_for_children(GEMMTUNE_TUNE_GEMM="1", GEMMTUNE_CAPTURE_DIR=str(shards))
    procs = [subprocess.Popen([sys.executable, str(script), str(i)], env=env) for i in range(4)]
    assert [p.wait(300) for p in procs] == [0, 0, 0, 0]
    assert len(list((shards / "bf16").glob("*.csv"))) == 4
    out = tmp_path / "captured"
    from gemmtune.tables.capture import merge_captures

    (report,) = merge_captures(shards, out, {"bf16": BF16_SCHEMA})
    assert report.new_shapes == 29 and report.errors == []
    rows = read_table(out / "bf16_untuned_gemm.csv", BF16_SCHEMA, untuned=True).rows
    assert sorted(r.key.M for r in rows) == list(range(1, 26)) + [100, 101, 102, 103]
    assert {r.key[1:] for r in rows} == {(16, 8, False, "torch.float32", "torch.float32", False,
                                          False)}
    assert not list((shards / "bf16").glob("*.csv"))  # merged shards are removed


def test_capture_off_records_nothing(tmp_path):
    script = tmp_path / "work.py"
    script.write_text(CAPTURE_SCRIPT)
    shards = tmp_path / "shards"
    env = _env_for_children(GEMMTUNE_CAPTURE_DIR=str(shards))
    assert subprocess.call([sys.executable, str(script), "0"], env=env) == 0
    assert not shards.exists()


def test_cli_capture_runs_command_and_merges_into_existing(tmp_path):
    script = tmp_path / "work.py"
    script.write_text(CAPTURE_SCRIPT)
    out = tmp_path / "shapes"
    out.mkdir()
    (out / "bf16_untuned_gemm.csv").write_text(
        "M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle\n7777,1,1,False,dtypes.bf16,dtypes.bf16,"
        "False,False\n")
    result = subprocess.run(
        [sys.executable, "-m", "gemmtune.cli", "capture", "-o", str(out), "--", sys.executable,
         str(script), "0"], env=_env_for_children(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "bf16: 26 new shape(s)" in result.stdout
    rows = read_table(out / "bf16_untuned_gemm.csv", BF16_SCHEMA, untuned=True).rows
    assert sorted(r.key.M for r in rows) == list(range(1, 26)) + [100, 7777]


def test_truncated_shard_line_is_reported_and_skipped(tmp_path):
    shards = tmp_path / "shards" / "bf16"
    shards.mkdir(parents=True)
    (shards / "host-1.csv").write_text(
        "M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle\n"
        "3,8,8,False,torch.float32,torch.float32,False,False\n4,8,8,Fal")
    from gemmtune.tables.capture import merge_captures

    (report,) = merge_captures(tmp_path / "shards", tmp_path / "out", {"bf16": BF16_SCHEMA})
    assert report.new_shapes == 1 and len(report.errors) == 1
    assert re.search(r"host-1\.csv\.\d+\.merging:3: 4 values for 8 columns", str(report.errors[0]))


def test_row_whose_config_cannot_run_the_shape_falls_back(user_table):
    too_big = "triton.tile:BM256.BN256.BK256.G1.W8.S8"  # shared memory far beyond 227 KiB
    user_table(row(8, 16, 16, too_big))
    x, w = fresh(8, 16), fresh(16, 16, seed=1)
    with pytest.warns(UserWarning, match=r"cannot run this shape: accumulator needs"):
        y = gemmtune.gemm_a16w16(x, w)
    torch.testing.assert_close(y, gemm_a16w16_ref(x, w))
    assert plan_for(8, 16, 16).decision.kernel_name == "torch.linear"


PERSISTENT = "triton.persistent:BM16.BN16.BK16.G1.W4.S1"


@pytest.mark.parametrize("kernel", [TILE, PERSISTENT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_row_with_leading_dims_and_bias(user_table, dtype, kernel):
    name = {torch.float32: "torch.float32", torch.bfloat16: "torch.bfloat16"}[dtype]
    user_table(row(6, 24, 40, kernel, dtype=name, bias=True))
    x, w, b = fresh(2, 3, 40, dtype=dtype), fresh(24, 40, seed=1, dtype=dtype), fresh(24, seed=2)
    y = gemmtune.gemm_a16w16(x, w, b.to(dtype))
    assert y.shape == (2, 3, 24) and y.dtype == dtype
    assert plan_for(6, 24, 40, dtype=dtype, bias=True).decision.kernel_name == kernel
    # bf16 output: rounding to 8 mantissa bits (2^-8 relative) bounds the error.
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(y.float(), gemm_a16w16_ref(x, w, b.to(dtype), torch.float32),
                               rtol=tol, atol=tol)


def test_cached_calls_read_no_variables(monkeypatch):
    """Capture and logging are decided when a shape is planned; a cached call never looks at the
    environment, so with capture off the hot path pays nothing for it."""
    from gemmtune import _env

    x, w = fresh(4, 16), fresh(16, 16, seed=1)
    gemmtune.gemm_a16w16(x, w)  # plans the shape

    def forbidden():
        raise AssertionError("a cached call read an environment variable")

    for name in ("capture_enabled", "log_tuned_config", "table_overlay", "device_override"):
        monkeypatch.setattr(_env, name, forbidden)
    for _ in range(3):
        gemmtune.gemm_a16w16(x, w)


def test_cached_shape_still_rejects_a_bad_scale(user_table):
    xq = fresh(4, 32, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    wq = fresh(16, 32, seed=1, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    one = torch.ones(1, device=DEVICE)
    gemmtune.gemm_a16w16(xq, wq, scale_a=one, scale_b=one)  # plans the shape
    with pytest.raises(ValueError, match=r"scale_a must be a one-element float32"):
        gemmtune.gemm_a16w16(xq, wq, scale_a=torch.ones(4, 1, device=DEVICE), scale_b=one)
    with pytest.raises(ValueError, match=r"scale_b must be a one-element float32"):
        gemmtune.gemm_a16w16(xq, wq, scale_a=one, scale_b=one.to(torch.bfloat16))


def test_a_bad_switch_fails_every_call_not_just_the_first(monkeypatch):
    monkeypatch.setenv("GEMMTUNE_LOG_TUNED_CONFIG", "2")
    for _ in range(2):
        with pytest.raises(ValueError, match="GEMMTUNE_LOG_TUNED_CONFIG='2'"):
            gemmtune.gemm_a16w16(fresh(3, 8), fresh(4, 8))


def test_unwritable_capture_dir_warns_once_and_the_op_still_works(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GEMMTUNE_TUNE_GEMM", "1")
    monkeypatch.setenv("GEMMTUNE_CAPTURE_DIR", str(blocker))
    with pytest.warns(UserWarning, match="shape capture could not write") as record:
        gemmtune.gemm_a16w16(fresh(3, 8), fresh(4, 8))
        gemmtune.gemm_a16w16(fresh(5, 8), fresh(4, 8))
    assert len(record) == 1


def test_lookup_shows_what_the_op_runs_for_an_unusable_row(user_table, capsys):
    from gemmtune.cli import main

    user_table(row(8, 16, 16, "triton.tile:BM512.BN16.BK16.G1.W4.S1"))
    dev = gemmtune.current_device()
    with pytest.warns(UserWarning, match="cannot run this shape"):
        assert main(["lookup", "bf16", "M=8", "N=16", "K=16", "dtype=fp32", "outdtype=fp32",
                     "--device", str(dev)]) == 0
    out = capsys.readouterr().out
    assert "rule:       default" in out and "kernelName: torch.linear" in out
    assert "row kernel unusable: triton.tile:BM512" in out
    gemmtune.gemm_a16w16(fresh(8, 16), fresh(16, 16))
    assert plan_for(8, 16, 16).decision.kernel_name == "torch.linear"


def test_capture_threads_of_one_process_and_a_merge_during_writing(tmp_path):
    import threading

    from gemmtune.tables.capture import merge_captures, record_shape

    schema = BF16_SCHEMA
    shards, out = tmp_path / "shards", tmp_path / "out"

    def writer(start):
        for m in range(start, start + 50):
            record_shape(schema, (m, 8, 8, False, "torch.float32", "torch.float32", False, False),
                         shards)

    threads = [threading.Thread(target=writer, args=(1 + 50 * i,)) for i in range(8)]
    for t in threads:
        t.start()
    reports = []
    while any(t.is_alive() for t in threads):
        reports += merge_captures(shards, out, {"bf16": BF16_SCHEMA})  # merging while the writers append
    for t in threads:
        t.join()
    reports += merge_captures(shards, out, {"bf16": BF16_SCHEMA})
    assert all(not r.errors for r in reports)  # no duplicated header, no torn line
    rows = read_table(out / "bf16_untuned_gemm.csv", schema, untuned=True).rows
    assert sorted(r.key.M for r in rows) == list(range(1, 401))


# ------------------------------------------------------------------------- a kernel by name
def test_a_kernel_forced_by_name_runs_instead_of_the_table(user_table, monkeypatch):
    user_table(row(13, 40, 24, "torch.linear"))
    x, w = fresh(13, 24), fresh(40, 24, seed=1)
    y = gemmtune.gemm_a16w16(x, w, kernel=TILE)
    torch.testing.assert_close(y, gemm_a16w16_ref(x, w))
    device = x.get_device()
    forced = DISPATCH.plans[((13, 40, 24, False, torch.float32, torch.float32, False, False,
                              device), TILE)]
    assert forced.decision.rule is Rule.forced and forced.run.config.name == TILE
    assert not forced.miss and gemmtune.report_misses() == []  # a forced call is no miss
    launches = _count_triton_calls(monkeypatch)
    gemmtune.gemm_a16w16(x, w, kernel=TILE)
    gemmtune.gemm_a16w16(x, w)  # the same shape without kernel= keeps the table's row
    assert launches == [TILE]
    assert plan_for(13, 40, 24).decision.kernel_name == "torch.linear"


def test_a_forced_kernel_is_checked_like_a_table_row():
    x, w = fresh(13, 24), fresh(40, 24, seed=1)
    with pytest.raises(ValueError, match="no backend for kernelName 'cutlass:x'; known "
                                         "prefixes: torch.linear, triton.tile"):
        gemmtune.gemm_a16w16(x, w, kernel="cutlass:x")
    with pytest.raises(ValueError, match=r"triton.tile:BM16.BOGUS.*expected 6 to 7: triton.tile:BM<int>"):
        gemmtune.gemm_a16w16(x, w, kernel="triton.tile:BM16.BOGUS")
    # A config that parses but cannot run this shape: the kernel's own reason.
    too_big = "triton.tile:BM256.BN256.BK256.G1.W1.S8"
    with pytest.raises(ValueError, match=r"cannot run this shape: accumulator needs"):
        gemmtune.gemm_a16w16(x, w, kernel=too_big)
    assert gemmtune.gemm_a16w16(x, w).shape == (13, 40)  # nothing was cached by the errors


def test_a_forced_kernel_reaches_the_op_under_torch_compile():
    x, w = fresh(13, 24), fresh(40, 24, seed=1)
    compiled = torch.compile(lambda a, b: gemmtune.gemm_a16w16(a, b, kernel=TILE),
                             fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, w), gemm_a16w16_ref(x, w))
    assert any(isinstance(k[0], tuple) and k[1] == TILE for k in DISPATCH.plans)


def test_a_forced_call_leaves_the_miss_report_alone():
    x, w = fresh(13, 24), fresh(40, 24, seed=1)
    gemmtune.gemm_a16w16(x, w)
    gemmtune.gemm_a16w16(x, w, kernel=TILE)
    gemmtune.gemm_a16w16(x, w)
    (miss,) = gemmtune.report_misses()
    assert (miss.rule, miss.kernel_name, miss.calls) == (Rule.default, "torch.linear", 2)


def test_an_empty_gemm_runs_the_default_and_is_not_captured(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_TUNE_GEMM", "1")
    monkeypatch.setenv("GEMMTUNE_CAPTURE_DIR", str(tmp_path / "shards"))
    b = fresh(8)
    y = gemmtune.gemm_a16w16(fresh(3, 0), fresh(8, 0), b)  # K = 0: the empty sum, plus bias
    torch.testing.assert_close(y, b.expand(3, 8))
    plan = plan_for(3, 8, 0, bias=True)
    assert plan.decision.rule is Rule.default and "K=0 is out of range" in plan.decision.note
    assert not (tmp_path / "shards").exists()  # no untuned row the tuner could not read


@pytest.mark.parametrize("M, N, K", [(0, 8, 256), (3, 0, 256), (3, 8, 0), (3, 128, 0)])
def test_empty_scaled_gemms_give_zeros_plus_bias(M, N, K):
    """FP8 GEMMs with M, N or K of 0 (x of 3 dimensions) return their shape: zeros plus the
    bias, for per-token and block scales alike (``reshape(-1, 0)`` had made K = 0 raise), on
    the first call and on the remembered one after it (N = 128: the block-wise cuBLAS path's
    N)."""
    fp8 = torch.float8_e4m3fn
    xq, wq = fresh(M, 2, K, seed=2).to(fp8), fresh(N, K, seed=3).to(fp8)
    bias = fresh(N, seed=4).to(torch.bfloat16)
    x_scale, w_scale = fresh(M, 2, 1, seed=5).abs(), fresh(1, N, seed=6).abs()
    blocks = -(-K // 128)
    xs_blocks, ws_blocks = fresh(M, 2, blocks, seed=7).abs(), fresh(-(-N // 128), blocks,
                                                                    seed=8).abs()
    for _ in range(2):
        y = gemmtune.gemm_a8w8(xq, wq, x_scale, w_scale, bias)
        assert y.shape == (M, 2, N)
        if K == 0:
            torch.testing.assert_close(y, bias.expand(M, 2, N))
        y = gemmtune.gemm_a8w8_blockscale(xq, wq, xs_blocks, ws_blocks)
        assert y.shape == (M, 2, N) and (K > 0 or not y.any())


def test_a_forced_triton_kernel_takes_an_empty_sum():
    """A Triton kernel named for a GEMM with K = 0 (x of 3 dimensions), as a call may force it
    or a Triton JSON default may name it: the bias, twice."""
    b = fresh(8)
    for _ in range(2):
        y = gemmtune.gemm_a16w16(fresh(2, 3, 0), fresh(8, 0), b,
                                 kernel="triton.splitk:BM16.BN32.BK64.SK1.W4.S2")
        torch.testing.assert_close(y, b.expand(2, 3, 8))


@pytest.mark.parametrize("N, K", [(0, 16), (5, 0)])
def test_gradients_of_empty_gemms_have_their_inputs_shapes(N, K):
    """Backward through an empty GEMM (x of 3 dimensions): gradients of each input's shape,
    zero for x and w, the 6 rows' sum for the bias (``reshape(-1, 0)`` had made N = 0 raise)."""
    x = fresh(3, 2, K).requires_grad_()
    w, b = fresh(N, K, seed=1).requires_grad_(), fresh(N, seed=2).requires_grad_()
    gemmtune.gemm_a16w16(x, w, b).sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert not x.grad.any() and not w.grad.any()
    assert torch.equal(b.grad, torch.full((N,), 6.0, device=DEVICE))


def test_cublaslt_rows_without_nvmath_fall_back_with_one_warning_in_all(user_table,
                                                                        monkeypatch):
    from gemmtune.kernels.cublaslt import kernels as lt_kernels

    monkeypatch.setattr(lt_kernels, "nvmath_missing",
                        lambda: "nvmath-python is not installed (simulated)")
    name = "cublaslt:id66.tile64x8.stages64xAUTO.sk1.red0.swz0.co1.cl1x1x1.in0"
    user_table(*(row(m, 16, 16, name, dtype="torch.bfloat16") for m in (8, 16, 32)))
    w = fresh(16, 16, seed=1, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="nvmath-python is not installed") as record:
        for m in (8, 16, 32):
            x = fresh(m, 16, seed=m, dtype=torch.bfloat16)
            torch.testing.assert_close(gemmtune.gemm_a16w16(x, w), gemm_a16w16_ref(x, w))
    assert len([w for w in record if "nvmath" in str(w.message)]) == 1


def test_nvmath_is_a_dependency_on_linux():
    import importlib.metadata

    try:
        requires = importlib.metadata.requires("gemmtune") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("gemmtune is not installed here (run from a source tree)")
    assert any(r.startswith("nvmath-python") and "sys_platform == \"linux\"" in r
               and "extra" not in r for r in requires), requires


# ------------------------------------------------------------------- the eager hot path
def test_a_repeated_call_is_served_from_its_call_key_without_planning(monkeypatch):
    from gemmtune.families.bf16 import op

    x, w = fresh(3, 24), fresh(40, 24, seed=1)
    gemmtune.gemm_a16w16(x, w, kernel="torch.linear")
    # A forced (or exactly matched) torch row is F.linear itself: the op adds only its key.
    assert list(op._CALLS.values()) == [torch.nn.functional.linear]
    monkeypatch.setattr(op, "_plan", lambda *a: pytest.fail("a cached call planned again"))
    x2 = fresh(3, 24, seed=3)
    y = gemmtune.gemm_a16w16(x2, w, kernel="torch.linear")
    torch.testing.assert_close(y, gemm_a16w16_ref(x2, w), rtol=1e-5, atol=1e-5)


def test_a_call_differing_from_a_cached_one_in_what_it_checks_is_checked():
    # Same shapes as a cached call, but w of another dtype, a bias of another length: the call
    # key holds every tensor's dtype and shape, so neither reaches the cached kernel.
    x, w = fresh(3, 24), fresh(40, 24, seed=1)
    gemmtune.gemm_a16w16(x, w)
    with pytest.raises(TypeError, match="x is torch.float32 but w is torch.float64"):
        gemmtune.gemm_a16w16(x, w.double())
    with pytest.raises(ValueError, match="bias has shape"):
        gemmtune.gemm_a16w16(x, w, fresh(39, seed=2))


def test_forgetting_the_tables_forgets_the_bound_calls(user_table):
    from gemmtune.families.bf16 import op

    x, w = fresh(16, 32), fresh(16, 32, seed=1)
    gemmtune.gemm_a16w16(x, w)
    assert op._CALLS
    user_table(row(16, 16, 32, TILE))  # a new table: reset
    assert not op._CALLS
    y = gemmtune.gemm_a16w16(x, w)
    assert plan_for(16, 16, 32).decision.kernel_name == TILE
    torch.testing.assert_close(y, gemm_a16w16_ref(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", [TILE, "triton.splitk:BM16.BN16.BK16.SK2.W4.S1",
                                    "triton.gemv:BN8.BK16.SK2.W4.S1"])
def test_bound_triton_calls_match_the_reference_on_fresh_inputs(user_table, kernel):
    # The bound call of a Triton row: every call with a new x (2-D and with leading dims) and
    # a poisoned previous output computes the product afresh. On the GPU in bf16, where calls
    # replay their recorded launch; on the CPU the interpreter's fp32 (no replay there).
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    name = "torch.bfloat16" if DEVICE == "cuda" else "torch.float32"
    user_table(row(13, 24, 32, kernel, dtype=name), row(13, 24, 32, kernel, dtype=name,
                                                         bias=True))
    w, b = fresh(24, 32, seed=1, dtype=dtype), fresh(24, seed=2, dtype=dtype)
    for seed in range(3):
        for x in (fresh(13, 32, seed=10 + seed, dtype=dtype),
                  fresh(1, 13, 32, seed=20 + seed, dtype=dtype)):
            for bias in (None, b):
                y = gemmtune.gemm_a16w16(x, w, bias)
                ref = gemm_a16w16_ref(x, w, bias, torch.float32)
                err = float((y.float() - ref).norm() / ref.norm())
                assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (seed, err)
                y.fill_(float("nan"))


def test_a_gemv_row_serves_the_smaller_m_padded_up_to_it(user_table):
    # The GEMV takes all of x's rows in one program, however many up to 16: the M = 16 row
    # serves M = 1..16 (padded), and M = 17 goes elsewhere.
    gemv = "triton.gemv:BN4.BK32.SK2.W4.S1"
    user_table(row(16, 24, 64, gemv))
    w = fresh(24, 64, seed=1)
    for m in (1, 3, 16):
        x = fresh(m, 64, seed=m)
        torch.testing.assert_close(gemmtune.gemm_a16w16(x, w), gemm_a16w16_ref(x, w),
                                   rtol=1e-5, atol=1e-5)
        decision = plan_for(m, 24, 64).decision
        assert decision.kernel_name == gemv and decision.rule.value in ("exact", "padded"), m
    # The nearest row's kernel cannot take M = 17: the family default serves it, said once.
    with pytest.warns(UserWarning, match="M=17 exceeds 16, the rows of x one GEMV program"):
        gemmtune.gemm_a16w16(fresh(17, 64, seed=17), w)
    assert plan_for(17, 24, 64).decision.kernel_name != gemv


def test_a_plan_made_while_the_tables_change_is_not_kept(monkeypatch):
    # Another thread resetting the tables between the look-up and the caching: the call is
    # served, but neither its plan nor its bound call outlives the reset.
    from gemmtune.families.bf16 import op

    real = DISPATCH._decide_and_resolve

    def decide_then_reset(*args):
        decided = real(*args)
        gemmtune.reset()
        return decided

    monkeypatch.setattr(DISPATCH, "_decide_and_resolve", decide_then_reset)
    x, w = fresh(3, 24), fresh(40, 24, seed=1)
    y = gemmtune.gemm_a16w16(x, w)
    torch.testing.assert_close(y, gemm_a16w16_ref(x, w), rtol=1e-5, atol=1e-5)
    assert not DISPATCH.plans and not op._CALLS


@pytest.mark.parametrize("family,op_module", [
    ("bf16", "gemmtune.families.bf16.op"), ("a8w8", "gemmtune.families.a8w8.op"),
    ("a8w8-blockscale", "gemmtune.families.a8w8_blockscale.op")])
def test_every_shipped_torch_and_triton_row_can_run_its_shape(family, op_module):
    # What dispatch checks once per shape, for every shipped row whose check needs no GPU
    # library (cuBLASLt rows need nvmath and a driver to be checked): a row whose kernel
    # refused its own shape would fall back to the family default, with a warning, at run time.
    import importlib

    from gemmtune.families import get_family
    from gemmtune.tables.sources import configs_dir
    from gemmtune.tables.store import read_table

    # Gluon kernels' rows (triton.frag, triton.ring) run compiled on a Hopper GPU only:
    # elsewhere each must be refused for that reason alone.
    from gemmtune.dispatch import KernelNameError
    from gemmtune.kernels.triton import _checks
    from gemmtune.kernels.triton.dispatchable import GLUON_PREFIXES

    gluon_here = not _checks.interpreted() and torch.cuda.is_available() \
        and torch.cuda.get_device_capability() == (9, 0)
    op = importlib.import_module(op_module)
    schema = get_family(family).schema
    rows = [r for r in read_table(configs_dir() / schema.tuned_file, schema).rows
            if not r.kernel_names(schema)[0].startswith("cublaslt:")]
    assert len(rows) > 50
    for r in rows:
        name = r.kernel_names(schema)[0]
        if name.startswith(tuple(p + ":" for p in GLUON_PREFIXES)) and not gluon_here:
            with pytest.raises(KernelNameError, match="interpreter|written for Hopper"):
                op.REGISTRY.resolve_for(name, op.problem_of(r.key))
            continue
        op.REGISTRY.resolve_for(name, op.problem_of(r.key))

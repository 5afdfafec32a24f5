"""The tuning engine under fault injection: candidates that raise, hang, exit, abort, segfault,
return wrong values, NaN or nothing; kill -9 and resume; concurrent tuners; bad input rows."""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from faulty_family import FaultyFamily
from gemmtune.families import get_family
from gemmtune.tables.store import TableError, read_table
from gemmtune.tune.engine import TuneConfig, Tuner, default_gpus
from gemmtune.tune.family import Candidate, Evaluation, Status, TuneOptions
from gemmtune.measure.gpulock import GpuLock
from gemmtune.tune.records import CrashMemo

A8W8_SCHEMA = get_family("a8w8").schema
BF16 = get_family("bf16").schema

HEADER = "M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle\n"
TESTS = Path(__file__).parent


def untuned(path: Path, ms, extra: str = "") -> Path:
    path.write_text(HEADER + "".join(f"{m},24,40,False,torch.float32,torch.float32,False,False\n"
                                     for m in ms) + extra)
    return path


def tune(tmp_path, inp, **overrides) -> tuple[Tuner, str]:
    out = io.StringIO()
    config = TuneConfig(input=inp, output=tmp_path / "tuned.csv", profile=tmp_path / "prof.csv",
                        timeout=overrides.pop("timeout", 4.0), **overrides)
    tuner = Tuner(FaultyFamily, config, out=out)
    tuner.run()
    return tuner, out.getvalue()


def profile(tmp_path) -> dict[str, str]:
    with open(tmp_path / "prof.csv") as f:
        return {r["kernelName"]: r["status"] for r in csv.DictReader(f)}


def not_ok(profiled: list[dict]) -> str:
    """The profile rows of candidates that did not pass, one line each with the reason."""
    return "\n".join(f"{r['M']}x{r['N']}x{r['K']} {r['kernelName']}: {r['status']} {r['detail']}"
                     for r in profiled if r["status"] != "ok")


def rows(path) -> list[tuple]:
    return sorted((r.key, r.results["kernelName"], r.us) for r in read_table(path, BF16).rows)


def test_every_fault_is_recorded_and_the_correct_winner_kept(tmp_path):
    start = time.monotonic()
    tuner, log = tune(tmp_path, untuned(tmp_path / "u.csv", [7]))
    wall = time.monotonic() - start
    assert tuner.summary.exit_code == 0 and tuner.summary.tuned == 1
    (row,) = read_table(tmp_path / "tuned.csv", BF16).rows
    assert row.results["kernelName"] == "good.fast" and row.us == pytest.approx(5.007)
    assert row.results["timing"] == "synthetic" and row.results["env"] == "test"
    statuses = profile(tmp_path)
    assert statuses == {
        "torch.linear": "ok", "good.fast": "ok", "good.slow": "ok",
        "fault.raise": "error", "fault.hang": "timeout", "fault.exit": "crash",
        "fault.abort": "crash", "fault.segv": "crash", "fault.wrong": "wrong",
        "fault.nan": "wrong", "fault.unwritten": "wrong", "fault.cudaerr": "error",
        "fault.build": "error", "fault.nantime": "error", "fault.retimecrash": "ok",
    }
    # One hang costs the 4 s timeout, not an hour; five lost workers cost a respawn each.
    assert wall < 90
    detail = (tmp_path / "prof.csv").read_text()
    assert "killed by signal SIGSEGV" in detail and "killed by signal SIGABRT" in detail
    assert "exited with status 3" in detail and "no answer within 4 s" in detail
    with open(tmp_path / "prof.csv") as f:
        seconds = {r["kernelName"]: float(r["seconds"]) for r in csv.DictReader(f)}
    assert 4.0 <= seconds["fault.hang"] < 10.0  # waited for the timeout, not longer
    assert "building: RuntimeError: this candidate does not compile" in detail
    assert "timer returned us=nan" in detail
    # fault.retimecrash had the fastest screen (1 us) but crashed when re-timed: it is in the
    # crash memo and did not win (the row above is good.fast).


def test_a_candidate_that_ran_out_of_gpu_memory_gets_a_second_try(tmp_path, monkeypatch):
    # Workers share one GPU: memory another worker held may be free a moment later. A second
    # out-of-memory is recorded as such, and the run says what to do about it.
    monkeypatch.setenv("FAULTY_CANDIDATES",
                       "torch.linear,good.fast,oom.once,oom.always,oom.build,oom.text")
    tuner, log = tune(tmp_path, untuned(tmp_path / "u.csv", [7]))
    assert tuner.summary.tuned == 1 and tuner.summary.exit_code == 0
    assert profile(tmp_path) == {"torch.linear": "ok", "good.fast": "ok", "oom.once": "ok",
                                 "oom.always": "oom", "oom.build": "oom", "oom.text": "oom"}
    (row,) = read_table(tmp_path / "tuned.csv", BF16).rows
    assert row.results["kernelName"] == "oom.once"  # the fastest, once it had its memory
    assert "3 candidate(s) ran out of GPU memory even on a second try" in log
    assert "rows chosen without them (re-tune these shapes with --all and a smaller --mp" in log
    assert tuner.summary.short_of_memory == [row.key]
    assert "OutOfMemoryError: CUDA out of memory" in (tmp_path / "prof.csv").read_text()
    # Not a crasher: a later run with more memory free tries it again.
    assert not any(CrashMemo(BF16).skips("cpu:0", row.key, name, 4.0)
                   for name in ("oom.always", "oom.build", "oom.text"))


def test_a_tuner_given_no_gpu_hides_the_machines_gpus_from_its_workers(tmp_path):
    # Its Triton candidates run in the interpreter, which takes CPU tensors only: a worker that
    # saw a GPU would put the inputs there (seen on H100: every Triton candidate raised).
    config = TuneConfig(input=untuned(tmp_path / "u.csv", [1]), output=tmp_path / "t.csv")
    env = dict(Tuner(FaultyFamily, config, out=io.StringIO())._spec(0).env)
    assert env == {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    pinned = TuneConfig(input=config.input, output=config.output, gpus=("3", "5"), workers=2)
    assert dict(Tuner(FaultyFamily, pinned, out=io.StringIO())._spec(1).env) == {
        "CUDA_VISIBLE_DEVICES": "5"}


def test_finalists_are_timed_together(tmp_path, monkeypatch):
    group_log = tmp_path / "groups.txt"
    monkeypatch.setenv("FAULTY_GROUP_LOG", str(group_log))
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    tuner, _ = tune(tmp_path, untuned(tmp_path / "u.csv", [7]))
    assert tuner.summary.tuned == 1
    # One joint re-timing of the three correct candidates (top 4 of the screen + the simplest).
    assert group_log.read_text().splitlines() == ["good.fast,good.slow,torch.linear"]


def test_a_crash_in_the_joint_retiming_falls_back_to_one_by_one(tmp_path, monkeypatch):
    # fault.retimecrash kills the worker in the joint re-timing; each finalist is then timed
    # alone, which pins the crash on it, and the winner is still the fastest correct one.
    group_log = tmp_path / "groups.txt"
    monkeypatch.setenv("FAULTY_GROUP_LOG", str(group_log))
    monkeypatch.setenv("FAULTY_CANDIDATES", "torch.linear,good.fast,fault.retimecrash")
    tuner, _ = tune(tmp_path, untuned(tmp_path / "u.csv", [7]))
    assert tuner.summary.tuned == 1
    (row,) = read_table(tmp_path / "tuned.csv", BF16).rows
    assert row.results["kernelName"] == "good.fast"
    assert len(group_log.read_text().splitlines()) == 1
    memo = CrashMemo(BF16)
    assert memo.skips("cpu:0", row.key, "fault.retimecrash", 4.0)
    assert not memo.skips("cpu:0", row.key, "good.fast", 4.0)


def test_a_joint_retiming_that_poisons_the_worker_blames_no_finalist(tmp_path, monkeypatch):
    # The joint re-timing raises a sticky CUDA error: the worker is replaced before the finalists
    # are timed one by one, so none of them is taken for a crasher.
    monkeypatch.setenv("FAULTY_GROUP_POISONS", "1")
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    tuner, _ = tune(tmp_path, untuned(tmp_path / "u.csv", [7]))
    assert tuner.summary.tuned == 1
    (row,) = read_table(tmp_path / "tuned.csv", BF16).rows
    assert row.results["kernelName"] == "good.fast"
    memo = CrashMemo(BF16)
    assert not any(memo.skips("cpu:0", row.key, n, 4.0) for n in ("good.fast", "good.slow"))


def test_gpu_lock_is_shared_with_other_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_LOCK_DIR", str(tmp_path))
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from gemmtune.measure.gpulock import GpuLock\n"
         "with GpuLock('7'):\n"
         "    print('held', flush=True)\n"
         "    time.sleep(1.5)\n"],
        stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    assert holder.stdout.readline().strip() == "held"
    start = time.monotonic()
    with GpuLock("7"):
        waited = time.monotonic() - start
    holder.wait(10)
    assert waited >= 0.5  # it waited for the other process to let go
    start = time.monotonic()
    with GpuLock("6"):  # another GPU is not held
        assert time.monotonic() - start < 0.5
    assert GpuLock("cpu").path is None


def test_known_crashers_are_skipped_on_a_rerun(tmp_path):
    inp = untuned(tmp_path / "u.csv", [7])
    tune(tmp_path, inp)
    (tmp_path / "prof.csv").unlink()
    start = time.monotonic()
    tuner, _ = tune(tmp_path, inp, retune_all=True)
    assert time.monotonic() - start < 30  # no timeout paid again
    assert "crash_memo" in (tmp_path / "prof.csv").read_text()  # the skip names the memo file
    statuses = profile(tmp_path)
    for name in ("fault.hang", "fault.exit", "fault.abort", "fault.segv", "fault.cudaerr"):
        assert statuses[name] == "skipped", name
    assert statuses["fault.raise"] == "error"  # a plain exception is not a crasher
    assert tuner.summary.tuned == 1
    # A longer --timeout gives the hung candidate another chance; crashes stay skipped.
    (tmp_path / "prof.csv").unlink()
    tune(tmp_path, inp, retune_all=True, timeout=5.0)
    statuses = profile(tmp_path)
    assert statuses["fault.hang"] == "timeout" and statuses["fault.segv"] == "skipped"


def test_shape_with_no_valid_candidate_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_CANDIDATES", "fault.wrong,fault.raise,fault.unwritten")
    tuner, log = tune(tmp_path, untuned(tmp_path / "u.csv", [3]))
    assert tuner.summary.exit_code == 1 and len(tuner.summary.failed) == 1
    assert "FAILED M=3 N=24 K=40" in log and "no candidate passed" in log
    assert not (tmp_path / "tuned.csv").exists()


def test_bad_input_rows_are_reported_and_the_rest_tuned(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    inp = untuned(tmp_path / "u.csv", [1, 2],
                  extra="zz,24,40,False,torch.float32,torch.float32,False,False\n"
                        "4,24,40,False,torch.float33,torch.float32,False,False\n")
    tuner, log = tune(tmp_path, inp)
    assert "u.csv:4: column M: expected an integer, got 'zz'" in log
    assert "u.csv:5: column dtype: unknown dtype 'torch.float33'" in log
    assert [r[0][0] for r in rows(tmp_path / "tuned.csv")] == [1, 2]
    assert tuner.summary.exit_code == 1  # the user must see that rows were skipped


def test_already_tuned_shapes_are_skipped_unless_all(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    inp = untuned(tmp_path / "u.csv", [1, 2])
    tune(tmp_path, inp)
    tuner, log = tune(tmp_path, untuned(tmp_path / "u2.csv", [1, 2, 3]))
    assert tuner.summary.skipped == 2 and tuner.summary.tuned == 1
    tuner, _ = tune(tmp_path, inp, retune_all=True)
    assert tuner.summary.tuned == 2 and len(rows(tmp_path / "tuned.csv")) == 3


def test_several_workers_on_one_device_give_the_same_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    inp = untuned(tmp_path / "u.csv", range(1, 7))
    tune(tmp_path, inp)
    one = rows(tmp_path / "tuned.csv")
    (tmp_path / "tuned.csv").unlink()
    tuner, log = tune(tmp_path, inp, workers=3)
    assert "with 3 worker(s)" in log and tuner.summary.tuned == 6
    assert rows(tmp_path / "tuned.csv") == one


def test_simpler_candidate_kept_within_noise():
    tuner = Tuner.__new__(Tuner)
    by_name = {"torch.linear": Candidate("torch.linear", "torch", simplicity=0),
               "k": Candidate("k", "triton")}
    near = [Evaluation("torch.linear", Status.ok, us=10.0, spread=0.01),
            Evaluation("k", Status.ok, us=9.9, spread=0.01)]
    assert tuner._choose(near, by_name).name == "torch.linear"  # 1% faster: within 2% noise
    far = [Evaluation("torch.linear", Status.ok, us=10.0, spread=0.01),
           Evaluation("k", Status.ok, us=9.0, spread=0.01)]
    assert tuner._choose(far, by_name).name == "k"
    noisy = [Evaluation("torch.linear", Status.ok, us=10.0, spread=0.15),
             Evaluation("k", Status.ok, us=9.0, spread=0.01)]
    assert tuner._choose(noisy, by_name).name == "torch.linear"  # 10% gain inside 15% spread


def test_gemm_ties_keep_cublaslts_own_pick_then_torchs_row():
    from gemmtune.families._gemm_tuner import CUBLASLT_PICK_SIMPLICITY, TORCH_ROW_SIMPLICITY

    tuner = Tuner.__new__(Tuner)
    by_name = {"torch.linear": Candidate("torch.linear", "torch", TORCH_ROW_SIMPLICITY),
               "cublaslt:pick": Candidate("cublaslt:pick", "cublaslt", CUBLASLT_PICK_SIMPLICITY),
               "cublaslt:other": Candidate("cublaslt:other", "cublaslt"),
               "triton.tile:k": Candidate("triton.tile:k", "triton")}

    names = {"torch": "torch.linear", "pick": "cublaslt:pick", "other": "cublaslt:other",
             "tile": "triton.tile:k"}

    def pick(**us):
        return tuner._choose([Evaluation(names[n], Status.ok, us=t, spread=0.01)
                              for n, t in us.items()], by_name).name

    # Within 2% noise of each other: cuBLASLt's own pick (a cheaper call than torch's row).
    assert pick(torch=10.0, pick=10.05, tile=9.9) == "cublaslt:pick"
    assert pick(torch=10.0, pick=10.1) == "cublaslt:pick"
    # Without it, torch's row over a tuned kernel; beyond the noise, the fastest.
    assert pick(torch=10.0, other=9.9) == "torch.linear"
    assert pick(torch=10.0, pick=10.5, tile=9.0) == "triton.tile:k"
    assert pick(torch=10.0, pick=10.5) == "torch.linear"


def test_fp8_splitk_configs_run_beside_their_promoted_twins_over_long_k():
    from gemmtune.families._gemm_tuner import FAST_FP8_SIMPLICITY, triton_splitk_candidates
    from gemmtune.kernels.triton._checks import why_not_promote
    from gemmtune.kernels.triton.gemm_splitk import SplitKConfig

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16

    def candidates(m, k, dtype=fp8, block_scales=False):
        return {c.name: c for c in triton_splitk_candidates(m, 4096, k, dtype, bf16,
                                                            block_scales)}

    for m in (16, 64):  # swapped (M <= 64) and unswapped wgmma dots both get twins
        found = candidates(m, 8192)
        fast = [c for c in found.values() if c.simplicity == FAST_FP8_SIMPLICITY]
        assert fast
        for c in fast:
            config = SplitKConfig.from_name(c.name)
            assert config.promote_k == 0 and 8192 // config.split_k >= 2048
            twin = dataclasses.replace(config, promote_k=min(config.block_k, 128))
            assert found[twin.name].simplicity == 2 and found[twin.name].splitk == c.splitk
        # A config that is no wgmma dot (mma.sync sums in fp32 already) has no twin.
        assert any(why_not_promote(dataclasses.replace(SplitKConfig.from_name(name),
                                                       promote_k=128), fp8)
                   for name in found)
        assert {c.simplicity for c in found.values()} == {2, FAST_FP8_SIMPLICITY}
    # Short K per split, bf16, block scales: no twins, every config as tuned before.
    for found in (candidates(16, 1024), candidates(16, 8192, bf16),
                  candidates(16, 8192, block_scales=True)):
        assert found and all(c.simplicity == 2 and SplitKConfig.from_name(name).promote_k == 0
                             for name, c in found.items())


def test_promoted_twin_kept_unless_the_fast_config_wins_beyond_noise():
    from gemmtune.families._gemm_tuner import FAST_FP8_SIMPLICITY

    tuner = Tuner.__new__(Tuner)
    by_name = {"torch": Candidate("torch", "torch", simplicity=1),
               "fast": Candidate("fast", "triton", simplicity=FAST_FP8_SIMPLICITY),
               "twin": Candidate("twin", "triton")}

    def pick(**us):
        return tuner._choose([Evaluation(n, Status.ok, us=t, spread=0.005)
                              for n, t in us.items()], by_name).name

    assert pick(torch=12.0, fast=10.0, twin=10.15) == "twin"  # 1.5% slower: within the noise
    assert pick(torch=12.0, fast=10.0, twin=10.6) == "fast"
    assert pick(torch=10.1, fast=9.95, twin=10.6) == "torch"


def test_retiming_takes_the_fastest_of_each_simplicity_beside_the_top_few(tmp_path):
    tuner = Tuner.__new__(Tuner)
    tuner.config = TuneConfig(input=tmp_path / "in.csv", output=tmp_path / "out.csv", topk=2)
    seen = []
    tuner._retime_together = lambda worker, key, seed, chosen: seen.append(sorted(chosen)) or []
    by_name = {"torch.linear": Candidate("torch.linear", "torch", 1),
               "cublaslt:pick": Candidate("cublaslt:pick", "cublaslt", 0),
               "cublaslt:other": Candidate("cublaslt:other", "cublaslt")}
    by_name.update((f"triton.tile:k{i}", Candidate(f"triton.tile:k{i}", "triton"))
                   for i in range(3))
    screened = [Evaluation(name, Status.ok, us=us) for name, us in [
        ("triton.tile:k0", 5.0), ("triton.tile:k1", 5.5), ("triton.tile:k2", 6.0),
        ("cublaslt:other", 6.5), ("torch.linear", 7.0), ("cublaslt:pick", 8.0)]]
    tuner._retime(None, "cuda", (1,), 0, screened, by_name)
    assert seen == [["cublaslt:pick", "torch.linear", "triton.tile:k0", "triton.tile:k1"]]


def test_update_improved_keeps_rows_without_enough_gain(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    inp = untuned(tmp_path / "u.csv", [1, 2])
    tune(tmp_path, inp)
    path = tmp_path / "tuned.csv"
    text = path.read_text().replace(",5.001,", ",5.1,").replace(",5.002,", ",4.0,")
    path.write_text(text)
    tuner, log = tune(tmp_path, inp, update_improved=True, min_improvement_pct=1.0, compare=True)
    assert {r[0][0]: r[2] for r in rows(path)} == {1: 5.001, 2: 4.0}
    assert tuner.summary.kept_old == 1 and tuner.summary.tuned == 1
    assert "old us" in log


# ------------------------------------------------------------------------ whole-process runs
@pytest.fixture(autouse=True)
def _no_leftover_tuners():
    """A failing test must not leave tuner processes running."""
    yield
    for proc in _started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _started.clear()


_started: list[subprocess.Popen] = []


def _runner(args, env_extra=None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               FAULTY_WITH_FAULTS="0", FAULTY_TIME_SLEEP="0.1")
    env.update(env_extra or {})
    proc = subprocess.Popen([sys.executable, str(TESTS / "run_faulty_tuner.py"), *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _started.append(proc)
    return proc


def _count_rows(path: Path) -> int:
    try:
        return len(read_table(path, BF16).rows)
    except (FileNotFoundError, TableError):
        return 0


def test_kill_9_at_random_moments_then_resume_gives_the_same_rows(tmp_path):
    inp = untuned(tmp_path / "u.csv", range(1, 13))
    ref_out, out = tmp_path / "ref.csv", tmp_path / "resumed.csv"
    assert _runner(["-i", str(inp), "-o", str(ref_out), "--batch", "2"]).wait(300) == 0
    rng = random.Random(1234)
    args = ["-i", str(inp), "-o", str(out), "--batch", "2"]
    partial = []
    for _ in range(3):
        # Kill at a random moment once the run has made progress (its startup time varies a
        # lot between machines), so every kill lands in the middle of real work.
        before = _count_rows(out)
        proc = _runner(args)
        deadline = time.monotonic() + 120
        while _count_rows(out) <= before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.6))
        if proc.poll() is not None:
            break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        partial.append(_count_rows(out))
    assert _runner(args).wait(300) == 0
    assert partial and all(0 < n < 12 for n in partial), partial  # killed mid-run each time
    assert rows(out) == rows(ref_out)
    assert len(rows(out)) == 12


def test_two_tuners_writing_one_output_lose_no_rows(tmp_path):
    a = untuned(tmp_path / "a.csv", range(1, 7))
    b = untuned(tmp_path / "b.csv", range(101, 107))
    out = tmp_path / "shared.csv"
    procs = [_runner(["-i", str(p), "-o", str(out), "--batch", "1"]) for p in (a, b)]
    assert [p.wait(300) for p in procs] == [0, 0]
    assert sorted(r[0][0] for r in rows(out)) == [*range(1, 7), *range(101, 107)]


def test_progress_bar_on_a_terminal():
    from gemmtune.tune.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    progress = Progress(2, "tune bf16", term)
    progress.update("M=1", ok=True)
    progress.note("FAILED M=2: no candidate passed")
    progress.update("M=2", ok=False)
    text = term.getvalue()
    assert text.count("\r") == 2 and "[###############...............] 1/2" in text
    assert "2/2 (1 failed)" in text and "\nFAILED M=2" in text and text.endswith("\n")


def test_plain_progress_lines_without_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    _, log = tune(tmp_path, untuned(tmp_path / "u.csv", [1, 2]))
    lines = [ln for ln in log.splitlines() if ln.startswith("tune bf16 ")]
    assert [ln.split()[2] for ln in lines] == ["1/2", "2/2"] and "\r" not in log
    assert "2 tuned, 0 failed" in log


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU path of the family")
def test_real_bf16_family_on_cpu(tmp_path):
    """The bf16 family itself on the CPU: torch wins (the interpreter is slow) and the Triton
    candidates are checked; fp32 ones pass the gate."""
    from gemmtune.families.bf16.tuner import Bf16Tuner

    inp = untuned(tmp_path / "u.csv", [5])
    out = io.StringIO()
    config = TuneConfig(input=inp, output=tmp_path / "t.csv", profile=tmp_path / "prof.csv",
                        timeout=120, options=TuneOptions(iters=3, warmup=1))
    tuner = Tuner(Bf16Tuner, config, out=out)
    assert tuner.run().exit_code == 0, out.getvalue()
    (row,) = read_table(tmp_path / "t.csv", BF16).rows
    assert row.arch == "cpu" and row.results["timing"] == "cpu.wall"
    statuses = profile(tmp_path)
    assert statuses["torch.linear"] == "ok"
    # M = 5 is split-K's and the GEMV's ground (the tile kernel starts at M = 65): two split-K
    # configs and one GEMV on the CPU, bf16 refused for split-K only (the interpreter's dot).
    assert [s for n, s in statuses.items() if n.startswith("triton.splitk:")] == ["ok", "ok"]
    assert [s for n, s in statuses.items() if n.startswith("triton.gemv:")] == ["ok"]


def test_real_a8w8_family(tmp_path):
    """The a8w8 family on this machine's device (the CPU interpreter, or every GPU), FP8 and
    INT8: every candidate passes the gate against the dequantised fp32 reference, and a bad
    q_dtype_w fails that shape only."""
    from gemmtune.families.a8w8.tuner import A8w8Tuner

    inp = tmp_path / "u.csv"
    inp.write_text("M,N,K,q_dtype_w\n5,48,64,torch.float8_e4m3fn\n20,32,96,torch.int8\n"
                   "4,16,32,torch.bfloat16\n")
    out = io.StringIO()
    config = TuneConfig(input=inp, output=tmp_path / "t.csv", profile=tmp_path / "prof.csv",
                        timeout=120, options=TuneOptions(iters=3, warmup=1),
                        gpus=default_gpus(), workers=4 if default_gpus() else 1)
    summary = Tuner(A8w8Tuner, config, out=out).run()
    assert summary.tuned == 2 and len(summary.failed) == 1, out.getvalue()
    assert "a8w8 tunes torch.float8_e4m3fn and torch.int8 weights" in out.getvalue()
    rows = read_table(tmp_path / "t.csv", A8W8_SCHEMA).rows
    assert sorted(r.key.q_dtype_w for r in rows) == ["torch.float8_e4m3fn", "torch.int8"]
    with open(tmp_path / "prof.csv") as f:
        profiled = list(csv.DictReader(f))
    statuses = [(r["kernelName"], r["status"]) for r in profiled]
    assert all(s == "ok" for _, s in statuses), not_ok(profiled)
    assert [n for n, _ in statuses].count("torch.scaled_mm") == 2
    splitk = sum(1 for n, _ in statuses if n.startswith("triton.splitk:"))
    lt = sum(1 for n, _ in statuses if n.startswith("cublaslt:"))
    if torch.cuda.is_available():  # the whole split-K space, and cuBLASLt for the FP8 shape
        from gemmtune.kernels import cublaslt

        assert splitk >= 4 and (lt > 0) == (cublaslt.nvmath_missing() is None), statuses
    else:  # the interpreter runs two split-K configs per shape and one GEMV for FP8 (the GEMV
        # refuses int8); no cuBLASLt off the GPU
        gemv = sum(1 for n, _ in statuses if n.startswith("triton.gemv:"))
        assert len(statuses) == 7 and splitk == 4 and gemv == 1 and lt == 0, statuses


def test_real_a8w8_blockscale_family(tmp_path):
    """The block-scale family on this machine's device: torch and the Triton configs (two in
    the interpreter; block_k dividing 128) pass the gate against the dequantised fp32
    reference."""
    from gemmtune.families.a8w8_blockscale.tuner import A8w8BlockscaleTuner

    inp = tmp_path / "u.csv"
    inp.write_text("M,N,K\n5,200,300\n")
    out = io.StringIO()
    config = TuneConfig(input=inp, output=tmp_path / "t.csv", profile=tmp_path / "prof.csv",
                        timeout=120, options=TuneOptions(iters=3, warmup=1),
                        gpus=default_gpus(), workers=4 if default_gpus() else 1)
    summary = Tuner(A8w8BlockscaleTuner, config, out=out).run()
    assert summary.tuned == 1 and not summary.failed, out.getvalue()
    with open(tmp_path / "prof.csv") as f:
        profiled = list(csv.DictReader(f))
    statuses = [(r["kernelName"], r["status"]) for r in profiled]
    assert all(s == "ok" for _, s in statuses), not_ok(profiled)
    assert statuses[0][0].startswith("torch."), statuses
    # The interpreter runs two split-K configs and a GEMV; a GPU the whole (pruned) spaces.
    assert len(statuses) == 4 if not torch.cuda.is_available() else len(statuses) >= 4, statuses
    # Split-K's K steps lie in one scale block, the GEMV's span whole ones.
    assert all("BK64." in n or "BK128." in n for n, _ in statuses[1:]
               if n.startswith("triton.splitk:")), statuses
    assert all(int(n.split(".BK")[1].split(".")[0]) % 128 == 0 for n, _ in statuses
               if n.startswith("triton.gemv:")), statuses


def test_refused_key_fails_that_shape_only(tmp_path):
    from gemmtune.families.bf16.tuner import Bf16Tuner

    inp = tmp_path / "u.csv"
    inp.write_text(HEADER + "4,8,16,False,torch.float32,torch.float32,False,True\n"
                            "4,8,16,False,torch.float32,torch.float32,False,False\n")
    out = io.StringIO()
    config = TuneConfig(input=inp, output=tmp_path / "t.csv", timeout=120,
                        libtypes=frozenset({"torch"}), options=TuneOptions(iters=3, warmup=1))
    summary = Tuner(Bf16Tuner, config, out=out).run()
    assert summary.tuned == 1 and len(summary.failed) == 1 and summary.exit_code == 1
    assert "bpreshuffle=True: no bf16 kernel here gains from a pre-packed weight layout" in \
        out.getvalue()


def test_run_config_benchmarks_the_op_from_the_table(tmp_path, capsys):
    import torch

    from gemmtune.cli import main

    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    table = tmp_path / "tuned.csv"
    table.write_text(
        "arch,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,us,kernelName\n"
        "cpu,0,4,64,32,False,bf16,bf16,False,False,1.0,torch.linear\n"
        "cpu,0,16,64,32,False,bf16,bf16,False,False,1.0,torch.linear\n")
    assert main(["tune", "bf16", "--run_config", "-i", str(table), "-o",
                 str(tmp_path / "rc")]) == 0
    out = capsys.readouterr().out
    assert out.count(" exact ") == 2  # both shapes dispatched from the table's own rows
    assert (tmp_path / "rc" / "bench_bf16.csv").exists()


def test_ctrl_c_keeps_finished_rows_and_blames_no_candidate(tmp_path):
    inp = untuned(tmp_path / "u.csv", range(1, 9))
    out, cache = tmp_path / "o.csv", tmp_path / "cache"
    args = ["-i", str(inp), "-o", str(out), "--batch", "1"]
    proc = _runner(args, {"FAULTY_TIME_SLEEP": "0.3", "GEMMTUNE_CACHE_DIR": str(cache)})
    deadline = time.monotonic() + 120
    while _count_rows(out) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    saved = _count_rows(out)
    assert 1 <= saved < 8
    memo = list(cache.glob("crash_memo/*.jsonl"))
    assert not memo or not memo[0].read_text().strip()
    assert _runner(args, {"GEMMTUNE_CACHE_DIR": str(cache)}).wait(300) == 0
    assert _count_rows(out) == 8


def test_a_second_stop_signal_does_not_break_off_the_save(tmp_path):
    """coreutils' timeout sends SIGTERM to the tuner and then to its process group: the second
    one arrives while the run closes its workers and saves its last rows (session 18 lost two
    rows that way). Only the first signal interrupts."""
    config = TuneConfig(input=tmp_path / "in.csv", output=tmp_path / "out.csv")
    tuner = Tuner(FaultyFamily, config, out=io.StringIO())
    restore = tuner._handle_stop_signals()
    try:
        handler = signal.getsignal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGTERM, None)
        handler(signal.SIGTERM, None)  # returns: the clean-up goes on
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        assert tuner.summary.interrupted
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is not handler


def test_a_stop_signal_during_a_finished_runs_clean_up_does_not_make_it_interrupted(tmp_path):
    """A time limit can fire while a run whose every shape is done closes its workers: it stays
    a complete run (its log does not ask for a resume). A signal after an engine error stopped
    the run, with shapes left, still marks it interrupted."""
    config = TuneConfig(input=tmp_path / "in.csv", output=tmp_path / "out.csv")
    for finished, interrupted in ((True, False), (False, True)):
        tuner = Tuner(FaultyFamily, config, out=io.StringIO())
        restore = tuner._handle_stop_signals()
        try:
            tuner._finished = finished
            tuner._stop.set()  # the clean-up's, or an engine error's
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # returns: clean-up goes on
            assert tuner.summary.interrupted is interrupted
        finally:
            restore()


def test_workers_are_told_to_stop_before_any_is_waited_for():
    """Each worker's exit takes its CUDA teardown on a GPU: closing them together overlaps
    those instead of adding them up."""
    from gemmtune.tune.workers import Worker, WorkerSpec, close_all

    events = []

    class Recording(Worker):
        def ask_to_stop(self):
            events.append(("ask", self.label))
            super().ask_to_stop()

        def finish_closing(self, wait_s):
            events.append(("wait", self.label))
            super().finish_closing(wait_s)

    spec = WorkerSpec(FaultyFamily, (("CUDA_VISIBLE_DEVICES", ""),))
    workers = [Recording(spec, f"w{i}") for i in range(3)]
    for w in workers:
        w.start()
    close_all(workers)
    assert [kind for kind, _ in events] == ["ask"] * 3 + ["wait"] * 3
    assert not any(w.alive for w in workers)
    with pytest.raises(Exception, match="was closed"):
        workers[0].call("device", timeout=5)


def test_closing_survives_workers_in_any_state():
    """A process made but not started (a start racing the close), one that never existed and
    one whose close fails: every other worker is still closed, the error comes after, and a
    closed worker cannot be started again (a restart racing the close)."""
    from gemmtune.tune.workers import Worker, WorkerLost, WorkerSpec, close_all

    spec = WorkerSpec(FaultyFamily, (("CUDA_VISIBLE_DEVICES", ""),))
    made, never, failing, running = (Worker(spec, f"w{i}") for i in range(4))
    made._proc = made._ctx.Process(target=time.sleep, args=(0,))  # made, not started
    running.start()

    def fail(wait_s):
        raise OSError("cannot close")

    failing.finish_closing = fail
    with pytest.raises(OSError, match="cannot close"):
        close_all([made, never, failing, running])
    assert not running.alive and not made.alive
    with pytest.raises(WorkerLost, match="was closed"):
        running.start()


def test_workers_sharing_a_device_never_time_at_once(tmp_path, monkeypatch):
    log = tmp_path / "timing.log"
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    monkeypatch.setenv("FAULTY_TIME_SLEEP", "0.05")
    monkeypatch.setenv("FAULTY_TIMING_LOG", str(log))
    # A generous timeout: a candidate killed for a slow answer on a loaded machine (seen once on
    # the GPU machine, 24 of 36 spans) would leave spans out, which is not what this test is about.
    tune(tmp_path, untuned(tmp_path / "u.csv", range(1, 7)), workers=3, timeout=60.0)
    spans = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
    assert len(spans) == 6 * 3 * 2  # 6 shapes x 3 candidates x (screen + re-time)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_last_takes_the_last_row_and_sort_orders_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    inp = tmp_path / "u.csv"
    inp.write_text(HEADER + "".join(f"{m},{n},40,False,torch.float32,torch.float32,False,False\n"
                                    for m, n in ((1, 24), (2, 24), (1, 24))))
    tuner, _ = tune(tmp_path, inp, last_only=True)
    assert [r[0][:2] for r in rows(tmp_path / "tuned.csv")] == [(1, 24)]
    keys = [(m, n, 8, False, "torch.bfloat16", "torch.bfloat16", False, False)
            for m, n in ((16, 4096), (1, 256), (1, 1024), (8, 256))]
    assert sorted(keys, key=tuner._sort_key) == [keys[1], keys[3], keys[2], keys[0]]


def test_every_candidate_raising_alike_points_at_the_family(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_CANDIDATES", "fault.raise,fault.raise2,fault.raise3")
    tuner, log = tune(tmp_path, untuned(tmp_path / "u.csv", [3]))
    assert tuner.summary.exit_code == 1
    assert "all raised ValueError: that looks like a bug in the bf16 family" in log


def test_interrupted_retune_all_resumes_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    inp = untuned(tmp_path / "u.csv", range(1, 9))
    out = tmp_path / "o.csv"
    assert _runner(["-i", str(inp), "-o", str(out)]).wait(300) == 0
    args = ["-i", str(inp), "-o", str(out), "--all", "--batch", "1"]
    proc = _runner(args, {"FAULTY_TIME_SLEEP": "0.3"})
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("o.csv.retune-*.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    (log,) = tmp_path.glob("o.csv.retune-*.jsonl")
    finished = len(log.read_text().splitlines())
    assert 1 <= finished < 8
    out_text = io.StringIO()
    config = TuneConfig(input=inp, output=out, retune_all=True, timeout=4.0)
    summary = Tuner(FaultyFamily, config, out=out_text).run()
    assert summary.skipped == finished and summary.tuned == 8 - finished
    assert not list(tmp_path.glob("o.csv.retune-*.jsonl"))  # a complete run removes the log
    assert len(rows(out)) == 8


def test_an_output_that_fails_late_keeps_its_rows_in_the_cache(tmp_path, monkeypatch):
    """The output's folder was writable when the run began and is not when the rows are
    written: they go to $GEMMTUNE_CACHE_DIR/rescue, the run says where and exits non-zero."""
    import gemmtune.tune.engine as engine

    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")

    def fail(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(engine, "update_table", fail)
    tuner, log = tune(tmp_path, untuned(tmp_path / "u.csv", [1, 2]))  # written at the end
    assert tuner.summary.exit_code == 1 and tuner.summary.unsaved
    rescued = tuner.summary.rescued_to
    assert rescued.is_relative_to(Path(os.environ["GEMMTUNE_CACHE_DIR"]) / "rescue")
    assert sorted(r.key.M for r in read_table(rescued, BF16).rows) == [1, 2]
    assert f"2 tuned row(s) saved to {rescued}" in log and "Traceback" not in log


def test_rows_of_another_gpu_model_do_not_count_as_tuned(tmp_path, monkeypatch):
    """An H200 run resumes nothing from an H100 table of the same shapes: each keeps its rows."""
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    inp = untuned(tmp_path / "u.csv", [1, 2])
    monkeypatch.setenv("FAULTY_GPU", "H100-80GB-HBM3")
    _, log = tune(tmp_path, inp)
    assert "2 tuned" in log
    monkeypatch.setenv("FAULTY_GPU", "H200")
    _, log = tune(tmp_path, inp)
    assert "tuning 2 shape(s) of bf16 on cpu:0:H200" in log and "0 already tuned" in log
    rows = read_table(tmp_path / "tuned.csv", BF16).rows
    assert sorted((r.gpu, r.key.M) for r in rows) == [
        ("H100-80GB-HBM3", 1), ("H100-80GB-HBM3", 2), ("H200", 1), ("H200", 2)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's CPU interpreter")
def test_bf16_triton_candidates_are_refused_on_the_cpu_and_the_run_says_why(tmp_path):
    from gemmtune.families.bf16.tuner import Bf16Tuner

    inp = tmp_path / "u.csv"
    inp.write_text(HEADER + "5,24,40,False,torch.bfloat16,torch.bfloat16,False,False\n")
    out = io.StringIO()
    config = TuneConfig(input=inp, output=tmp_path / "t.csv", profile=tmp_path / "prof.csv",
                        timeout=120, options=TuneOptions(iters=3, warmup=1))
    assert Tuner(Bf16Tuner, config, out=out).run().exit_code == 0, out.getvalue()
    statuses = profile(tmp_path)
    assert statuses["torch.linear"] == "ok"
    assert [s for n, s in statuses.items() if n.startswith("triton.splitk:")] == ["refused"] * 2
    assert "refused: 2 x Triton's CPU interpreter computes bf16 dots wrongly" in out.getvalue()
    # The GEMV has no dot: it runs in bf16 there.
    assert [s for n, s in statuses.items() if n.startswith("triton.gemv:")] == ["ok"]


def test_the_run_says_why_candidates_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_CANDIDATES", "torch.linear,fault.wrong,fault.raise")
    _, log = tune(tmp_path, untuned(tmp_path / "u.csv", [1, 2]))
    assert "  error: 2 x ValueError: this candidate always raises" in log
    assert "  wrong: 2 x #" in log and "of elements outside tolerance" in log


def test_kernels_challenges_each_row_with_the_named_kernels_only(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    inp = untuned(tmp_path / "u.csv", [1, 2])
    path = tmp_path / "tuned.csv"
    monkeypatch.setenv("FAULTY_CANDIDATES", "torch.linear,good.slow")
    tune(tmp_path, inp)
    assert {r[1] for r in rows(path)} == {"good.slow"}
    # The challengers (good.f...) against the row's kernel and the torch baseline, nothing else.
    (tmp_path / "prof.csv").unlink()  # the profile appends: keep this run's lines alone
    monkeypatch.setenv("FAULTY_CANDIDATES", "torch.linear,good.slow,good.fast,fault.raise")
    tuner, _ = tune(tmp_path, inp, kernels=("good.f",))
    assert {r[1] for r in rows(path)} == {"good.fast"} and len(rows(path)) == 2
    assert profile(tmp_path) == {"torch.linear": "ok", "good.slow": "ok", "good.fast": "ok"}
    assert tuner.summary.tuned == 2 and tuner.summary.skipped == 0


def test_kernels_keeps_a_row_whose_kernel_the_family_no_longer_lists(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    inp = untuned(tmp_path / "u.csv", [1])
    path = tmp_path / "tuned.csv"
    monkeypatch.setenv("FAULTY_CANDIDATES", "torch.linear,good.slow")
    tune(tmp_path, inp)
    # good.slow left the family's list: it still competes, as the row names it, and still wins.
    (tmp_path / "prof.csv").unlink()
    monkeypatch.setenv("FAULTY_CANDIDATES", "torch.linear,fault.raise")
    tune(tmp_path, inp, kernels=("fault.r",))
    assert [r[1] for r in rows(path)] == ["good.slow"]
    assert profile(tmp_path) == {"torch.linear": "ok", "good.slow": "ok", "fault.raise": "error"}


def test_kernels_matching_no_candidate_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("FAULTY_WITH_FAULTS", "0")
    monkeypatch.setenv("FAULTY_CANDIDATES", "torch.linear,good.slow")
    inp = untuned(tmp_path / "u.csv", [1, 2])
    tune(tmp_path, inp)
    tuner, log = tune(tmp_path, inp, kernels=("triton.gmev",))
    assert len(tuner.summary.unchallenged) == 2
    assert "2 shape(s) had no candidate matching --kernels triton.gmev" in log
    assert {r[1] for r in rows(tmp_path / "tuned.csv")} == {"good.slow"}


def test_kernels_refuses_families_with_several_kernels_per_row(tmp_path):
    class TwoKernels(FaultyFamily):
        schema = get_family("fmoe").schema

    config = TuneConfig(input=untuned(tmp_path / "u.csv", [1]), output=tmp_path / "t.csv",
                        kernels=("triton.",))
    with pytest.raises(ValueError, match="--kernels challenges a row's one kernel; fmoe rows"):
        Tuner(TwoKernels, config)


def test_kernels_patterns_are_prefixes_or_wildcards():
    from gemmtune.tune.engine import challenges

    assert challenges("triton.gemv:BN4.BK512.SK1.W4.S1", ("triton.gemv",))
    assert challenges("triton.splitk:BM16.BN64.BK128.SK2.W4.S3.P1.PK0.SW1",
                      ("triton.splitk:*SW1",))
    assert not challenges("triton.splitk:BM16.BN64.BK128.SK2.W4.S3.P1", ("triton.splitk:*SW1",))
    assert not challenges("cublaslt:id66", ("triton.gemv", "triton.splitk:*SW1"))

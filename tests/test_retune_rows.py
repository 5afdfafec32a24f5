"""scripts/retune_rows.py: the rows of this device naming a kernel prefix are tuned again in
place; every other row (other kernels, other GPUs) is kept as it was."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
HEADER = ("arch,cu_num,gpu,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,"
          "us,kernelName,err_ratio,tflops,bw\n")
KEY = "False,torch.float16,torch.float16,False,False"


def retune_rows(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """scripts/retune_rows.py with these arguments, in a process of its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(ROOT / "scripts/retune_rows.py"), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_only_this_devices_rows_of_the_prefix_are_tuned_again(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text(
        HEADER
        + f"cpu,0,,4,8,16,{KEY},torch,0,0,999.0,torch.linear,0,0,0\n"
        + f"cpu,0,,5,8,16,{KEY},triton,0,0,999.0,triton.tile:BM16.BN32.BK32.G1.W4.S2,0,0,0\n"
        + f"sm_90,132,H100-80GB-HBM3,6,8,16,{KEY},torch,0,0,999.0,torch.linear,0,0,0\n")
    done = retune_rows("bf16", "--kernel", "torch.", "--libtype", "torch", "--table", str(table),
                       "--work", str(tmp_path / "work"), "--", "--mp", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {(r["arch"], r["M"]): r for r in csv.DictReader(table.open())}
    assert sorted(rows) == [("cpu", "4"), ("cpu", "5"), ("sm_90", "6")]
    retuned = rows[("cpu", "4")]
    assert retuned["kernelName"] == "torch.linear" and float(retuned["us"]) != 999.0
    for kept in (rows[("cpu", "5")], rows[("sm_90", "6")]):
        assert float(kept["us"]) == 999.0
    shapes = (tmp_path / "work" / "bf16_retune_shapes.csv").read_text().splitlines()
    assert shapes[1:] == [f"4,8,16,{KEY}"]  # the H100 row's shape is not tuned on this device


def test_the_rows_own_backend_must_compete(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text(HEADER + f"cpu,0,,4,8,16,{KEY},torch,0,0,999.0,torch.linear,0,0,0\n")
    done = retune_rows("bf16", "--kernel", "torch.", "--libtype", "cublaslt", "--table",
                       str(table))
    assert done.returncode == 2 and "--libtype cublaslt lacks torch" in done.stderr
    assert "999.0" in table.read_text()


def test_challenge_tries_a_kernel_against_the_rows_of_the_m_given(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text(
        HEADER
        + f"cpu,0,,1,8,16,{KEY},torch,0,0,999.0,torch.linear,0,0,0\n"
        + f"cpu,0,,5,8,16,{KEY},torch,0,0,999.0,torch.linear,0,0,0\n"
        + f"cpu,0,,64,8,16,{KEY},torch,0,0,999.0,torch.linear,0,0,0\n")
    done = retune_rows("bf16", "--m", "1,5", "--challenge", "triton.gemv", "--table", str(table),
                       "--work", str(tmp_path / "work"), "--", "--mp", "1", "--iters", "2",
                       timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["M"]: r for r in csv.DictReader(table.open())}
    assert sorted(rows, key=int) == ["1", "5", "64"]
    assert float(rows["64"]["us"]) == 999.0  # not an M asked for
    profile = list(csv.DictReader((tmp_path / "work" / "bf16_retune_profile.csv").open()))
    # Per shape: the row's kernel (here torch's, also the baseline) and GEMV configs only.
    assert {r["M"] for r in profile} == {"1", "5"}
    assert all(r["kernelName"] == "torch.linear" or r["kernelName"].startswith("triton.gemv:")
               for r in profile), [r["kernelName"] for r in profile]
    assert any(r["kernelName"].startswith("triton.gemv:") and r["status"] == "ok"
               for r in profile)
    for m in ("1", "5"):
        assert float(rows[m]["us"]) != 999.0


def test_libtype_must_cover_every_chosen_rows_backend(tmp_path):
    # Without --kernel every row of the M given is chosen: here a torch row and a Triton row.
    table = tmp_path / "t.csv"
    table.write_text(
        HEADER
        + f"cpu,0,,4,8,16,{KEY},torch,0,0,999.0,torch.linear,0,0,0\n"
        + f"cpu,0,,5,8,16,{KEY},triton,0,0,999.0,triton.tile:BM16.BN32.BK32.G1.W4.S2,0,0,0\n")
    done = retune_rows("bf16", "--m", "4,5", "--libtype", "torch", "--table", str(table))
    assert done.returncode == 2 and "--libtype torch lacks triton" in done.stderr
    assert table.read_text().count("999.0") == 2

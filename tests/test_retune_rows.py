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


def test_only_this_devices_rows_of_the_prefix_are_tuned_again(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text(
        HEADER
        + f"cpu,0,,4,8,16,{KEY},torch,0,0,999.0,torch.linear,0,0,0\n"
        + f"cpu,0,,5,8,16,{KEY},triton,0,0,999.0,triton.tile:BM16.BN32.BK32.G1.W4.S2,0,0,0\n"
        + f"sm_90,132,H100-80GB-HBM3,6,8,16,{KEY},torch,0,0,999.0,torch.linear,0,0,0\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts/retune_rows.py"), "bf16", "--kernel", "torch.",
         "--libtype", "torch", "--table", str(table), "--work", str(tmp_path / "work"), "--",
         "--mp", "1"], env=env, capture_output=True, text=True, timeout=300)
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
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts/retune_rows.py"), "bf16", "--kernel", "torch.",
         "--libtype", "cublaslt", "--table", str(table)], env=env, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 2 and "--libtype cublaslt lacks torch" in done.stderr
    assert "999.0" in table.read_text()

"""A family registered from outside the package (``tests/toy_family.py``, via
``gemmtune.register_family`` only) is served by dispatch, capture and every CLI verb: lookup,
tables, capture --merge, tune (through the engine's worker processes), bench and tune
--run_config."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import gemmtune
import toy_family
from gemmtune.cli import main
from gemmtune.device import current_device
from gemmtune.families import all_families, register_family, unregister_family
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.tables.store import read_table
from toy_family import SCHEMA, TOY_MATMUL_T, TOY_MM, ToyKey, toy_gemm, toy_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32, BF16 = "torch.float32", "torch.bfloat16"


@pytest.fixture
def toy():
    """The toy family, registered for this test only; its backends' call counts from zero."""
    register_family(toy_family.FAMILY)
    toy_family.CALLS.clear()
    yield toy_family
    unregister_family("toy")


def write_tuned(path: Path, rows: list[tuple[ToyKey, str]]) -> Path:
    """A toy table with ``rows`` (key, kernelName) for the device tests run on."""
    dev = current_device()
    path.write_text("arch,cu_num,M,N,K,dtype,us,kernelName\n" + "".join(
        f"{dev.arch},{dev.cu_num},{k.M},{k.N},{k.K},{k.dtype},1.0,{name}\n" for k, name in rows))
    return path


def operands(m: int, n: int, k: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=DEVICE) / k ** 0.5).to(dtype)
    return x, w


def assert_matches_reference(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    # The tuner's own tolerances for the output dtype (unit-scale outputs: see TOLERANCES).
    atol, rtol, _ = TOLERANCES[y.dtype]
    torch.testing.assert_close(y.float(), toy_ref(x, w), atol=atol, rtol=rtol)


def test_dispatch_runs_the_backend_the_toy_table_names(toy, tmp_path, monkeypatch):
    table = write_tuned(tmp_path / "user.csv", [(ToyKey(3, 24, 40, FP32), TOY_MATMUL_T)])
    monkeypatch.setenv("GEMMTUNE_CONFIG_TOY", f"replace:{table}")

    for seed in (1, 2):  # the second call is served by the cached plan
        x, w = operands(3, 24, 40, seed=seed)
        assert_matches_reference(toy_gemm(x, w), x, w)
    assert toy.CALLS == {TOY_MATMUL_T: 2}

    # The toy's own key column counts: the same M, N, K in bf16 has no row and runs the default.
    xb, wb = operands(3, 24, 40, torch.bfloat16, seed=3)
    yb = toy_gemm(xb, wb)
    assert yb.dtype == torch.bfloat16 and toy.CALLS[TOY_MM] == 1
    assert_matches_reference(yb, xb, wb)
    # Another M of the tuned (N, K, dtype) takes the nearest tuned M's row.
    x5, w5 = operands(5, 24, 40, seed=4)
    assert_matches_reference(toy_gemm(x5, w5), x5, w5)
    assert toy.CALLS == {TOY_MATMUL_T: 3, TOY_MM: 1}

    misses = {(m.family, tuple(m.shape.values()), m.rule.value, m.kernel_name, m.calls)
              for m in gemmtune.report_misses()}
    assert misses == {("toy", (3, 24, 40, BF16), "default", TOY_MM, 1),
                      ("toy", (5, 24, 40, FP32), "nearest", TOY_MATMUL_T, 1)}
    assert "toy" in gemmtune.format_misses(gemmtune.report_misses())


def test_lookup_and_tables_show_the_toy_table(toy, tmp_path, monkeypatch, capsys):
    table = write_tuned(tmp_path / "user.csv", [(ToyKey(3, 24, 40, FP32), TOY_MATMUL_T),
                                                (ToyKey(16, 24, 40, BF16), TOY_MM)])
    monkeypatch.setenv("GEMMTUNE_CONFIG_TOY", str(table))

    assert main(["lookup", "toy", "M=3", "N=24", "K=40"]) == 0  # dtype: the column's default
    out = capsys.readouterr().out
    assert "rule:       exact" in out and f"kernelName: {TOY_MATMUL_T}" in out
    assert f"{table}:2" in out  # the row's file and line
    assert main(["lookup", "toy", "M=3", "N=24", "K=40", "dtype=bf16"]) == 0
    out = capsys.readouterr().out
    assert "rule:       padded" in out and f"kernelName: {TOY_MM}" in out
    assert "M=16 N=24 K=40 dtype=torch.bfloat16" in out
    assert main(["lookup", "toy", "M=3", "N=24", "K=40", "bias=1"]) == 2
    assert "toy has no key column(s) bias; its key is M, N, K, dtype" in capsys.readouterr().err

    assert main(["tables"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("\ntoy "):]
    assert block.split("\n")[1].split() == ["toy", "2", "row(s)", "for", "this", "device",
                                            "from", "1", "file(s)"]
    assert str(table) in block
    merged = Path(block.split("merged copy: ")[1].split("\n")[0])
    assert merged.name == "toy_tuned_gemm.csv"
    assert {r.key: r.results["kernelName"] for r in read_table(merged, SCHEMA).rows} == \
        {ToyKey(3, 24, 40, FP32): TOY_MATMUL_T, ToyKey(16, 24, 40, BF16): TOY_MM}


def test_capture_records_toy_shapes_and_merge_writes_its_untuned_file(toy, tmp_path,
                                                                      monkeypatch, capsys):
    shards = tmp_path / "shards"
    monkeypatch.setenv("GEMMTUNE_TUNE_GEMM", "1")
    monkeypatch.setenv("GEMMTUNE_CAPTURE_DIR", str(shards))
    for m, dtype in ((1, torch.float32), (7, torch.float32), (7, torch.float32),
                     (7, torch.bfloat16)):
        toy_gemm(*operands(m, 24, 40, dtype))
    assert len(list((shards / "toy").glob("*.csv"))) == 1  # this process's shard

    out_dir = tmp_path / "shapes"
    assert main(["capture", "--merge", "-o", str(out_dir), "--shards", str(shards)]) == 0
    assert "toy: 3 new shape(s) from 1 shard(s)" in capsys.readouterr().out
    rows = read_table(out_dir / "toy_untuned_gemm.csv", SCHEMA, untuned=True).rows
    assert sorted(r.key for r in rows) == [ToyKey(1, 24, 40, FP32), ToyKey(7, 24, 40, BF16),
                                           ToyKey(7, 24, 40, FP32)]
    assert not list((shards / "toy").glob("*"))  # merged shards are removed


def test_tune_writes_a_toy_row_per_shape_through_the_engine_and_resumes(toy, tmp_path, capsys):
    untuned = tmp_path / "toy_untuned_gemm.csv"
    untuned.write_text("M,N,K,dtype\n4,24,40,torch.float32\n8,24,40,bf16\n")
    tuned, profile = tmp_path / "tuned.csv", tmp_path / "profile.csv"
    args = ["tune", "toy", "-i", str(untuned), "-o", str(tuned), "-o2", str(profile),
            "--iters", "5", "--warmup", "1"]

    assert main(args) == 0
    assert "tuning 2 shape(s) of toy" in capsys.readouterr().err
    rows = read_table(tuned, SCHEMA).rows
    dev = current_device()
    assert sorted(r.key for r in rows) == [ToyKey(4, 24, 40, FP32), ToyKey(8, 24, 40, BF16)]
    for r in rows:
        assert (r.arch, r.cu_num) == (dev.arch, dev.cu_num)
        assert r.results["kernelName"] in (TOY_MM, TOY_MATMUL_T)
        assert r.results["libtype"] == "torch" and r.us > 0
    with open(profile) as f:
        checked = {(int(p["M"]), p["kernelName"]): p["status"] for p in csv.DictReader(f)}
    assert checked == {(m, name): "ok" for m in (4, 8) for name in (TOY_MM, TOY_MATMUL_T)}

    before = tuned.read_text()
    assert main(args) == 0
    assert "tuning 0 shape(s) of toy" in capsys.readouterr().err
    assert tuned.read_text() == before


def test_bench_and_run_config_run_the_toy_op_from_its_tables(toy, tmp_path, monkeypatch,
                                                             capsys):
    a, b = ToyKey(4, 24, 40, FP32), ToyKey(4, 32, 40, FP32)
    shapes = tmp_path / "toy_untuned_gemm.csv"
    shapes.write_text(f"M,N,K,dtype\n{a.M},{a.N},{a.K},{a.dtype}\n{b.M},{b.N},{b.K},{b.dtype}\n")
    user = write_tuned(tmp_path / "user.csv", [(a, TOY_MATMUL_T)])
    monkeypatch.setenv("GEMMTUNE_CONFIG_TOY", f"replace:{user}")

    assert main(["bench", "toy", "--shapes", str(shapes), "-o", str(tmp_path / "bench")]) == 0
    assert bench_rows(tmp_path / "bench") == {(a.N, "exact", TOY_MATMUL_T),
                                              (b.N, "default", TOY_MM)}
    assert toy.CALLS[TOY_MATMUL_T] > 0

    # --run_config dispatches from its -i table alone: the overlay above would pick the other
    # kernel for both shapes.
    table = write_tuned(tmp_path / "tuned.csv", [(a, TOY_MM), (b, TOY_MATMUL_T)])
    assert main(["tune", "toy", "--run_config", "-i", str(table),
                 "-o", str(tmp_path / "rc")]) == 0
    assert bench_rows(tmp_path / "rc") == {(a.N, "exact", TOY_MM), (b.N, "exact", TOY_MATMUL_T)}
    assert "WRONG" not in capsys.readouterr().out


def bench_rows(out_dir: Path) -> set[tuple[int, str, str]]:
    """(N, rule, kernel) of each row of ``bench_toy.csv``, after checking each result passed
    the fp32 reference within the fp32 bound."""
    with open(out_dir / "bench_toy.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(r["ok"] == "True" and float(r["rel_err"]) <= TOLERANCES[torch.float32][2]
               for r in rows), rows
    return {(int(r["N"]), r["rule"], r["kernel"]) for r in rows}


def test_without_registration_the_cli_does_not_know_the_toy(capsys):
    assert "toy" not in [f.name for f in all_families()]
    with pytest.raises(SystemExit):
        main(["lookup", "toy", "M=1", "N=1", "K=1"])
    assert "invalid choice: 'toy'" in capsys.readouterr().err

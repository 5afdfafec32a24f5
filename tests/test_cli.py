"""The ``gemmtune`` command line: help texts, lookup, shapes, tables, check."""

from __future__ import annotations

import pytest

from gemmtune.cli import main
from gemmtune.families import get_family
from gemmtune.tables.store import read_table

BF16_SCHEMA = get_family("bf16").schema
FMOE_SCHEMA = get_family("fmoe").schema

VERBS = ["lookup", "capture", "shapes", "tables", "tune", "bench"]


def test_help_lists_every_verb(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(v in out for v in VERBS) and "workflow:" in out


@pytest.mark.parametrize("verb", VERBS)
def test_each_verb_explains_itself(verb, capsys):
    with pytest.raises(SystemExit) as e:
        main([verb, "--help"])
    assert e.value.code == 0
    assert len(capsys.readouterr().out.splitlines()) > 4


def _write_table(tmp_path, monkeypatch, *rows):
    path = tmp_path / "t.csv"
    path.write_text("arch,cu_num,M,N,K,us,kernelName\n" + "".join(rows))
    monkeypatch.setenv("GEMMTUNE_CONFIG_BF16", f"replace:{path}")
    return path


@pytest.mark.parametrize("m, rule, row_m", [
    (128, "exact", 128), (100, "padded", 112), (70, "coarse", 128), (600, "nearest", 128),
])
def test_lookup_prints_rule_and_row(tmp_path, monkeypatch, capsys, m, rule, row_m):
    path = _write_table(tmp_path, monkeypatch, "sm_90,132,128,4096,4096,5.5,triton.tile:BM16.BN16.BK16.G1.W4.S1\n",
                        "sm_90,132,112,4096,4096,4.5,torch.linear\n")
    assert main(["lookup", "bf16", f"M={m}", "N=4096", "K=4096", "--device", "sm_90:132"]) == 0
    out = capsys.readouterr().out
    assert f"rule:       {rule}" in out
    assert f"M={row_m} N=4096 K=4096" in out.split("row:")[1]
    assert str(path) in out


def test_lookup_default_on_other_device(tmp_path, monkeypatch, capsys):
    _write_table(tmp_path, monkeypatch, "sm_90,132,128,4096,4096,5.5,torch.linear\n")
    assert main(["lookup", "bf16", "M=128", "N=4096", "K=4096", "--device", "sm_90:114"]) == 0
    out = capsys.readouterr().out
    assert "rule:       default" in out and "kernelName: torch.linear" in out


def test_lookup_errors_are_one_line(capsys):
    assert main(["lookup", "bf16", "M=1", "N=2", "Q=3"]) == 2
    assert "has no key column(s) Q" in capsys.readouterr().err
    assert main(["lookup", "bf16", "M=1", "N=2"]) == 2
    assert "K=... is required" in capsys.readouterr().err
    assert main(["lookup", "bf16", "M=x", "N=2", "K=2"]) == 2
    assert "expected an integer" in capsys.readouterr().err


def test_shapes_writes_and_merges_without_duplicates(tmp_path, capsys):
    out = tmp_path / "shapes"
    assert main(["shapes", "--model", "mixtral-8x7b", "--tp", "2", "--nsets", "1,16", "-o",
                 str(out)]) == 0
    assert main(["shapes", "--model", "mixtral-8x7b", "--tp", "2", "--nsets", "16,32", "-o",
                 str(out)]) == 0
    bf16 = read_table(out / "bf16_untuned_gemm.csv", BF16_SCHEMA, untuned=True).rows
    # Mixtral tp=2: qkv N=(16+2*4)*128=3072, o K=2048, router N=8 experts, lm_head N=16000.
    assert sorted({(r.key.N, r.key.K) for r in bf16}) == [(8, 4096), (3072, 4096),
                                                           (4096, 2048), (16000, 4096)]
    assert sorted({r.key.M for r in bf16}) == [1, 16, 32]
    assert len(bf16) == 12
    fmoe = read_table(out / "untuned_fmoe.csv", FMOE_SCHEMA, untuned=True).rows
    assert {(r.key.model_dim, r.key.inter_dim, r.key.expert, r.key.topk) for r in fmoe} == {(4096, 7168, 8, 2)}


def test_shapes_from_model_dir_and_family_filter(tmp_path, capsys):
    cfg = tmp_path / "m"
    cfg.mkdir()
    (cfg / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}')
    assert main(["shapes", "--model_dir", str(cfg), "--nsets", "8", "--families", "bf16", "-o",
                 str(tmp_path / "o")]) == 0
    rows = read_table(tmp_path / "o" / "bf16_untuned_gemm.csv", BF16_SCHEMA,
                      untuned=True).rows
    # head_dim 64: qkv N=(4+2*2)*64=512; o 256x256; gate_up N=1024; down K=512; lm_head N=1000.
    assert sorted((r.key.N, r.key.K) for r in rows) == [(256, 256), (256, 512), (512, 256),
                                                          (1000, 256), (1024, 256)]


def test_shapes_bad_input_is_an_error_not_a_traceback(tmp_path, capsys):
    assert main(["shapes", "--model_dir", str(tmp_path), "-o", str(tmp_path / "o")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_tables_lists_sources(tmp_path, monkeypatch, capsys):
    path = _write_table(tmp_path, monkeypatch, "cpu,0,1,2,3,1.0,torch.linear\n")
    assert main(["tables"]) == 0
    out = capsys.readouterr().out
    assert "bf16" in out and str(path) in out and "shipped tables replaced" in out


def test_bench_on_cpu_says_so_and_writes_csv_and_plot(tmp_path, capsys):
    import csv

    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU message")
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("M,N,K\n1,64,48\n16,64,48\n3,40,24\n")
    assert main(["bench", "bf16", "--shapes", str(shapes), "-o", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no GPU found: benchmarking on the CPU")
    # No ceilings, floors, efficiencies or speed-ups: they would describe no GPU.
    assert "TFLOP/s" not in out and "speed-up geomean" not in out and "efficiency" not in out
    assert "3 shape(s) checked against the fp32 reference: all within the bound" in out
    assert "speed-ups, ceilings and floors are GPU measures" in out
    with open(tmp_path / "b" / "bench_bf16.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["M"], r["N"], r["K"]) for r in rows] == [("1", "64", "48"), ("16", "64", "48"),
                                                        ("3", "40", "24")]
    assert all(r["ok"] == "True" and r["kernel"] == "torch.linear" for r in rows)
    assert all(float(r["torch_us"]) > 0 and r["roofline_us"] == "nan" for r in rows)
    png = tmp_path / "b" / "bench_bf16.png"
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_bench_a8w8_checks_and_writes_csv(tmp_path, capsys, dtype, without_shipped_json):
    import csv

    shapes = tmp_path / "shapes.csv"
    shapes.write_text("M,N,K,q_dtype_w\n1,64,48,torch.float8_e4m3fn\n17,32,64,torch.int8\n")
    out_dir = tmp_path / "b"
    assert main(["bench", "a8w8", "--dtype", dtype, "--shapes", str(shapes), "-o",
                 str(out_dir)]) == 0
    out = capsys.readouterr().out
    with open(out_dir / ("bench_a8w8.csv" if dtype == "fp8" else "bench_a8w8_int8.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [(r["M"], r["N"]) for r in rows] == [("1", "64"), ("17", "32")]
    # Shapes where torch's column is the reference stay out of the speed-up (on a GPU; the CPU
    # gives no speed-ups at all).
    gpu = __import__("torch").cuda.is_available()
    if gpu and any(r["torch_is_reference"] == "True" for r in rows):
        assert "with torch = reference left out of speed-up" in out
    if gpu and not all(r["torch_is_reference"] == "True" for r in rows):
        assert "speed-up geomean" in out
    if not gpu:
        assert "2 shape(s) checked against the fp32 reference: all within the bound" in out
    # No row and (fixture) no Triton JSON config: torch.
    assert all(r["ok"] == "True" and r["kernel"] == "torch.scaled_mm" for r in rows)


def test_bench_a8w8_blockscale_on_cpu(tmp_path, capsys, without_shipped_json):
    import csv

    shapes = tmp_path / "shapes.csv"
    shapes.write_text("M,N,K\n1,256,384\n20,128,256\n")
    assert main(["bench", "a8w8-blockscale", "--shapes", str(shapes), "-o",
                 str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    if __import__("torch").cuda.is_available():
        assert "torch column = the dequantised fp32 reference" in out
    with open(tmp_path / "b" / "bench_a8w8_blockscale.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["ok"] for r in rows] == ["True", "True"]
    assert all(r["kernel"] == "torch.scaled_mm_blockwise" for r in rows)


def test_bench_refuses_a_dtype_of_another_family(capsys):
    assert main(["bench", "a8w8", "--dtype", "fp16", "--M", "1"]) == 2
    assert "a8w8 benches --dtype fp8 or int8, not fp16" in capsys.readouterr().err
    assert main(["bench", "bf16", "--dtype", "int8", "--M", "1"]) == 2
    assert "bf16 benches --dtype bf16, fp16 or fp32, not int8" in capsys.readouterr().err
    assert main(["bench", "a8w8-blockscale", "--dtype", "int8", "--M", "1"]) == 2
    assert "a8w8-blockscale benches --dtype fp8 only, not int8" in capsys.readouterr().err


def bench_row(name, m, torch_us, tuned_us, roofline_us=2.0, launch_us=0.0, kernel="k",
              **flags):
    from gemmtune.bench import BenchRow

    attainable = roofline_us + launch_us
    return BenchRow(name, m, 8, 8, torch_us, tuned_us, torch_us / tuned_us, roofline_us,
                    attainable, roofline_us / tuned_us, attainable / tuned_us,
                    roofline_us / torch_us, attainable / torch_us, "exact", kernel, 0.0, True,
                    **flags)


def test_geomean_and_summary_by_m_range():
    from gemmtune.bench import geomean, summarize

    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    rows = [bench_row("a", m, 10.0, us) for m, us in ((1, 5.0), (16, 1.25), (2048, 5.0))]
    lines = summarize(rows)
    # speed-ups 2 and 8; roofline efficiencies 0.4 and 1.6, counted as 1.0: geomean sqrt(0.4)
    assert lines[0].startswith("M<=64") and "speed-up geomean 4.000" in lines[0]
    assert "2 shapes" in lines[0] and "tuned 0.632 / 0.632, torch 0.200 / 0.200" in lines[0]
    assert lines[1].startswith("M>=1024") and "1 shapes" in lines[1]
    # A shape whose torch column is the fp32 reference stays out of the speed-up.
    rows.append(bench_row("b", 32, 1000.0, 5.0, torch_is_reference=True))
    lines = summarize(rows)
    assert "3 shapes" in lines[0] and "speed-up geomean 4.000" in lines[0]
    assert "1 with torch = reference left out" in lines[0]
    assert not any(line.startswith("below") for line in lines)
    # Shapes slower than 0.98x torch are named; where both columns ran torch's own kernel the
    # line says the gap is measurement spread.
    rows += [bench_row("c", 64, 10.0, 10.5, kernel="torch.linear", same_kernel=True),
             bench_row("d", 128, 10.0, 11.0, kernel="triton.tile:x")]
    below = summarize(rows)[-1]
    assert below.startswith("below 0.98x torch: 2 shape(s)"), below
    assert "c 64x8x8 0.952 (torch's own kernel in both columns)" in below
    assert "d 128x8x8 0.909;" in below and "1 of them measurement spread" in below


def test_summary_names_the_shapes_no_row_served():
    """A shape the family default ran (no table row) is named with its kernel, so that a bench
    of untuned shapes does not pass for the tuned op's; past six the rest are counted."""
    from dataclasses import replace

    from gemmtune.bench import summarize

    rows = [bench_row("a", 1, 10.0, 5.0)] + [
        replace(bench_row(f"u{i}", 1 + i, 10.0, 900.0, kernel="torch.dequant_mm"), rule="default")
        for i in range(8)]
    (line,) = [line for line in summarize(rows) if line.startswith("no row")]
    assert line.startswith("no row: 8 of 9 shape(s) ran the family's default kernel: "
                           "u0 1x8x8 (torch.dequant_mm), u1 2x8x8 (torch.dequant_mm)"), line
    assert "u5 6x8x8" in line and "u6" not in line and "and 2 more; tune them" in line
    assert not any(line.startswith("no row") for line in summarize(rows[:1]))


def test_both_floors_and_capped_efficiency_geomeans():
    from gemmtune.bench import summarize

    # t_launch 2 us: the attainable floor is 4 us where the roofline is 2 us. The first row ran
    # below the attainable floor (a launch overlapped with PDL): flagged, counted as 1.0.
    fast = bench_row("pdl", 1, 8.0, 3.0, launch_us=2.0)
    slow = bench_row("slow", 16, 8.0, 16.0, launch_us=2.0)
    assert fast.below_floor and not slow.below_floor
    assert fast.attainable_efficiency == pytest.approx(4 / 3)
    lines = summarize([fast, slow])
    # roofline: min(1, 2/3) and 2/16 -> sqrt(0.667 * 0.125); attainable: 1.0 (capped) and 0.25
    assert f"tuned {(2 / 3 * 0.125) ** 0.5:.3f} / {0.25 ** 0.5:.3f}" in lines[0], lines[0]
    assert lines[1].startswith("faster than the attainable floor") and "pdl 1x8x8" in lines[1]


def test_comparisons_summary_by_m_range_and_csv_columns(tmp_path):
    """The ops a family's bench times beside its own (BenchOp.comparisons): per M range, how
    many times faster the tuned op ran, and each one's time and ratio as CSV columns."""
    import csv

    from gemmtune.bench import summarize, write_csv

    rows = [bench_row("a", m, 10.0, tuned, compared_us={"F.linear": linear})
            for m, tuned, linear in ((1, 2.0, 5.0), (16, 4.0, 20.0), (2048, 10.0, 8.0))]
    lines = [line for line in summarize(rows) if "F.linear" in line]
    # M <= 16: 2.5x and 5x -> geomean sqrt(12.5); from 1024: 0.8x
    assert lines[0] == "M<=16          2 shapes: 3.536x F.linear geomean (min 2.500, max 5.000)"
    assert lines[1].startswith("M>=1024        1 shapes: 0.800x F.linear")
    write_csv(rows, tmp_path / "b.csv")
    first = next(csv.DictReader(open(tmp_path / "b.csv")))
    assert first["F.linear us"] == "5" and first["x F.linear"] == "2.5"
    assert "compared_us" not in first


@pytest.mark.parametrize("family", ["a16w4", "a4w4-blockscale"])
def test_mxfp4_benches_time_f_linear_and_the_fp8_op_beside_theirs(family, tmp_path, capsys):
    dtype = "bf16" if family == "a16w4" else "fp4"
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("M,N,K\n3,40,96\n")
    assert main(["bench", family, "--dtype", dtype, "--shapes", str(shapes),
                 "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "x F.linear" in out and "x FP8 op" in out
    import csv

    (row,) = csv.DictReader(open(next(tmp_path.glob("bench_*.csv"))))
    for column in ("F.linear us", "x F.linear", "FP8 op us", "x FP8 op"):
        assert float(row[column]) > 0, (column, row[column])


def test_a16w4_run_config_runs_the_rows_for_weights_as_quantised(tmp_path, capsys):
    """With packed rows in the table (which patch_linear, and so the bench, would follow),
    --run_config leaves them out of the dispatch too: each shape runs its row for weights as
    quantised."""
    import csv

    import torch

    table = tmp_path / "a16w4.csv"
    if torch.cuda.is_available():
        pytest.skip("the table's rows are the CPU's")
    table.write_text("arch,cu_num,M,N,K,dtype,packed,us,kernelName\n"
                     "cpu,0,2,64,128,torch.bfloat16,False,5.0,torch.dequant_linear\n"
                     "cpu,0,2,64,128,torch.bfloat16,True,1.0,"
                     "triton.w4frag:BM8.BK128.SK1.P0.R0.L1\n")
    assert main(["tune", "a16w4", "--run_config", "-i", str(table), "-o",
                 str(tmp_path / "out")]) == 0
    assert "1 row(s) for packed weights left out" in capsys.readouterr().out
    (row,) = csv.DictReader(open(tmp_path / "out" / "bench_a16w4_bf16.csv"))
    assert row["kernel"] == "torch.dequant_linear" and row["rule"] == "exact"


def test_a16w4_bench_stores_weights_as_patch_linear_would(tmp_path, monkeypatch, capsys):
    """Where the table's packed rows are the faster, the bench packs the weight (its torch and
    reference columns unpack it, and stay right); a packed shape that falls back to the torch
    backend counts as the torch column's own kernel."""
    import csv

    import torch

    from gemm_checks import install_user_table

    if torch.cuda.is_available():
        pytest.skip("on the CPU the packed row's Gluon kernel falls back to torch")
    install_user_table(monkeypatch, tmp_path / "a16w4.csv", "GEMMTUNE_CONFIG_A16W4",
                       "arch,cu_num,M,N,K,dtype,packed,libtype,solidx,splitK,us,kernelName,"
                       "err_ratio,tflops,bw\n",
                       [(2, 64, 128, "torch.bfloat16", False, "torch.dequant_linear"),
                        (2, 64, 128, "torch.bfloat16", True,
                         "triton.w4frag:BM8.BK128.SK1.P0.R0.L1")])
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("M,N,K\n2,64,128\n")
    assert main(["bench", "a16w4", "--shapes", str(shapes), "-o", str(tmp_path / "out")]) == 0
    (row,) = csv.DictReader(open(tmp_path / "out" / "bench_a16w4_bf16.csv"))
    # The packed key, its row's Gluon kernel refused on the CPU: the unpacking torch backend.
    assert row["kernel"] == "torch.unpack_dequant_linear" and row["ok"] == "True"
    assert row["same_kernel"] == "True"


def test_lookup_refuses_a_key_outside_its_range(capsys):
    assert main(["lookup", "bf16", "M=16", "N=-4096", "K=4096"]) == 2
    assert "N: N=-4096 is out of range: expected 1 <= N <= 2147483647" in capsys.readouterr().err


def test_tune_skips_an_input_row_of_k_0_and_says_why(tmp_path, capsys):
    untuned = tmp_path / "u.csv"
    untuned.write_text("M,N,K\n4,8,0\n")
    assert main(["tune", "bf16", "-i", str(untuned), "-o", str(tmp_path / "t.csv"),
                 "--libtype", "torch"]) == 1
    err = capsys.readouterr().err
    assert "u.csv:2: column K: K=0 is out of range" in err and "ZeroDivisionError" not in err


def test_unwritable_outputs_are_refused_before_any_work(tmp_path, capsys):
    """An output under a regular file can be written by nobody (root included)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    untuned = tmp_path / "u.csv"
    untuned.write_text("M,N,K\n4,8,16\n")
    cases = [
        (["tune", "bf16", "-i", str(untuned), "-o", str(blocker / "t.csv")],
         "cannot write tuned table (-o)"),
        (["tune", "bf16", "-i", str(untuned), "-o", str(tmp_path / "t.csv"), "-o2",
          str(blocker / "p.csv")], "cannot write profile (-o2)"),
        (["shapes", "--model", "llama3-8b", "-o", str(blocker / "s")],
         "cannot write shapes folder (-o)"),
        (["bench", "bf16", "--shapes", str(untuned), "-o", str(blocker)],
         "bench folder (-o) " + str(blocker) + " is a file"),
        (["tune", "bf16", "-i", str(tmp_path), "-o", str(tmp_path / "t.csv")],
         "is a folder; name the untuned CSV file in it"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "t.csv").exists()  # nothing was tuned


def test_lookup_says_when_a_row_of_another_gpu_model_serves(tmp_path, monkeypatch, capsys):
    table = tmp_path / "t.csv"
    table.write_text("arch,cu_num,gpu,M,N,K,us,kernelName\n"
                     "sm_90,132,H100-80GB-HBM3,16,64,64,1.0,torch.linear\n")
    monkeypatch.setenv("GEMMTUNE_CONFIG_BF16", f"replace:{table}")
    assert main(["lookup", "bf16", "M=16", "N=64", "K=64", "--device", "sm_90:132:H200"]) == 0
    out = capsys.readouterr().out
    assert "rule:       exact" in out and "similar-gpu: a row of H100-80GB-HBM3" in out
    assert main(["lookup", "bf16", "M=16", "N=64", "K=64", "--device",
                 "sm_90:132:H100-80GB-HBM3"]) == 0
    assert "similar-gpu" not in capsys.readouterr().out
    monkeypatch.setenv("GEMMTUNE_DEVICE", "sm_90:132:H200")
    assert main(["tables"]) == 0
    assert "(0 of H200, 1 similar-gpu" in capsys.readouterr().out


def test_readme_set_up_puts_gemmtune_on_the_path_for_its_workflow():
    """README's set-up block must leave the `gemmtune ...` commands of its Workflow runnable: it
    activates the venv that scripts/_venv.sh makes, where the console script is installed."""
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).parent.parent
    readme = (root / "README.md").read_text()
    set_up = readme.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    workflow = readme.split("## Workflow", 1)[1].split("\n## ", 1)[0]
    venv = re.search(r"VENV=\$\{GEMMTUNE_VENV:-([^}]+)\}", (root / "scripts/_venv.sh").read_text())
    assert f". {venv.group(1)}/bin/activate" in set_up
    assert re.search(r"^gemmtune ", workflow, re.M)
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["gemmtune"] == "gemmtune.cli:main"

"""Table formats, merge of sources and overlays, malformed files, look-up order."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from gemmtune.device import DeviceId
from gemmtune.families import get_family
from gemmtune.tables import sources, triton_json
from gemmtune.tables.lookup import Rule, TableIndex, coarse_m, padded_m
from gemmtune.tables.store import TableError, read_table, update_table

BF16 = get_family("bf16").schema
FMOE_SCHEMA = get_family("fmoe").schema

H100 = DeviceId("sm_90", 132)
HEADER = "arch,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,kernelName,err_ratio,tflops,bw\n"


def bf16_row(m, n=4096, k=4096, us=10.0, kernel="torch.linear", arch="sm_90", cu=132,
             dtype="torch.bfloat16"):
    return (f"{arch},{cu},{m},{n},{k},False,{dtype},{dtype},False,False,torch,0,0,{us},"
            f"{kernel},0.0,1.0,1.0\n")


def write(path: Path, *rows: str, header: str = HEADER) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + "".join(rows))
    return path


def key(m, n=4096, k=4096, dtype="torch.bfloat16"):
    return (m, n, k, False, dtype, dtype, False, False)


# ------------------------------------------------------------------------------ padding rules
@pytest.mark.parametrize("m, expected", [
    (1, 16), (16, 16), (17, 32), (100, 112), (256, 256), (257, 288), (1000, 1024),
    (1025, 1088), (4096, 4096), (4097, 4224), (9000, 9088),
])
def test_padded_m(m, expected):
    assert padded_m(m) == expected


@pytest.mark.parametrize("m, n, expected", [
    (1, 4096, 1), (3, 4096, 4), (100, 4096, 128), (1025, 4096, 2048), (9000, 4096, 16384),
    (9000, 8192, 8192), (20000, 14336, 8192),
])
def test_coarse_m(m, n, expected):
    assert coarse_m(m, n) == expected


# ------------------------------------------------------------------------------- look-up order
def index_of(tmp_path, *rows, device=H100):
    path = write(tmp_path / "t.csv", *rows)
    return TableIndex(BF16, read_table(path, BF16).rows, device)


def test_lookup_exact(tmp_path):
    idx = index_of(tmp_path, bf16_row(100, us=1.0), bf16_row(112, us=2.0))
    match = idx.find(key(100))
    assert match.rule is Rule.exact and match.row.us == 1.0


def test_lookup_padded_before_coarse(tmp_path):
    idx = index_of(tmp_path, bf16_row(112, us=2.0), bf16_row(128, us=3.0))
    match = idx.find(key(100))
    assert match.rule is Rule.padded and match.row.key.M == 112


def test_lookup_coarse(tmp_path):
    idx = index_of(tmp_path, bf16_row(128, us=3.0), bf16_row(96, us=4.0))
    match = idx.find(key(100))
    assert match.rule is Rule.coarse and match.row.key.M == 128


def test_lookup_coarse_caps_large_m_wide_n_at_8192(tmp_path):
    idx = index_of(tmp_path, bf16_row(8192, n=14336), bf16_row(16384, n=14336))
    match = idx.find(key(12000, n=14336))
    assert match.rule is Rule.coarse and match.row.key.M == 8192


def test_lookup_nearest(tmp_path):
    idx = index_of(tmp_path, bf16_row(64), bf16_row(512), bf16_row(100, n=2048))
    match = idx.find(key(100))
    assert match.rule is Rule.nearest and match.row.key.M == 64
    assert idx.find(key(400)).row.key.M == 512
    assert idx.find(key(9999)).row.key.M == 512


def test_lookup_nearest_tie_takes_larger(tmp_path):
    idx = index_of(tmp_path, bf16_row(64), bf16_row(192))
    assert idx.find(key(128)).row.key.M == 192  # 128 has no padded/coarse row: 64 and 192 tie


def test_lookup_default_when_other_key_columns_differ(tmp_path):
    idx = index_of(tmp_path, bf16_row(100), bf16_row(100, dtype="torch.float16"))
    assert idx.find(key(100, n=1024)).rule is Rule.default
    assert idx.find(key(100, dtype="torch.float32")).rule is Rule.default


def test_lookup_only_rows_of_this_device(tmp_path):
    idx = index_of(tmp_path, bf16_row(100, cu=114), bf16_row(100, arch="sm_80", cu=132))
    assert len(idx) == 0
    assert idx.find(key(100)).rule is Rule.default


def test_lookup_archless_row_matches_by_cu_num_and_arch_row_wins(tmp_path):
    idx = index_of(tmp_path, bf16_row(100, arch="", us=5.0))
    assert idx.find(key(100)).row.us == 5.0
    idx = index_of(tmp_path, bf16_row(100, arch="", us=5.0), bf16_row(100, us=9.0))
    assert idx.find(key(100)).row.us == 9.0


# ---------------------------------------------------------------------- spellings and aliases
def test_seed_spellings_and_column_aliases(tmp_path):
    header = "gfx,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,kernelId,splitK,us,kernelName,errRatio,tflops,bw,_tag\n"
    path = write(tmp_path / "seed.csv",
                 "sm_90,132,1,8,16,0,dtypes.bf16,torch.float32,false,False,torch,7,0,3.5,torch.linear,0.25,1,2,mine\n",
                 header=header)
    (row,) = read_table(path, BF16).rows
    assert row.arch == "sm_90"
    assert row.key == (1, 8, 16, False, "torch.bfloat16", "torch.float32", False, False)
    assert row.results["solidx"] == 7 and row.results["err_ratio"] == 0.25
    assert row.extra == {"_tag": "mine"}


@pytest.mark.parametrize("spelling", ["dtypes.bf16", "torch.bfloat16", "bf16", "bfloat16"])
def test_dtype_spellings(tmp_path, spelling):
    path = write(tmp_path / "t.csv", bf16_row(1, dtype=spelling))
    assert read_table(path, BF16).rows[0].key.dtype == "torch.bfloat16"


def test_fp8_alias_is_e4m3fn():
    from gemmtune.tables.values import parse_dtype
    assert parse_dtype("dtypes.fp8") == "torch.float8_e4m3fn"
    assert parse_dtype("torch.float8_e4m3fnuz") == "torch.float8_e4m3fnuz"


def test_fmoe_enum_spellings(tmp_path):
    schema = FMOE_SCHEMA
    header = ("cu_num,token,model_dim,inter_dim,expert,topk,act_type,dtype,q_dtype_a,q_dtype_w,"
              "q_type,use_g1u1,doweight_stage1,block_m,ksplit,us1,kernelName1,err1,us2,"
              "kernelName2,err2,us,run_1stage,tflops,bw\n")
    path = write(tmp_path / "tuned_fmoe.csv",
                 "132,4,2304,1536,8,2,ActivationType.Gelu,torch.bfloat16,dtypes.fp8,dtypes.fp8,"
                 "QuantType.per_Token,1,1,32,0,17.8,k1,0.0%,14.5,k2,0.3%,32.3,0,5.26,2629.41\n",
                 header=header)
    (row,) = read_table(path, schema).rows
    assert row.key.act_type == "ActivationType.Gelu" and row.key.q_type == "QuantType.per_Token"
    assert row.key.q_dtype_a == "torch.float8_e4m3fn"
    assert row.kernel_names(schema) == ("k1", "k2") and row.results["err2"] == 0.3


# ------------------------------------------------------------------------------ malformed files
def test_missing_column_names_file_and_column(tmp_path):
    path = write(tmp_path / "t.csv", "132,1,4096,10.0,torch.linear\n",
                 header="cu_num,M,K,us,kernelName\n")
    with pytest.raises(TableError, match=r"t\.csv:1: missing required column\(s\) N"):
        read_table(path, BF16)


def test_unknown_dtype_names_line(tmp_path):
    path = write(tmp_path / "t.csv", bf16_row(1), bf16_row(2, dtype="torch.bfloat17"))
    with pytest.raises(TableError, match=r"t\.csv:3: column dtype: unknown dtype 'torch.bfloat17'"):
        read_table(path, BF16)


def test_non_numeric_m_names_line(tmp_path):
    path = write(tmp_path / "t.csv", bf16_row("abc"))
    with pytest.raises(TableError, match=r"t\.csv:2: column M: expected an integer, got 'abc'"):
        read_table(path, BF16)


@pytest.mark.parametrize("bad, message", [
    (bf16_row(-4), r"column M: M=-4 is out of range: expected 1 <= M <= 2147483647"),
    (bf16_row(4, k=0), r"column K: K=0 is out of range: expected 1 <= K <= 2147483647"),
    (bf16_row(10**12), r"column M: M=1000000000000 is out of range"),
    (bf16_row(4, us="nan"), "column us: nan is not a finite time"),
    (bf16_row(4, us="-1"), "column us: -1.0 is not a finite time"),
    ("sm_90,132,1,2,3\n", "5 values for 18 columns"),
])
def test_bad_rows(tmp_path, bad, message):
    path = write(tmp_path / "t.csv", bad)
    with pytest.raises(TableError, match=r"t\.csv:2: " + message):
        read_table(path, BF16)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("")
    with pytest.raises(TableError, match=r"empty\.csv:1: the file is empty"):
        read_table(path, BF16)


def test_header_only_file_has_no_rows(tmp_path):
    assert read_table(write(tmp_path / "t.csv"), BF16).rows == []


def test_non_strict_read_keeps_good_rows_and_reports_bad(tmp_path):
    path = write(tmp_path / "t.csv", bf16_row(1), bf16_row("x"), bf16_row(3))
    result = read_table(path, BF16, strict=False)
    assert [r.key.M for r in result.rows] == [1, 3]
    assert [e.line for e in result.errors] == [3]


# --------------------------------------------------------------------- merge and overlays
@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """A fake package configs/ folder with a shipped table and a model_configs overlay."""
    configs = tmp_path / "configs"
    write(configs / "bf16_tuned_gemm.csv", bf16_row(1, us=10.0), bf16_row(2, us=10.0))
    write(configs / "model_configs" / "bf16_tuned_gemm_llama.csv", bf16_row(3, us=10.0),
          bf16_row(2, us=4.0))
    write(configs / "model_configs" / "bf16_untuned_gemm_llama.csv", bf16_row(99))
    write(configs / "model_configs" / "a8w8_tuned_gemm_x.csv", bf16_row(98))
    # AITER's names: the family's stem anywhere in the name.
    write(configs / "model_configs" / "dsv3_bf16_tuned_gemm.csv", bf16_row(4, us=10.0))
    write(configs / "model_configs" / "bf16_tuned_batched_gemm_x.csv", bf16_row(97))
    monkeypatch.setattr(sources, "configs_dir", lambda: configs)
    return configs


def ms(rows):
    return sorted(r.key.M for r in rows)


def test_merge_shipped_and_model_configs_keeps_lowest_us_with_one_warning(shipped):
    with pytest.warns(UserWarning, match="1 duplicate key") as record:
        rows = sources.load_merged(BF16)
    assert len([w for w in record if "duplicate" in str(w.message)]) == 1
    assert ms(rows) == [1, 2, 3, 4]
    assert [p.name for p in sources.table_sources(BF16).paths] == [
        "bf16_tuned_gemm.csv", "bf16_tuned_gemm_llama.csv", "dsv3_bf16_tuned_gemm.csv"]
    assert next(r for r in rows if r.key[0] == 2).us == 4.0


def test_overlay_adds_and_aiter_alias(shipped, tmp_path, monkeypatch):
    user = write(tmp_path / "user.csv", bf16_row(5), bf16_row(1, us=1.0))
    other = write(tmp_path / "other.csv", bf16_row(6))
    monkeypatch.setenv("AITER_CONFIG_GEMM_BF16", f"{user}:{other}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = sources.load_merged(BF16)
    assert ms(rows) == [1, 2, 3, 4, 5, 6]
    assert next(r for r in rows if r.key[0] == 1).us == 1.0


def test_gemmtune_name_wins_over_aiter_alias(shipped, tmp_path, monkeypatch):
    monkeypatch.setenv("AITER_CONFIG_GEMM_BF16", str(write(tmp_path / "a.csv", bf16_row(7))))
    monkeypatch.setenv("GEMMTUNE_CONFIG_BF16", str(write(tmp_path / "g.csv", bf16_row(8))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert 8 in ms(sources.load_merged(BF16)) and 7 not in ms(sources.load_merged(BF16))


def test_replace_prefix_drops_shipped(shipped, tmp_path, monkeypatch):
    user = write(tmp_path / "user.csv", bf16_row(5))
    monkeypatch.setenv("GEMMTUNE_CONFIG_BF16", f"replace:{user}")
    assert ms(sources.load_merged(BF16)) == [5]


def test_replace_variable_drops_shipped(shipped, tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_CONFIG_BF16", str(write(tmp_path / "user.csv", bf16_row(5))))
    monkeypatch.setenv("GEMMTUNE_CONFIG_REPLACE", "1")
    assert ms(sources.load_merged(BF16)) == [5]


def test_missing_overlay_file_is_a_clear_error(shipped, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_CONFIG_BF16", "/nonexistent/table.csv")
    with pytest.raises(FileNotFoundError, match="GEMMTUNE_CONFIG_BF16 names /nonexistent/table.csv"):
        sources.load_merged(BF16)


def test_reading_writes_nothing_and_the_merged_copy_is_written_when_asked(shipped):
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in shipped.rglob("*.csv")}
    cache = Path(os.environ["GEMMTUNE_CACHE_DIR"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = sources.load_merged(BF16)
        assert not any(cache.rglob("*")), "a read wrote into the cache folder"
        cached = sources.write_merged(BF16)
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in shipped.rglob("*.csv")}
    assert before == after
    assert cached == sources.merged_cache_path(BF16) and cached.is_relative_to(cache)
    assert ms(read_table(cached, BF16).rows) == ms(rows)


# ----------------------------------------------------------------------------------- writing
def test_write_round_trip_keeps_unknown_columns(tmp_path):
    header = HEADER.rstrip("\n") + ",_tag\n"
    src = write(tmp_path / "src.csv", bf16_row(1).rstrip("\n") + ",keep-me\n", header=header)
    rows = read_table(src, BF16).rows
    out = tmp_path / "out.csv"
    update_table(out, BF16, rows)
    again = read_table(out, BF16).rows
    assert [(r.key, dict(r.results), dict(r.extra)) for r in again] == \
        [(r.key, dict(r.results), dict(r.extra)) for r in rows]


def _add_rows(path: str, start: int, count: int) -> None:
    from gemmtune.tables.store import Row, update_table

    schema = BF16
    for m in range(start, start + count):
        row = Row("sm_90", 132, (m, 64, 64, False, "torch.bfloat16", "torch.bfloat16", False,
                                 False), {"us": 1.0, "kernelName": "torch.linear", "libtype": "torch",
                                          "solidx": 0, "splitK": 0, "err_ratio": 0.0,
                                          "tflops": 0.0, "bw": 0.0, "timing": "", "spread": 0.0,
                                          "env": ""})
        update_table(path, schema, [row])


def test_concurrent_writers_lose_no_rows(tmp_path):
    import multiprocessing as mp

    path = str(tmp_path / "out.csv")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_add_rows, args=(path, 1 + 20 * i, 20)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert ms(read_table(path, BF16).rows) == list(range(1, 81))


# ------------------------------------------------------------------- more malformed inputs
def test_byte_order_mark_does_not_hide_the_arch_column(tmp_path):
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (HEADER + bf16_row(1, arch="sm_80")).encode())
    (row,) = read_table(path, BF16).rows
    assert row.arch == "sm_80"


def test_misspelled_key_column_warns(tmp_path):
    header = HEADER.replace("outdtype", "out_dtype")
    path = write(tmp_path / "t.csv", bf16_row(1), header=header)
    with pytest.warns(UserWarning, match=r"t\.csv:1: unknown column 'out_dtype'.*'outdtype' takes its default"):
        read_table(path, BF16)


@pytest.mark.parametrize("bad, message", [
    (bf16_row(4, kernel=""), "column kernelName: is empty"),
    (bf16_row("1e30"), "column M: expected an integer, got '1e30'"),
])
def test_more_bad_rows(tmp_path, bad, message):
    with pytest.raises(TableError, match=r"t\.csv:2: " + message):
        read_table(write(tmp_path / "t.csv", bad), BF16)


def test_integral_float_m_is_accepted(tmp_path):
    assert read_table(write(tmp_path / "t.csv", bf16_row("16.0")), BF16).rows[0].key[0] == 16


def test_non_utf8_file_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.csv"
    path.write_bytes((HEADER + bf16_row(1)).encode() + b"sm_90,132,2,4096,4096,False,\xe9\n")
    with pytest.raises(TableError, match=r"latin1\.csv:3: not UTF-8"):
        read_table(path, BF16)


def test_replace_variable_leaves_families_without_overlay_alone(shipped, tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_CONFIG_REPLACE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ms(sources.load_merged(BF16)) == [1, 2, 3, 4]  # no bf16 overlay: shipped rows stay


def test_writes_leave_no_lock_beside_the_file_and_follow_the_umask(tmp_path, monkeypatch):
    import stat

    monkeypatch.setenv("GEMMTUNE_LOCK_DIR", str(tmp_path / "locks"))
    rows = read_table(write(tmp_path / "src.csv", bf16_row(1), bf16_row(2)), BF16).rows
    out = tmp_path / "out" / "tuned.csv"
    old = os.umask(0o022)
    try:
        update_table(out, BF16, rows[:1])
        assert sorted(p.name for p in out.parent.iterdir()) == ["tuned.csv"]  # no .lock, no temp
        assert stat.S_IMODE(out.stat().st_mode) == 0o644  # as open() would make it, not 0o600
        (lock,) = (tmp_path / "locks" / "gemmtune-tables").glob("*-tuned.csv.lock")
        os.chmod(out, 0o640)  # a mode the owner chose is kept by a rewrite
        update_table(out, BF16, rows[1:])
        assert stat.S_IMODE(out.stat().st_mode) == 0o640 and len(read_table(out, BF16).rows) == 2
    finally:
        os.umask(old)


# ------------------------------------------------------------------------- device identity
GPU_HEADER = HEADER.replace("arch,cu_num,", "arch,cu_num,gpu,")


def gpu_row(gpu, m, kernel, us=10.0):
    return bf16_row(m, kernel=kernel, us=us).replace("sm_90,132,", f"sm_90,132,{gpu},", 1)


def test_rows_of_the_same_gpu_model_win_within_each_rule(tmp_path):
    path = write(tmp_path / "t.csv", gpu_row("H100-80GB-HBM3", 16, "k.h100"),
                 gpu_row("H200", 16, "k.h200", us=8.0), gpu_row("H200", 32, "k.h200.32"),
                 header=GPU_HEADER)
    rows = read_table(path, BF16).rows
    h100, h200 = DeviceId("sm_90", 132, "H100-80GB-HBM3"), DeviceId("sm_90", 132, "H200")
    for device, kernel in ((h100, "k.h100"), (h200, "k.h200")):
        match = TableIndex(BF16, rows, device).find(key(16))
        assert (match.rule, match.row.results["kernelName"], match.similar_gpu) == \
            (Rule.exact, kernel, False)
    # No row of its own for M=32: the H100 takes the H200's exact row, as a similar-gpu match,
    # before its own padded or nearest rows.
    match = TableIndex(BF16, rows, h100).find(key(32))
    assert (match.rule, match.row.results["kernelName"], match.similar_gpu) == \
        (Rule.exact, "k.h200.32", True)
    # Another model of sm_90/132: both rows are similar; the faster one, whatever the order.
    other = TableIndex(BF16, rows[::-1], DeviceId("sm_90", 132, "H100-SXM5-64GB")).find(key(16))
    assert other.similar_gpu and other.row.results["kernelName"] == "k.h200"


def test_a_table_may_hold_two_gpus_rows_of_one_shape_and_old_tables_load(tmp_path):
    out = tmp_path / "t.csv"
    update_table(out, BF16, read_table(write(tmp_path / "a.csv", gpu_row("H100-80GB-HBM3", 16,
                                                                           "k1"),
                                             header=GPU_HEADER), BF16).rows)
    update_table(out, BF16, read_table(write(tmp_path / "b.csv", gpu_row("H200", 16, "k2"),
                                             header=GPU_HEADER), BF16).rows)
    assert sorted(r.gpu for r in read_table(out, BF16).rows) == ["H100-80GB-HBM3", "H200"]
    old = read_table(write(tmp_path / "old.csv", bf16_row(16)), BF16).rows  # no gpu column
    assert old[0].gpu == ""
    match = TableIndex(BF16, old, DeviceId("sm_90", 132, "H200")).find(key(16))
    assert match.rule is Rule.exact and match.similar_gpu


def test_a_json_config_named_after_the_gpu_model_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMTUNE_TRITON_CONFIG_DIR", str(tmp_path))
    (tmp_path / triton_json.file_name("sm_90", "A16W16", 8, 8)).write_text(
        '{"small": {"kernel": "by-arch"}}')
    assert triton_json.lookup("sm_90", "A16W16", 8, 8, 4, gpu="H200") == "by-arch"
    (tmp_path / triton_json.file_name("H200", "A16W16", 8, 8)).write_text(
        '{"small": {"kernel": "by-gpu"}}')
    assert triton_json.lookup("sm_90", "A16W16", 8, 8, 4, gpu="H200") == "by-gpu"
    assert triton_json.lookup("sm_90", "A16W16", 8, 8, 4, gpu="H100-80GB-HBM3") == "by-arch"

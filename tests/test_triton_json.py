"""Triton JSON configs: buckets, the file format, look-up order, dispatch on a table miss, and a
tiny `gemmtune tune-triton` run end to end (in the interpreter on the CPU)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import warnings

import pytest
import torch

import gemmtune
from gemmtune.cli import main
from gemmtune.families.a8w8.op import A8w8Key
from gemmtune.families.bf16.op import DISPATCH
from gemmtune.tables import triton_json
from gemmtune.tables.triton_json import BucketConfig, bucket_of, lookup, read_configs, write_configs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPLITK = "triton.splitk:BM16.BN32.BK32.SK2.W4.S2"
TILE = "triton.tile:BM16.BN32.BK32.G1.W4.S2"


@pytest.mark.parametrize("m,bucket", [(1, "small"), (16, "small"), (17, "medium_M32"),
                                      (32, "medium_M32"), (64, "medium_M64"),
                                      (65, "medium_M128"), (128, "medium_M128"), (129, "large"),
                                      (256, "large"), (257, "xlarge"), (65536, "xlarge")])
def test_buckets(m, bucket):
    assert bucket_of(m) == bucket


def test_file_names():
    assert triton_json.file_name("sm_90", "A16W16", 4096, 512) == "sm_90-GEMM-A16W16-N=4096-K=512.json"
    assert triton_json.file_name("sm_90", "A8W8") == "sm_90-GEMM-A8W8.json"


def test_round_trip_and_any_fallback(tmp_path, monkeypatch):
    path = tmp_path / triton_json.file_name("cpu", "A16W16", 40, 64)
    write_configs(path, {"small": BucketConfig(SPLITK, {"BLOCK_SIZE_M": 16}),
                         "any": BucketConfig(TILE, {})})
    back = read_configs(path)
    assert back["small"].kernel == SPLITK and back["small"].params["BLOCK_SIZE_M"] == 16
    monkeypatch.setenv("GEMMTUNE_TRITON_CONFIG_DIR", str(tmp_path))
    assert lookup("cpu", "A16W16", 40, 64, 3) == SPLITK
    assert lookup("cpu", "A16W16", 40, 64, 500) == TILE  # no xlarge bucket: "any"
    assert lookup("cpu", "A16W16", 41, 64, 3) is triton_json.NO_FILE  # no file for this (N, K)
    write_configs(path, {"small": BucketConfig(SPLITK, {})})
    assert lookup("cpu", "A16W16", 40, 64, 500) is None  # a bucket the file leaves to torch


def test_first_folder_wins(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, kernel in ((first, SPLITK), (second, TILE)):
        write_configs(folder / triton_json.file_name("cpu", "A16W16", 8, 8),
                      {"any": BucketConfig(kernel, {})})
    monkeypatch.setenv("GEMMTUNE_TRITON_CONFIG_DIR", f"{first}:{second}")
    assert lookup("cpu", "A16W16", 8, 8, 1) == SPLITK


@pytest.mark.parametrize("text,says", [
    ("{\n  \"small\": {\"kernel\": 3}\n}", "needs a \"kernel\" name"),
    ("{\"huge\": {\"kernel\": \"x\"}}", "unknown bucket 'huge'"),
    ("{\n\n  oops\n}", ":3: not valid JSON"),
    ("[1, 2]", "expected an object of buckets"),
])
def test_bad_files_say_where(tmp_path, text, says):
    path = tmp_path / "f.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=says):
        read_configs(path)


def use_configs(tmp_path, monkeypatch, arch: str, n: int | None = None, k: int | None = None):
    """An A16W16_FP16 file (of (N, K), or the default) in a folder dispatch searches: SPLITK for
    small M, and for M32 a config that cannot run K = 64 (9 splits of one 256 step)."""
    write_configs(tmp_path / triton_json.file_name(arch, "A16W16_FP16", n, k),
                  {"small": BucketConfig(SPLITK, {}),
                   "medium_M32": BucketConfig("triton.splitk:BM16.BN32.BK256.SK9.W4.S2", {})})
    monkeypatch.setenv("GEMMTUNE_TRITON_CONFIG_DIR", str(tmp_path))
    gemmtune.reset()


def test_dispatch_uses_a_json_config_on_a_table_miss(tmp_path, monkeypatch):
    use_configs(tmp_path, monkeypatch, gemmtune.current_device().arch, 40, 64)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(5, 64, generator=gen, device=DEVICE).half()
    w = torch.randn(40, 64, generator=gen, device=DEVICE).half()
    y = gemmtune.gemm_a16w16(x, w)
    torch.testing.assert_close(y.float(), x.float() @ w.float().T, atol=2e-2, rtol=2e-2)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.kernel_name == SPLITK
    # A config that cannot run the shape (9 splits of 64 = 1 step of 256) is refused: torch.
    with pytest.warns(UserWarning, match="cannot run M=20"):
        gemmtune.gemm_a16w16(torch.randn(20, 64, device=DEVICE).half(), w)
    names = {p.decision.kernel_name for p in DISPATCH.plans.values()}
    assert names == {SPLITK, "torch.linear"}


def test_default_of_keeps_the_buckets_configs_won_for_half_the_nk():
    a, b = BucketConfig(SPLITK, {"BLOCK_SIZE_M": 16}), BucketConfig(TILE, {"BLOCK_SIZE_M": 16})
    per_nk = [{"small": a, "medium_M32": a, "large": b, "any": b},
              {"small": b, "medium_M32": a},
              {"small": a},
              {}]  # torch won every bucket of the fourth (N, K)
    default = triton_json.default_of(per_nk, tuned=4)
    # small: 3 of 4, most often SPLITK; medium_M32: 2 of 4 (half) -> kept; large: 1 of 4 -> torch;
    # "any" of a per-(N, K) file is not a bucket winner.
    assert {bucket: c.kernel for bucket, c in default.items()} == {"small": SPLITK,
                                                                   "medium_M32": SPLITK}
    assert list(triton_json.default_of(per_nk, tuned=5)) == ["small"]  # a 5th (N, K) has no file
    assert triton_json.default_of([], tuned=0) == {}


def test_default_of_takes_the_winner_that_serves_every_nk_and_beats_torch():
    a, b, c = (BucketConfig(name, {"BLOCK_SIZE_M": 16}) for name in (SPLITK, TILE, "c"))
    per_nk = [{"small": a, "medium_M32": a}, {"small": a, "medium_M32": b},
              {"small": b, "medium_M32": c}]
    # small: a won two (N, K) but runs all of them at 1.05x torch; b, 0.9x. medium_M32: no
    # winner beats torch across the (N, K); large: not measured (the most common winner).
    ratios = {("small", SPLITK): 1.05, ("small", TILE): 0.9, ("medium_M32", SPLITK): 1.1,
              ("medium_M32", TILE): 1.2, ("medium_M32", "c"): 1.0}
    default = triton_json.default_of(per_nk, tuned=3, vs_torch=lambda b, k: ratios.get((b, k)))
    assert {bucket: c.kernel for bucket, c in default.items()} == {"small": TILE}
    per_nk[0]["large"] = per_nk[1]["large"] = b
    default = triton_json.default_of(per_nk, tuned=3, vs_torch=lambda b, k: ratios.get((b, k)))
    assert {bucket: c.kernel for bucket, c in default.items()} == {"small": TILE, "large": TILE}


def test_across_shapes_vs_torch_from_a_profile():
    from gemmtune.families.bf16.op import Bf16Key
    from gemmtune.tune.tune_triton import Screened, across_shapes_vs_torch

    def key(m, n):
        return Bf16Key(m, n, 64, False, "torch.float16", "torch.float16", False, False)

    ok = lambda us: Screened("ok", us, "")  # noqa: E731
    results = {key(1, 40): {"torch.linear": ok(10.0), SPLITK: ok(5.0)},
               key(8, 48): {"torch.linear": ok(10.0), SPLITK: ok(20.0), TILE: ok(8.0)},
               key(16, 48): {"torch.linear": ok(4.0), SPLITK: ok(4.0)},
               # no torch time: not counted
               key(20, 56): {SPLITK: ok(1.0)}}
    vs_torch = across_shapes_vs_torch(results)
    assert vs_torch("small", SPLITK) == pytest.approx((0.5 * 2.0 * 1.0) ** (1 / 3))
    # TILE was no candidate at M = 1 and 16 (it did not fit): torch runs there, 1.0
    assert vs_torch("small", TILE) == pytest.approx(0.8 ** (1 / 3))
    assert vs_torch("large", SPLITK) is None
    # A config that failed one shape (the gate, an error) is out, however fast elsewhere:
    # dispatch would run it there.
    results[key(16, 48)][TILE] = Screened("wrong", 1.0, "max error 0.3")
    assert across_shapes_vs_torch(results)("small", TILE) == math.inf
    a, b = BucketConfig(SPLITK, {}), BucketConfig(TILE, {})
    default = triton_json.default_of([{"small": a}, {"small": b}], tuned=2,
                                     vs_torch=across_shapes_vs_torch(results))
    assert default == {}  # SPLITK is 1.0x torch across the shapes, TILE ruled out


def test_write_default_from_a_folders_files(tmp_path):
    a = BucketConfig(SPLITK, {"BLOCK_SIZE_M": 16})
    for n in (8, 16):
        write_configs(tmp_path / triton_json.file_name("sm_90", "A8W8", n, 64), {"small": a})
    # Other tags' files in the folder are not counted.
    write_configs(tmp_path / triton_json.file_name("sm_90", "A8W8_BLOCKSCALE", 8, 64),
                  {"large": a})
    path = triton_json.write_default(tmp_path, "sm_90", "A8W8")
    assert path == tmp_path / "sm_90-GEMM-A8W8.json" and set(read_configs(path)) == {"small"}
    # 2 of 5: the default is emptied (not removed: a default of the arch in another folder must
    # not speak for these (N, K) either).
    assert triton_json.write_default(tmp_path, "sm_90", "A8W8", tuned=5) == path
    assert read_configs(path) == {}
    # An empty per-(N, K) file is an (N, K) torch won throughout: it counts.
    write_configs(tmp_path / triton_json.file_name("sm_90", "A8W8", 24, 64), {})
    default = read_configs(triton_json.write_default(tmp_path, "sm_90", "A8W8"))
    assert {b: c.kernel for b, c in default.items()} == {"small": SPLITK}  # 2 of 3
    for n in (32, 48):
        write_configs(tmp_path / triton_json.file_name("sm_90", "A8W8", n, 64), {})
    assert read_configs(triton_json.write_default(tmp_path, "sm_90", "A8W8")) == {}  # 2 of 5


def test_dispatch_falls_back_to_the_default_file(tmp_path, monkeypatch):
    """An (N, K) without its own file runs what the default names for M's bucket; a default
    config that cannot run the shape, or M in a bucket the default leaves out, runs torch, with
    no warning (the default was not tuned for this (N, K))."""
    use_configs(tmp_path, monkeypatch, gemmtune.current_device().arch)  # the default file
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    w = torch.randn(24, 96, generator=gen, device=DEVICE).half()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m in (3, 20, 70):
            x = torch.randn(m, 96, generator=gen, device=DEVICE).half()
            y = gemmtune.gemm_a16w16(x, w)
            torch.testing.assert_close(y.float(), x.float() @ w.float().T, atol=2e-2, rtol=2e-2)
    names = {plan.decision.key.M: plan.decision.kernel_name for plan in DISPATCH.plans.values()}
    assert names == {3: SPLITK, 20: "torch.linear", 70: "torch.linear"}


def test_an_nk_file_decides_even_where_it_leaves_m_to_torch(tmp_path, monkeypatch):
    """The default speaks only for (N, K) without a file: a bucket an (N, K)'s file leaves out,
    or an empty file, keeps torch. A default naming a kernel no backend knows warns."""
    arch = gemmtune.current_device().arch
    use_configs(tmp_path, monkeypatch, arch)  # a default with SPLITK for small M
    write_configs(tmp_path / triton_json.file_name(arch, "A16W16_FP16", 24, 96),
                  {"medium_M64": BucketConfig(SPLITK, {})})
    write_configs(tmp_path / triton_json.file_name(arch, "A16W16_FP16", 40, 96), {})
    for n in (24, 40):
        x, w = torch.randn(3, 96, device=DEVICE).half(), torch.randn(n, 96, device=DEVICE).half()
        torch.testing.assert_close(gemmtune.gemm_a16w16(x, w).float(), x.float() @ w.float().T,
                                   atol=2e-2, rtol=2e-2)
    assert {p.decision.kernel_name for p in DISPATCH.plans.values()} == {"torch.linear"}
    write_configs(tmp_path / triton_json.file_name(arch, "A16W16_FP16"),
                  {"small": BucketConfig("triton.nosuch:BM16", {})})
    gemmtune.reset()
    with pytest.warns(UserWarning, match="default Triton JSON config of A16W16_FP16 ignored"):
        gemmtune.gemm_a16w16(torch.randn(3, 64, device=DEVICE).half(),
                             torch.randn(8, 64, device=DEVICE).half())


def test_json_configs_can_be_turned_off(tmp_path, monkeypatch):
    use_configs(tmp_path, monkeypatch, gemmtune.current_device().arch, 40, 64)
    monkeypatch.setenv("GEMMTUNE_TRITON_JSON", "0")
    gemmtune.gemm_a16w16(torch.randn(3, 64, device=DEVICE).half(),
                         torch.randn(40, 64, device=DEVICE).half())
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.kernel_name == "torch.linear"


def test_files_in_force_and_gemmtune_tables_list_them(tmp_path, monkeypatch, capsys):
    """Per (N, K) the file dispatch reads: the GPU model's over the arch's, the first folder's
    over a later one's; the default likewise."""
    first, second = tmp_path / "a", tmp_path / "b"
    one = {"small": BucketConfig(SPLITK, {})}
    write_configs(first / triton_json.file_name("sm_90", "A8W8", 8, 64), one)
    write_configs(second / triton_json.file_name("sm_90", "A8W8", 8, 64), one)
    write_configs(second / triton_json.file_name("H200", "A8W8", 16, 64), one)
    write_configs(second / triton_json.file_name("sm_90", "A8W8"), one)
    monkeypatch.setenv("GEMMTUNE_TRITON_CONFIG_DIR", f"{first}:{second}")
    monkeypatch.setattr(triton_json, "SHIPPED_DIR", tmp_path / "none")
    found = triton_json.files_in_force("sm_90", "A8W8", "H200")
    assert found.per_nk == [first / "sm_90-GEMM-A8W8-N=8-K=64.json",
                            second / "H200-GEMM-A8W8-N=16-K=64.json"]
    assert found.default == second / "sm_90-GEMM-A8W8.json"
    assert triton_json.files_in_force("sm_90", "A8W8_INT8") == ([], None)
    monkeypatch.setenv("GEMMTUNE_DEVICE", "sm_90:132:H200")
    monkeypatch.setenv("GEMMTUNE_TRITON_JSON", "off")
    gemmtune.reset()
    assert main(["tables"]) == 0
    out = capsys.readouterr().out
    assert (f"Triton JSON A8W8: 2 (N, K) file(s), default {second / 'sm_90-GEMM-A8W8.json'} "
            f"(not used: GEMMTUNE_TRITON_JSON=0)") in out


def test_blockscale_dispatch_uses_its_json_configs(tmp_path, monkeypatch):
    from gemmtune import quant
    from gemmtune.families.a8w8_blockscale.op import DISPATCH as BLOCKSCALE
    from gemmtune.kernels.torch_ref import TORCH_BLOCKSCALE, gemm_a8w8_blockscale_ref

    dev = gemmtune.current_device()
    splitk = "triton.splitk:BM16.BN32.BK128.SK2.W4.S2"
    write_configs(tmp_path / triton_json.file_name(dev.arch, "A8W8_BLOCKSCALE", 40, 256),
                  {"small": BucketConfig(splitk, {})})
    # A config whose K step spans two block scales cannot serve block scales: torch.
    write_configs(tmp_path / triton_json.file_name(dev.arch, "A8W8_BLOCKSCALE"),
                  {"small": BucketConfig("triton.splitk:BM16.BN32.BK256.SK1.W4.S2", {})})
    monkeypatch.setenv("GEMMTUNE_TRITON_CONFIG_DIR", str(tmp_path))
    gemmtune.reset()
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    for n in (40, 24):
        xq, xs = quant.per_block_fp8(torch.randn(5, 256, generator=gen, device=DEVICE),
                                     quant.ACT_BLOCK)
        wq, ws = quant.per_block_fp8(torch.randn(n, 256, generator=gen, device=DEVICE) / 16,
                                     quant.WEIGHT_BLOCK)
        y = gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws)
        ref = gemm_a8w8_blockscale_ref(xq, wq, xs, ws, out_dtype=torch.float32)
        torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=3e-2)
    names = {plan.decision.key.N: plan.decision.kernel_name for plan in BLOCKSCALE.plans.values()}
    assert names == {40: splitk, 24: TORCH_BLOCKSCALE}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 24, 48, 100, 300])
def test_gpu_shipped_defaults_serve_an_nk_no_preset_has(m):
    """On an sm_90 GPU a shape whose (N, K) has no row and no file of its own runs what the
    shipped default names for M's bucket (torch where it names nothing), and is right."""
    from gemmtune import quant
    from gemmtune.families.a8w8.op import DISPATCH as A8W8
    from gemmtune.families.a8w8_blockscale.op import DISPATCH as BLOCKSCALE
    from gemmtune.kernels.torch_ref import (TORCH_BLOCKSCALE, TORCH_SCALED_MM,
                                            gemm_a8w8_blockscale_ref, gemm_a8w8_ref)

    dev = gemmtune.current_device()
    if dev.arch != "sm_90":
        pytest.skip("the shipped defaults are Hopper's")
    n, k = 1000, 3072
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=gen, device="cuda")
    w = torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5
    xq, xs = quant.per_token_fp8(x)
    wq, ws = quant.per_channel_fp8(w)
    y = gemmtune.gemm_a8w8(xq, wq, xs, ws)
    ref = gemm_a8w8_ref(xq, wq, xs.reshape(-1), ws.reshape(-1), None, torch.float32)
    assert float((y.float() - ref).norm() / ref.norm()) < 1e-2
    xb, xbs = quant.per_block_fp8(x, quant.ACT_BLOCK)
    wb, wbs = quant.per_block_fp8(w, quant.WEIGHT_BLOCK)
    yb = gemmtune.gemm_a8w8_blockscale(xb, wb, xbs, wbs)
    refb = gemm_a8w8_blockscale_ref(xb, wb, xbs, wbs, out_dtype=torch.float32)
    assert float((yb.float() - refb).norm() / refb.norm()) < 1e-2
    for dispatch, tag, torch_name in ((A8W8, "A8W8", TORCH_SCALED_MM),
                                      (BLOCKSCALE, "A8W8_BLOCKSCALE", TORCH_BLOCKSCALE)):
        (plan,) = dispatch.plans.values()
        named = triton_json.lookup_default(dev.arch, tag, m, dev.gpu)
        # Both defaults name a split-K config up to M = 128 (medium_M128) and nothing above.
        if m <= 128:
            assert named.startswith("triton.splitk:") and plan.decision.kernel_name == named
        else:
            assert named is None and plan.decision.kernel_name == torch_name


def test_tune_triton_refuses_a_kernel_the_family_lacks(tmp_path, capsys):
    assert main(["tune-triton", "persistent", "--nk", "40,256", "--m", "1", "--dtype", "fp8",
                 "--family", "a8w8-blockscale", "-o", str(tmp_path / "cfg")]) == 2
    assert "has no persistent kernel" in capsys.readouterr().err


def run_prefix() -> str:
    """What a tune-triton run here names its files after (the GPU model on a GPU)."""
    dev = gemmtune.current_device()
    return triton_json.tuned_prefix(dev.arch, dev.gpu)


def test_tune_triton_block_scales(tmp_path, capsys):
    """A block-scale family's configs: only K steps within one block scale are candidates."""
    out_dir = tmp_path / "cfg"
    space = tiny_space(tmp_path)
    data = json.loads(open(space).read())
    data.update(BLOCK_SIZE_K=[64, 256], NUM_KSPLIT=[1])
    open(space, "w").write(json.dumps(data))
    assert main(["tune-triton", "splitk", "--nk", "40,256", "--m", "1", "--dtype", "fp8",
                 "--family", "a8w8-blockscale", "--space", space, "-o", str(out_dir)]) == 0
    prefix = run_prefix()
    (cfg,) = read_configs(out_dir / triton_json.file_name(prefix, "A8W8_BLOCKSCALE", 40,
                                                          256)).values()
    assert cfg.kernel.startswith("triton.splitk:BM16.BN32.BK64.SK1")
    with open(out_dir / "tune-triton-splitk-A8W8_BLOCKSCALE-profile.csv") as f:
        ran = {r["kernelName"]: r["status"] for r in csv.DictReader(f)}
    # torch and the one BK64 config ran and passed the gate; BK256 was never a candidate.
    assert len(ran) == 2 and set(ran.values()) == {"ok"}
    assert not any(".BK256." in name for name in ran)


def tiny_space(tmp_path, **extra) -> str:
    path = tmp_path / "space.json"
    path.write_text(json.dumps({"BLOCK_SIZE_M": [16], "BLOCK_SIZE_N": [32], "BLOCK_SIZE_K": [32],
                                "num_warps": [4], "num_stages": [2], "NUM_KSPLIT": [1, 2],
                                **extra}))
    return str(path)


def test_tune_triton_end_to_end(tmp_path, capsys):
    out_dir = tmp_path / "cfg"
    assert main(["tune-triton", "splitk", "--nk", "40,64", "--nk", "24,96", "--m", "1,20",
                 "--dtype", "fp16", "--space", tiny_space(tmp_path), "-o", str(out_dir)]) == 0
    prefix = run_prefix()
    files = sorted(p.name for p in out_dir.glob("*.json"))
    assert files == [f"{prefix}-GEMM-A16W16_FP16-N=24-K=96.json",
                     f"{prefix}-GEMM-A16W16_FP16-N=40-K=64.json", f"{prefix}-GEMM-A16W16_FP16.json"]
    per_nk = read_configs(out_dir / files[1])
    assert set(per_nk) == {"small", "medium_M32"}  # no "any": M = 500 keeps torch
    # Both (N, K) have both buckets: the default has them too, and no "any" (M = 500 of an
    # untuned (N, K) keeps torch as well).
    assert set(read_configs(out_dir / files[2])) == {"small", "medium_M32"}
    assert all(c.kernel.startswith("triton.splitk:BM16.BN32.BK32.SK") for c in per_nk.values())
    assert per_nk["small"].params["NUM_KSPLIT"] in (1, 2)
    err = capsys.readouterr().err
    # The engine tuned the 4 shapes (torch and the 2 configs of each, all through the gate), and
    # the export wrote from its profile.
    assert "tuning 4 shape(s) of bf16" in err and "candidates: 12 ok" in err
    assert "wrote 3 file(s)" in err
    profile = out_dir / "tune-triton-splitk-A16W16_FP16-profile.csv"
    with open(profile) as f:
        assert {r["status"] for r in csv.DictReader(f)} == {"ok"}


def test_export_reads_the_profile_and_names_what_failed(tmp_path, capsys):
    """The JSON export step on its own: a config that failed (here: did not compile) is listed
    and left out; the fastest config that passed is chosen; the run's other device is ignored."""
    from gemmtune.families import get_family
    from gemmtune.tune import tune_triton

    family = get_family("bf16")
    dev = gemmtune.current_device()
    space = tune_triton.SearchSpace.from_file(tiny_space(tmp_path))
    sk1, sk2 = (tune_triton.kernel_configs("splitk", space, 1, 40, 64, torch.float16))
    profile = tmp_path / "profile.csv"
    key = "1,40,64,False,torch.float16,torch.float16,False,False"
    profile.write_text(
        "arch,cu_num,gpu,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,kernelName,status,us,"
        "spread,err_ratio,rel_err,seconds,detail\n"
        f"{dev.arch},{dev.cu_num},{dev.gpu},{key},torch.linear,ok,9.0,0,0,0,0.1,\n"
        f"{dev.arch},{dev.cu_num},{dev.gpu},{key},{sk1.name},ok,7.0,0,0,0,0.1,\n"
        f"{dev.arch},{dev.cu_num},{dev.gpu},{key},{sk2.name},error,inf,0,nan,nan,0.1,"
        "building: CompilationError: out of resources\n"
        f"{dev.arch},{dev.cu_num},OtherGPU,{key},{sk2.name},ok,1.0,0,0,0,0.1,\n")
    results = tune_triton.read_profile(profile, family.schema, (dev.arch, dev.cu_num, dev.gpu))
    target = tune_triton.TritonTarget(family.tuner_class(),
                                      lambda m, n, k: family.gemm_key(m, n, k, "fp16"),
                                      "A16W16_FP16", torch.float16)
    failures = []
    chosen, notes = tune_triton.export_nk("splitk", space, target, 40, 64, [1], results,
                                          failures, on_gpu=False)
    assert {b: c.kernel for b, c in chosen.items()} == {"small": sk1.name} and notes == []
    assert [(f.m, f.config) for f in failures] == [(1, sk2.name)]
    assert "CompilationError: out of resources" in failures[0].why


def test_export_only_writes_a_gpu_profiles_files_anywhere(tmp_path, capsys):
    """--export-only tunes nothing: the files come from the profile, named after the device it
    measured, with that device's config names (PDL on) and torch's times deciding the buckets
    (a GPU profile), wherever the export runs."""
    out_dir = tmp_path / "cfg"
    out_dir.mkdir()
    head = ("arch,cu_num,gpu,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,kernelName,status,us,"
            "spread,err_ratio,rel_err,seconds,detail\n")
    h100 = "sm_90,132,H100-80GB-HBM3"
    fast, slow = ("triton.splitk:BM16.BN32.BK32.SK1.W4.S2.P1",
                  "triton.splitk:BM16.BN32.BK32.SK2.W4.S2.P1")
    lines = []
    for m, torch_us in ((1, 9.0), (20, 5.0)):  # torch wins M = 20's bucket
        key = f"{m},40,64,False,torch.float16,torch.float16,False,False"
        lines += [f"{h100},{key},torch.linear,ok,{torch_us},0,0,0,0.1,",
                  f"{h100},{key},{fast},ok,7.0,0,0,0,0.1,",
                  f"{h100},{key},{slow},ok,8.0,0,0,0,0.1,"]
    profile = out_dir / "tune-triton-splitk-A16W16_FP16-profile.csv"
    # A third shape was cut off mid-screen: its partial results are not exported.
    cut = "64,40,64,False,torch.float16,torch.float16,False,False"
    profile.write_text(head + "\n".join(lines) + f"\n{h100},{cut},{fast},ok,1.0,0,0,0,0.1,\n")
    # The engine's table: the shapes it finished.
    (out_dir / "tune-triton-splitk-A16W16_FP16.csv").write_text(
        "arch,cu_num,gpu,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,"
        "kernelName,err_ratio\n" + "".join(
            f"{h100},{m},40,64,False,torch.float16,torch.float16,False,False,triton,1,1,7.0,"
            f"{fast},0\n" for m in (1, 20)))
    args = ["tune-triton", "splitk", "--nk", "40,64", "--m", "1,20,64", "--dtype", "fp16",
            "--space", tiny_space(tmp_path), "-o", str(out_dir), "--export-only"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "tuning" not in err and "medium_M32 left to torch (best config 1.40x its time)" in err
    written = read_configs(out_dir / "H100-80GB-HBM3-GEMM-A16W16_FP16-N=40-K=64.json")
    assert {b: c.kernel for b, c in written.items()} == {"small": fast}  # no medium_M64
    assert written["small"].params["NUM_KSPLIT"] == 1
    # A profile of two devices: which one the files are for is not clear.
    with open(profile, "a") as f:
        f.write(lines[0].replace(h100, "sm_90,114,H100-PCIe") + "\n")
    assert main(args) == 2
    assert "--export-only needs a profile of one device, found 2" in capsys.readouterr().err


def test_export_only_needs_the_runs_table_and_leaves_unfinished_nk_alone(tmp_path, capsys):
    out_dir = tmp_path / "cfg"
    out_dir.mkdir()
    args = ["tune-triton", "splitk", "--nk", "40,64", "--m", "1", "--dtype", "fp16", "--space",
            tiny_space(tmp_path), "-o", str(out_dir), "--export-only"]
    assert main(args) == 2
    assert "--export-only reads the run's profile" in capsys.readouterr().err
    # A run that finished (40, 64) at M = 1, exported for an (N, K) it never reached: that
    # (N, K)'s older file stays as it was.
    assert main(args[:-1]) == 0
    prefix = run_prefix()
    other = out_dir / triton_json.file_name(prefix, "A16W16_FP16", 24, 96)
    write_configs(other, {"small": BucketConfig(SPLITK, {})})
    before = other.read_text()
    capsys.readouterr()
    assert main([*args, "--nk", "24,96"]) == 0
    assert other.read_text() == before
    assert "N=24 K=96: no shape finished; its file is left as it is" in capsys.readouterr().err
    # The file left alone still counts in the default (2 of 2 (N, K) have "small").
    assert set(read_configs(out_dir / triton_json.file_name(prefix, "A16W16_FP16"))) == {"small"}


def test_tune_triton_with_no_config_that_ran_leaves_no_file(tmp_path, monkeypatch, capsys):
    """No config passed (nor lost to torch): no file, so that --resume tunes the (N, K) again;
    the run says so and exits 1."""
    from gemmtune.tune import tune_triton

    out_dir = tmp_path / "cfg"
    prefix = run_prefix()
    stale = out_dir / triton_json.file_name(prefix, "A16W16_FP16", 40, 64)
    write_configs(stale, {"small": BucketConfig(SPLITK, {})})
    monkeypatch.setattr(tune_triton, "export_nk", lambda *a, **kw: ({}, []))
    assert main(["tune-triton", "splitk", "--nk", "40,64", "--m", "1", "--dtype", "fp16",
                 "--space", tiny_space(tmp_path), "-o", str(out_dir)]) == 1
    assert not stale.exists()
    assert "no config of the search space ran correctly for N=40 K=64: no file" in \
        capsys.readouterr().err


def test_tune_triton_fp8_is_a8w8s_unless_family_says_otherwise(tmp_path):
    out_dir = tmp_path / "cfg"
    assert main(["tune-triton", "splitk", "--nk", "40,64", "--m", "1", "--dtype", "fp8",
                 "--space", tiny_space(tmp_path), "-o", str(out_dir)]) == 0
    prefix = run_prefix()
    assert (out_dir / triton_json.file_name(prefix, "A8W8", 40, 64)).is_file()
    assert not list(out_dir.glob("*A8W8_BLOCKSCALE*"))


def test_tune_triton_refuses_a_cache_modifier(tmp_path, capsys):
    assert main(["tune-triton", "splitk", "--nk", "40,64", "--m", "1", "--space",
                 tiny_space(tmp_path, cache_modifier=[".cg"]), "-o", str(tmp_path)]) == 2
    assert "take no cache modifier" in capsys.readouterr().err


def test_finer_m_leq_buckets_win(tmp_path, monkeypatch):
    path = tmp_path / triton_json.file_name("cpu", "A16W16", 8, 8)
    path.write_text(json.dumps({"M_LEQ_4": {"kernel": TILE}, "small": {"kernel": SPLITK}}))
    monkeypatch.setenv("GEMMTUNE_TRITON_CONFIG_DIR", str(tmp_path))
    assert lookup("cpu", "A16W16", 8, 8, 3) == TILE
    assert lookup("cpu", "A16W16", 8, 8, 5) == SPLITK


def test_tune_triton_resume_keeps_finished_files(tmp_path, capsys, monkeypatch):
    out_dir = tmp_path / "cfg"
    common = ["--m", "1", "--dtype", "fp16", "--space", tiny_space(tmp_path), "-o", str(out_dir)]
    assert main(["tune-triton", "splitk", "--nk", "40,64", *common]) == 0
    first = (out_dir / triton_json.file_name(run_prefix(), "A16W16_FP16", 40,
                                              64)).read_text()
    capsys.readouterr()
    assert main(["tune-triton", "splitk", "--nk", "40,64", "--nk", "24,96", "--resume",
                 *common]) == 0
    err = capsys.readouterr().err
    assert "tuning 1 shape(s)" in err and "N=24 K=96" in err  # the finished (N, K) is kept
    prefix = run_prefix()
    assert (out_dir / triton_json.file_name(prefix, "A16W16_FP16", 40, 64)).read_text() == first
    # The default counts the kept file beside the new one.
    monkeypatch.setattr(triton_json, "default_of", spy(triton_json.default_of, calls := []))
    assert main(["tune-triton", "splitk", "--nk", "40,64", "--nk", "24,96", "--resume",
                 *common]) == 0
    ((per_nk, tuned, vs_torch),) = calls
    assert tuned == 2 and [set(buckets) for buckets in per_nk] == [{"small"}, {"small"}]
    # Interpreter times say nothing of torch's speed: the most common winner (on a GPU, the one
    # that runs the run's shapes fastest against torch).
    assert (vs_torch is None) == (not torch.cuda.is_available())
    default = read_configs(out_dir / triton_json.file_name(prefix, "A16W16_FP16"))
    assert set(default) == {"small"}
    assert "N=40 K=64: kept from an earlier run" in err


def spy(function, calls: list):
    def recorded(per_nk, tuned, vs_torch=None):
        per_nk = list(per_nk)
        calls.append((per_nk, tuned, vs_torch))
        return function(per_nk, tuned, vs_torch)

    return recorded


def test_pick_buckets_leaves_a_bucket_to_torch_where_torch_is_faster():
    from gemmtune.kernels.triton.gemm_splitk import SplitKConfig
    from gemmtune.tune.tune_triton import pick_buckets

    fast, slow = SplitKConfig(16, 32, 64, 1, 2, 3), SplitKConfig(16, 64, 64, 2, 2, 3)
    configs = {c.name: c for c in (fast, slow)}
    timings = {1: {fast.name: 5.0, slow.name: 6.0}, 16: {fast.name: 5.5, slow.name: 6.0},
               64: {fast.name: 9.0, slow.name: 8.0}}
    torch_us = {1: 7.0, 16: 7.0, 64: 7.5}
    chosen, notes = pick_buckets(timings, configs, torch_us)
    assert {b: c.kernel for b, c in chosen.items()} == {"small": fast.name}
    assert notes == ["medium_M64 left to torch (best config 1.07x its time)"]
    chosen, notes = pick_buckets(timings, configs)  # without torch's times: every bucket
    assert chosen["medium_M64"].kernel == slow.name and notes == []


def test_pick_buckets_prefers_the_promoted_twin_within_the_noise():
    from gemmtune.kernels.triton.gemm_splitk import SplitKConfig
    from gemmtune.tune.tune_triton import pick_buckets

    fast = SplitKConfig(64, 64, 128, 1, 4, 3)
    twin = dataclasses.replace(fast, promote_k=128)
    configs = {c.name: c for c in (fast, twin)}
    near = {16: {fast.name: 10.0, twin.name: 10.15}}  # 1.5% slower
    far = {16: {fast.name: 10.0, twin.name: 10.5}}
    assert pick_buckets(near, configs)[0]["small"].kernel == twin.name
    assert pick_buckets(far, configs)[0]["small"].kernel == fast.name


def test_tune_triton_candidates_have_promoted_twins_over_long_k():
    from gemmtune.families.a8w8.tuner import A8w8Tuner
    from gemmtune.tune.tune_triton import SearchSpace, SpaceTuner

    space = SearchSpace(BLOCK_SIZE_M=(16, 64), BLOCK_SIZE_N=(64,), BLOCK_SIZE_K=(128,),
                        NUM_KSPLIT=(1, 4), num_warps=(4,), num_stages=(3,))
    tuner = SpaceTuner(A8w8Tuner, "splitk", space)
    names = [c.name for c in tuner.candidates(A8w8Key(64, 64, 4096, "torch.float8_e4m3fn"),
                                              frozenset())]
    # BM64 with 4 warps is a wgmma dot: SK1 sums 4096 of K (a twin), SK4 1024 (none); BM16 runs
    # mma.sync (none).
    twins = [n for n in names if ".PK128" in n]
    assert len(twins) == 1 and ".BM64." in twins[0].replace(":", ".") and ".SK1." in twins[0]
    assert len(names) == 1 + 4 + 1  # torch, BM16/BM64 x SK1/SK4, the one twin


def test_shipped_json_configs_parse_and_name_kernels_that_exist():
    from gemmtune.families.a8w8.op import REGISTRY as A8W8
    from gemmtune.families.a8w8_blockscale.op import REGISTRY as BLOCKSCALE
    from gemmtune.families.bf16.op import REGISTRY as A16W16
    from gemmtune.kernels.problem import GemmProblem, Scaling

    registries = {"A8W8": A8W8, "A8W8_INT8": A8W8, "A16W16": A16W16, "A16W16_FP16": A16W16,
                  "A8W8_BLOCKSCALE": BLOCKSCALE}
    files = sorted(triton_json.SHIPPED_DIR.glob("*.json"))
    assert files, "no shipped Triton JSON configs"
    for path in files:
        tag = path.stem.split("-GEMM-")[1].split("-N=")[0]
        for bucket, cfg in read_configs(path).items():
            kernel = registries[tag].resolve(cfg.kernel)  # raises on a name no backend parses
            assert kernel is not None
            if tag == "A8W8_BLOCKSCALE":  # a config that cannot take block scales is refused
                BLOCKSCALE.resolve_for(cfg.kernel, GemmProblem(
                    16, 4096, 4096, torch.float8_e4m3fn, torch.bfloat16, scaling=Scaling.block))
            # The guide's keys agree with the kernel name they sit beside.
            assert f"BM{cfg.params['BLOCK_SIZE_M']}.BN{cfg.params['BLOCK_SIZE_N']}." \
                   f"BK{cfg.params['BLOCK_SIZE_K']}" in cfg.kernel, (path.name, bucket)


def test_tune_triton_resume_retunes_a_corrupt_file_and_drops_a_stale_one(tmp_path, monkeypatch,
                                                                          capsys):
    from gemmtune.tune import tune_triton

    out_dir = tmp_path / "cfg"
    out_dir.mkdir()
    prefix = run_prefix()
    corrupt = out_dir / triton_json.file_name(prefix, "A16W16_FP16", 40, 64)
    corrupt.write_text("{ not json")
    common = ["--m", "1", "--dtype", "fp16", "--space", tiny_space(tmp_path), "-o", str(out_dir)]
    assert main(["tune-triton", "splitk", "--nk", "40,64", "--resume", *common]) == 0
    err = capsys.readouterr().err
    assert "not valid JSON" in err and "; tuning this (N, K) again" in err
    assert set(read_configs(corrupt)) == {"small"}  # re-tuned and rewritten
    # A re-run where torch wins every bucket empties the older file (an empty file keeps the
    # (N, K) on torch even where a default file names a config), and the default too.
    monkeypatch.setattr(tune_triton, "export_nk",
                        lambda *a, **kw: ({}, ["small left to torch (best config 1.20x its time)"]))
    assert main(["tune-triton", "splitk", "--nk", "40,64", *common]) == 0
    assert read_configs(corrupt) == {}
    assert read_configs(out_dir / triton_json.file_name(prefix, "A16W16_FP16")) == {}
    assert "small left to torch" in capsys.readouterr().err


def test_tune_triton_persistent_kernel(tmp_path):
    out_dir = tmp_path / "cfg"
    # fp16: interpreter workers run without the test shim, so bf16 dots are wrong there.
    assert main(["tune-triton", "persistent", "--nk", "40,64", "--m", "20", "--dtype", "fp16",
                 "--space", tiny_space(tmp_path, GROUP_SIZE_M=[1, 4]), "-o", str(out_dir)]) == 0
    prefix = run_prefix()
    (cfg,) = read_configs(out_dir / triton_json.file_name(prefix, "A16W16_FP16", 40, 64)).values()
    assert cfg.kernel.startswith("triton.persistent:BM16.BN32.BK32.G")

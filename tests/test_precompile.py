"""``gemmtune precompile``: which rows it builds, how it reports, and on the GPU that the
kernels land in Triton's cache."""

from __future__ import annotations

import pytest
import torch

import gemmtune
from gemm_checks import install_user_table
from gemmtune import cli
from gemmtune import prebuild as pre

HEADER = ("arch,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,"
          "kernelName,err_ratio,tflops,bw\n")
TILE = "triton.tile:BM16.BN16.BK16.G1.W4.S1"
SPLITK = "triton.splitk:BM16.BN16.BK16.SK2.W4.S1"


def _bf16_rows(tmp_path, monkeypatch, *rows):
    dev = gemmtune.current_device()
    path = tmp_path / "bf16.csv"
    path.write_text(HEADER + "".join(
        f"{dev.arch},{dev.cu_num},{m},{n},{k},False,torch.bfloat16,torch.bfloat16,False,False,"
        f"x,0,0,1.0,{kernel},0,0,0\n" for m, n, k, kernel in rows))
    monkeypatch.setenv("GEMMTUNE_CONFIG_BF16", f"replace:{path}")
    gemmtune.reset()


def test_a_job_per_row_that_names_a_triton_kernel(tmp_path, monkeypatch):
    _bf16_rows(tmp_path, monkeypatch, (16, 64, 64, TILE), (32, 64, 64, SPLITK),
               (64, 64, 64, "torch.linear"),
               (128, 64, 64, "cublaslt:id66.tile64x8.stages64xAUTO.sk1.red0.swz0.co3.cl4x2x1.in0"))
    jobs = pre.compile_jobs(["bf16"])
    assert [(j.key[:3], j.kernel) for j in jobs] == [((16, 64, 64), TILE), ((32, 64, 64), SPLITK)]
    # The key goes back to the family's key as the tuner takes it.
    key = gemmtune.get_family("bf16").schema.make_key(jobs[0].key)
    assert key.M == 16 and key.dtype == "torch.bfloat16"


def test_fused_moe_rows_are_one_job_each_with_both_stages():
    jobs = pre.compile_jobs(["fmoe"], gemmtune.DeviceId.parse("sm_90:132:H100"))
    assert jobs and all(j.family == "fmoe" for j in jobs)
    assert all(j.kernel.startswith("triton.") for j in jobs)


def test_a_family_without_a_tuner_is_an_error():
    with pytest.raises(ValueError, match="no tuner"):
        pre.compile_jobs(["batched_bf16"])


def test_worker_processes_build_each_job_and_report_the_ones_that_fail(tmp_path, monkeypatch):
    # Real spawned workers (the interpreter's kernels on the CPU): a good row builds, a name no
    # backend takes fails alone and says why.
    install_user_table(monkeypatch, tmp_path / "bf16.csv", "GEMMTUNE_CONFIG_BF16", HEADER,
                       [(16, 16, 32, False, "torch.float32", "torch.float32", False, False,
                         TILE)])
    (good,) = pre.compile_jobs(["bf16"])
    bad = pre.CompileJob("bf16", good.key, "triton.tile:BM16.BOGUS")
    seen = []
    errors = pre._build_all([good, bad], 2, lambda job, error: seen.append(job))
    assert errors[good] == "" and "BOGUS" in errors[bad]
    assert sorted(seen, key=str) == sorted([good, bad], key=str)


def test_each_job_is_built_or_reported_alone(tmp_path, monkeypatch):
    # In the worker: a name no backend takes fails its own job only.
    _bf16_rows(tmp_path, monkeypatch, (16, 64, 64, TILE))
    good = pre.compile_jobs(["bf16"])[0]
    bad = pre.CompileJob("bf16", good.key, "triton.tile:BM16.BOGUS")
    results = pre._build([bad, good])
    assert results[1] == (good, "")
    assert results[0][0] == bad and "BOGUS" in results[0][1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine without a GPU")
def test_without_a_gpu_nothing_is_built_and_it_says_why(capsys):
    report = gemmtune.precompile()
    assert report.jobs == [] and "no CUDA GPU" in report.note
    assert cli.main(["precompile"]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out


@pytest.mark.gpu
def test_precompile_fills_tritons_cache(tmp_path, monkeypatch):
    _bf16_rows(tmp_path, monkeypatch, (16, 64, 64, TILE), (32, 64, 64, SPLITK))
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    seen = []
    report = gemmtune.precompile(["bf16"], workers=2, progress=lambda *a: seen.append(a))
    assert report.failed == [] and report.compiled == 2 and len(seen) == 2
    assert report.warm_s is not None  # Triton's start, paid in this process
    built = {p.name for p in cache.rglob("*.cubin")}
    assert any("gemm_tile" in name for name in built)
    assert any("splitk" in name for name in built)

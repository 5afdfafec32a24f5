"""How long a serving process's first call of a Triton row takes, with and without
``gemmtune precompile``.

For one Triton row of each GEMM family's tables in force (the first of each), in fresh
processes sharing an empty Triton cache (``TRITON_CACHE_DIR``): the first and second call of
the op (wall clock, synchronised; CUDA already initialised, so the time is the op's own); then
``gemmtune precompile`` for those families into that cache; then the same first calls in a fresh
process, and in one that first ran ``warm_this_process`` (what ``gemmtune.precompile()`` does
in the process that calls it). Writes $OUT/first_call.csv (or ./out) and prints the table last.

    PYTHONPATH=src python3 benchmarks/first_call.py
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAMILIES = ("bf16", "a8w8", "a8w8_blockscale")


def _inputs(family: str, key):
    import torch

    import gemmtune
    from gemmtune import quant

    m, n, k = key.M, key.N, key.K
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    if family == "bf16":
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if key.bias else None
        return lambda: gemmtune.gemm_a16w16(x, w, bias)
    if family == "a8w8":
        (xq, xs), (wq, ws) = quant.per_token_fp8(x), quant.per_channel_fp8(w)
        return lambda: gemmtune.gemm_a8w8(xq, wq, xs, ws)
    (xq, xs), (wq, ws) = quant.per_block_fp8(x, (1, 128)), quant.per_block_fp8(w, (128, 128))
    return lambda: gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws)


def _timed(fn) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def child(jobs_json: str, warm: bool = False) -> None:
    """In a fresh process: the first and second call of each job's op, in ms (JSON out);
    with ``warm``, after ``warm_this_process`` (what ``gemmtune.precompile()`` ends with)."""
    import torch

    import gemmtune
    from gemmtune.families import get_family
    from gemmtune.prebuild import warm_this_process

    torch.zeros(1, device="cuda")  # CUDA's own start is not the op's
    if warm:
        warm_this_process()
    # What the process pays once, whatever the kernel: the tables' loading, Triton's start.
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    results = [dict(family="(process)", key=["first op call, torch row", "", ""],
                    kernel="torch.linear",
                    first_ms=_timed(lambda: gemmtune.gemm_a16w16(x, x)), second_ms=0.0)]
    for job in json.loads(jobs_json):
        family = get_family(job["family"])
        call = _inputs(job["family"], family.schema.make_key(job["key"]))
        first = _timed(call)
        results.append(dict(job, first_ms=first, second_ms=_timed(call)))
    print(json.dumps(results))


def _run_child(jobs: list[dict], env: dict, warm: bool = False) -> list[dict]:
    out = subprocess.run([sys.executable, __file__, "--warm-child" if warm else "--child",
                          json.dumps(jobs)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from gemmtune.prebuild import compile_jobs

    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for family in FAMILIES:
        found = compile_jobs([family])
        if found:
            jobs.append(dict(family=family, key=list(found[0].key), kernel=found[0].kernel))
    cache = tempfile.mkdtemp(prefix="triton-cache-")
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    cold = _run_child(jobs, env)
    start = time.perf_counter()
    built = subprocess.run([sys.executable, "-m", "gemmtune.cli", "precompile", "--families",
                            ",".join(FAMILIES)], env=env, capture_output=True, text=True)
    precompile_s = time.perf_counter() - start
    print(built.stdout.strip(), built.stderr.strip()[-2000:], sep="\n")
    warm = _run_child(jobs, env)
    warmed = _run_child(jobs, env, warm=True)
    rows = [dict(family=c["family"], key=" ".join(map(str, c["key"][:3])), kernel=c["kernel"],
                 first_ms_cold=round(c["first_ms"], 1), second_ms=round(c["second_ms"], 3),
                 first_ms_precompiled=round(w["first_ms"], 1),
                 first_ms_precompiled_warmed=round(p["first_ms"], 1))
            for c, w, p in zip(cold, warm, warmed)]
    with open(out_dir / "first_call.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import torch

    print(f"{torch.cuda.get_device_name()}: gemmtune precompile of {', '.join(FAMILIES)} took "
          f"{precompile_s:.1f} s (rc {built.returncode})")
    print(f"{'family':<16} {'M N K':<16} {'first, cold ms':>15} {'precompiled ms':>15} "
          f"{'+ warmed ms':>12} {'second ms':>10}  kernel")
    for r in rows:
        print(f"{r['family']:<16} {r['key']:<16} {r['first_ms_cold']:>15.1f} "
              f"{r['first_ms_precompiled']:>15.1f} {r['first_ms_precompiled_warmed']:>12.1f} "
              f"{r['second_ms']:>10.3f}  {r['kernel']}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] in ("--child", "--warm-child"):
        child(sys.argv[2], warm=sys.argv[1] == "--warm-child")
    else:
        main()

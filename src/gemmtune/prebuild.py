"""``gemmtune precompile``: compile, ahead of a serving process, every Triton kernel the tables
in force name for this GPU (AITER's ``PREBUILD_KERNELS``).

A Triton kernel compiles on its first call with a new specialisation, which stalls that call for
seconds. Each table row whose kernel is a Triton one is built here as its tuner built it (the
row's shape, the tuner's inputs, one run: the compile and the kernel's C launcher) into
Triton's on-disk cache, in parallel worker processes; a serving process then loads the built
kernels instead of compiling them. A job that fails is tried once more alone in a fresh
worker.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

from gemmtune.tables.values import LibType

# When no job has ended for this long (a compile hung), the jobs left are reported, not waited
# for.
JOB_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class CompileJob:
    """One table row's Triton kernel: the family, the row's key (as plain values) and the
    kernelName a call with that key runs."""

    family: str
    key: tuple
    kernel: str


@dataclass
class PrecompileReport:
    jobs: list[CompileJob]
    failed: list[tuple[CompileJob, str]] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""  # why nothing was compiled, where nothing was
    warm_s: float | None = None  # warm_this_process's time, where it ran

    @property
    def compiled(self) -> int:
        return len(self.jobs) - len(self.failed)

    def summary(self) -> str:
        if self.note:
            return f"gemmtune precompile: {self.note}"
        lines = [f"gemmtune precompile: {self.compiled}/{len(self.jobs)} Triton kernels built "
                 f"in {self.seconds:.1f} s into {triton_cache_dir()}"]
        lines += [f"  failed: {job.family} {job.key} {job.kernel}: {why}"
                  for job, why in self.failed]
        return "\n".join(lines)


def triton_cache_dir() -> str:
    """Where Triton keeps built kernels (``TRITON_CACHE_DIR``, default ~/.triton/cache)."""
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".triton", "cache")


def compile_jobs(families: list[str] | None = None, device=None) -> list[CompileJob]:
    """The Triton kernels of the rows in force for ``device`` (default: the current one), of
    the given families (default: every family with a tuner); one job per row."""
    from gemmtune.dispatch import table_index
    from gemmtune.families import all_families, get_family

    chosen = ([get_family(name) for name in families] if families
              else [f for f in all_families() if f.tuner is not None])
    jobs = []
    for family in chosen:
        if family.tuner is None or family.dispatcher is None:
            raise ValueError(f"{family.cli_name} has no tuner: nothing of it can be precompiled")
        schema = family.schema
        for row in table_index(schema, device).rows():
            names = row.kernel_names(schema)
            if not names:
                continue
            kernel = family.dispatcher.row_kernel(names)
            if all(LibType.of_kernel(part) is LibType.triton for part in kernel.split("+")):
                jobs.append(CompileJob(family.name, tuple(row.key), kernel))
    return jobs


def warm_this_process() -> float:
    """Triton's once-per-process costs, paid now rather than by the first call of a served
    model (measured on an H100 host: 0.6 s with every kernel already in the cache, of which
    0.4 s hashes Triton's own sources into its cache key and 0.15 s imports modules its first
    launch needs): one small tile kernel built in this process, from Triton's cache after the
    first time. Returns the seconds it took."""
    import torch

    from gemmtune.kernels.triton.dispatchable import TritonKernel

    start = time.perf_counter()
    x = torch.zeros(16, 16, device="cuda", dtype=torch.bfloat16)
    TritonKernel(WARM_KERNEL).warmup(x, x, None, torch.bfloat16, None, None)
    return time.perf_counter() - start


WARM_KERNEL = "triton.tile:BM16.BN16.BK16.G1.W4.S1"


def precompile(families: list[str] | None = None, workers: int | None = None,
               progress=None, warm: bool = True) -> PrecompileReport:
    """Build every job of ``compile_jobs(families)`` into Triton's cache, in ``workers``
    processes (default: one per CPU core, at most 8: each holds a CUDA context and a row's
    inputs); with ``warm``, then pay Triton's once-per-process costs in this process
    (``warm_this_process``), so that a serving process that calls this at its start meets no
    stall at its first calls. ``progress(done, total, job, error)`` is called as each job
    finishes. Needs the GPU the tables are for."""
    import torch

    if not torch.cuda.is_available():
        return PrecompileReport([], note="no CUDA GPU here: the kernels are built for the GPU "
                                         "that will run them; run this on that machine")
    jobs = compile_jobs(families)
    report = PrecompileReport(jobs)
    if warm:
        report.warm_s = warm_this_process()
    if not jobs:
        report.note = "the tables in force name no Triton kernel for this GPU"
        return report
    workers = max(1, min(workers or min(os.cpu_count() or 1, 8), len(jobs)))
    started = time.perf_counter()
    done = 0

    def finished(job: CompileJob, error: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(min(done, len(jobs)), len(jobs), job, error)

    errors = _build_all(jobs, workers, finished)
    # Jobs that failed beside the others (out of GPU memory next to the other workers' inputs;
    # a worker lost, or left unusable by a sticky CUDA error, with its later jobs) get one more
    # try, one at a time in a fresh worker; a kernel that cannot build fails there again.
    retry = [job for job in jobs if errors[job]]
    if retry:
        errors.update(_build_all(retry, 1, finished))
    report.failed = [(job, errors[job]) for job in jobs if errors[job]]
    report.seconds = time.perf_counter() - started
    return report


def _build_all(jobs: list[CompileJob], workers: int, finished) -> dict[CompileJob, str]:
    """Each job built in a task of its own on ``workers`` spawned processes, a kernel's jobs
    one after another; the error of each ("" where built), ``finished(job, error)`` called as
    each ends. When no job ends within JOB_TIMEOUT_S (a compile hung), the jobs left are
    reported as not built and the workers are stopped."""
    errors: dict[CompileJob, str] = {}
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
    try:
        ordered = sorted(jobs, key=lambda job: (job.family, job.kernel))
        pending = {pool.submit(_build, [job]): job for job in ordered}
        while pending:
            done, _ = wait(pending, timeout=JOB_TIMEOUT_S, return_when=FIRST_COMPLETED)
            if not done:
                for job in pending.values():
                    errors[job] = f"not built: no job finished within {JOB_TIMEOUT_S:.0f} s"
                    finished(job, errors[job])
                break
            for future in done:
                job = pending.pop(future)
                try:
                    ((_, error),) = future.result()
                except BrokenProcessPool as e:  # a worker died: every job not yet ended
                    error = f"worker lost: {e}"
                errors[job] = error
                finished(job, error)
    finally:
        # A worker stuck in a compile would keep shutdown (and this call) waiting.
        if len(errors) < len(jobs) or any(errors.values()):
            for process in list(getattr(pool, "_processes", {}).values()):
                if process.is_alive():
                    process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
    return errors


def _build(chunk: list[CompileJob]) -> list[tuple[CompileJob, str]]:
    """In a worker: each job's kernel built for its row's shape; (job, error or "")."""
    from gemmtune.families import get_family

    results, tuners = [], {}
    for job in chunk:
        try:
            family = get_family(job.family)
            tuner = tuners.get(job.family)
            if tuner is None:
                tuner = tuners[job.family] = family.tuner_class()()
            key = family.schema.make_key(job.key)
            # Run once, not only compiled: the first launch also builds the kernel's C
            # launcher (a gcc compile, ~0.5 s), which Triton caches beside the kernel.
            tuner.run(job.kernel, tuner.prepare(key, 0))
            results.append((job, ""))
        except Exception as e:  # reported per job; the others still build
            results.append((job, f"{type(e).__name__}: {e}"[:300]))
    return results


def print_progress(done: int, total: int, job: CompileJob, error: str) -> None:
    status = f"FAILED ({error})" if error else "ok"
    print(f"[{done}/{total}] {job.family} {job.kernel} {job.key}: {status}", file=sys.stderr)

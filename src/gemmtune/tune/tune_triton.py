"""``gemmtune tune-triton KERNEL --nk N,K ... --m 16,32,...``: per-kernel JSON config tuning.

For each (N, K) and M, every config of an editable search space (pruned to what fits) is run,
checked against torch (``--atol``/``--rtol``) and timed (``--iters``; CUDA-graph replay over
weight copies larger than L2 on a GPU, wall time in the interpreter on the CPU). Per M bucket
the config with the best geometric-mean time relative to each M's fastest is written to
``{arch}-GEMM-{TAG}-N={N}-K={K}.json``; ``{arch}-GEMM-{TAG}.json`` gets the most common bucket
winner over all (N, K). Configs that fail to compile, run out of resources or give wrong results
are skipped and listed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from gemmtune.tables import triton_json
from gemmtune.tune.progress import Progress

KERNELS = ("splitk", "tile", "persistent")
# --dtype -> (torch dtype, TAG of the JSON files)
DTYPES = {
    "bf16": (torch.bfloat16, "A16W16"), "fp16": (torch.float16, "A16W16_FP16"),
    "fp8": (torch.float8_e4m3fn, "A8W8"), "int8": (torch.int8, "A8W8_INT8"),
}


@dataclass(frozen=True)
class SearchSpace:
    """Values to try per parameter, as the seed's guide names them; ``--space FILE.json``
    replaces any of them. The split-K kernel has no GROUP_SIZE_M (it walks M fastest) and the
    tile and persistent kernels no NUM_KSPLIT: each ignores the other's key."""

    BLOCK_SIZE_M: tuple = (16, 32, 64)
    BLOCK_SIZE_N: tuple = (32, 64, 128)
    BLOCK_SIZE_K: tuple = (64, 128, 256)
    GROUP_SIZE_M: tuple = (1, 8)
    num_warps: tuple = (2, 4, 8)
    num_stages: tuple = (2, 3, 4)
    NUM_KSPLIT: tuple = (1, 2, 4, 8)
    cache_modifier: tuple = (None,)

    @classmethod
    def from_file(cls, path: str | Path) -> SearchSpace:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            raise ValueError(f"{path}: expected an object with keys among {sorted(known)}, got "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        values = {k: tuple(v if isinstance(v, list) else [v]) for k, v in data.items()}
        if any(c is not None for c in values.get("cache_modifier", (None,))):
            raise ValueError(f"{path}: cache_modifier: the kernels here take no cache modifier "
                             f"(their loads use the default); use null")
        return cls(**values)


def kernel_configs(kernel: str, space: SearchSpace, m: int, n: int, k: int,
                   dtype: torch.dtype) -> list:
    """The space's configs of ``kernel`` that fit (M, N, K) on ``dtype``, each once. A block_m
    taller than M needs (16 or M's next power of two) only computes padding rows: pruned, unless
    nothing else is left. Split-K configs get programmatic dependent launch where the GPU has
    it, as the tuner's candidates do."""
    bms = [bm for bm in space.BLOCK_SIZE_M if bm <= max(16, 1 << (m - 1).bit_length())] \
        or [min(space.BLOCK_SIZE_M)]
    if kernel == "splitk":
        from gemmtune.kernels.triton import gemm_splitk
        from gemmtune.kernels.triton.gemm_splitk import SplitKConfig as cls
        from gemmtune.kernels.triton.gemm_splitk import fits
        pdl = (gemm_splitk.PDL_WAIT if torch.cuda.is_available()
               and gemm_splitk.pdl_supported(torch.device("cuda")) else gemm_splitk.PDL_OFF)
        make = [cls(bm, bn, bk, sk, w, s, pdl) for bm in bms
                for bn in space.BLOCK_SIZE_N for bk in space.BLOCK_SIZE_K
                for sk in space.NUM_KSPLIT for w in space.num_warps for s in space.num_stages]
    else:
        if kernel == "tile":
            from gemmtune.kernels.triton.gemm_tile import TileConfig as cls
            from gemmtune.kernels.triton.gemm_tile import fits
        else:
            from gemmtune.kernels.triton.gemm_persistent import PersistentConfig as cls
            from gemmtune.kernels.triton.gemm_persistent import fits
        make = [cls(bm, bn, bk, g, w, s) for bm in bms
                for bn in space.BLOCK_SIZE_N for bk in space.BLOCK_SIZE_K
                for g in space.GROUP_SIZE_M for w in space.num_warps for s in space.num_stages]
    return [c for c in dict.fromkeys(make) if fits(c, m, n, k, dtype)]


def params_of(config) -> dict:
    """A config in the guide's JSON keys."""
    return {"BLOCK_SIZE_M": config.block_m, "BLOCK_SIZE_N": config.block_n,
            "BLOCK_SIZE_K": config.block_k, "GROUP_SIZE_M": getattr(config, "group_m", 1),
            "num_warps": config.num_warps, "num_stages": config.num_stages,
            "NUM_KSPLIT": getattr(config, "split_k", 1), "cache_modifier": None}


@dataclass
class Failure:
    n: int
    k: int
    m: int
    config: str
    why: str


def _launcher(kernel: str):
    """The launch-only function of a kernel family (what dispatch plans call)."""
    if kernel == "splitk":
        from gemmtune.kernels.triton.gemm_splitk import launch_gemm_splitk as launch
    elif kernel == "tile":
        from gemmtune.kernels.triton.gemm_tile import launch_gemm_tile as launch
    else:
        from gemmtune.kernels.triton.gemm_persistent import launch_gemm_persistent as launch
    return launch


class Operands:
    """x and w of one (M, N, K), torch's result to check against, and the launch of a config."""

    def __init__(self, kernel: str, m: int, n: int, k: int, dtype: torch.dtype, seed: int,
                 values: bool = True):
        """``values=False``: uninitialised operands and no reference, enough to compile."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self._launch = _launcher(kernel)
        scaled = dtype in (torch.float8_e4m3fn, torch.int8)
        self.out_dtype = torch.bfloat16 if scaled else dtype
        if not values:
            self.x = torch.empty(m, k, dtype=dtype, device=device)
            self.w = torch.empty(n, k, dtype=dtype, device=device)
            self.scales = (torch.empty(m, device=device), torch.empty(n, device=device)) \
                if scaled else None
            return
        gen = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(m, k, generator=gen, device=device)
        w = torch.randn(n, k, generator=gen, device=device) / math.sqrt(k)
        self.scales = None
        if dtype in (torch.float8_e4m3fn, torch.int8):
            from gemmtune import quant

            per_token, per_channel = quant.token_channel_quantisers(dtype)
            (x, xs), (w, ws) = per_token(x), per_channel(w)
            self.scales = (xs.reshape(-1), ws.reshape(-1))
        else:
            x, w = x.to(dtype), w.to(dtype)
        self.x, self.w = x, w
        if self.scales:
            from gemmtune.ops.gemm_a8w8 import scaled_mm_torch

            self.reference = scaled_mm_torch(x, w, None, self.out_dtype, *self.scales).float()
        else:
            self.reference = torch.nn.functional.linear(x, w).float()

    def run(self, config, x=None, w=None, out=None) -> torch.Tensor:
        """Into ``out``, or into a fresh NaN-poisoned output (for the correctness check)."""
        x = self.x if x is None else x
        w = self.w if w is None else w
        if out is None:
            out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=self.out_dtype,
                             device=x.device)
        sa, sb = self.scales or (None, None)
        return self._launch(x, w, None, out, sa, sb, config)

    def run_torch(self, w=None) -> torch.Tensor:
        """What a shape without any config runs: torch's kernel (the reference's call)."""
        w = self.w if w is None else w
        if self.scales:
            from gemmtune.ops.gemm_a8w8 import scaled_mm_torch

            return scaled_mm_torch(self.x, w, None, self.out_dtype, *self.scales)
        return torch.nn.functional.linear(self.x, w)


def time_config(ops: Operands, config, iters: int) -> float:
    """µs per call of ``config`` (or of torch's kernel, for None): CUDA-graph replay over weight
    copies beyond L2, or CPU wall time."""
    if not ops.x.is_cuda:
        start = time.perf_counter()
        ops.run(config) if config is not None else ops.run_torch()
        return (time.perf_counter() - start) * 1e6
    from gemmtune.tune.gpulock import GpuLock, gpu_label
    from gemmtune.tune.timing import copies_to_exceed_l2, graph_replay_us

    sets = ops.__dict__.setdefault("_sets", [
        ops.w.clone() for _ in range(copies_to_exceed_l2(ops.w.numel() * ops.w.element_size()))])
    # One preallocated output: the poisoning fill of run() would be timed with the kernel.
    out = torch.empty(ops.x.shape[0], ops.w.shape[0], dtype=ops.out_dtype, device=ops.x.device)
    with GpuLock(gpu_label(torch.cuda.current_device())):  # no tuner times on it meanwhile
        call = ((lambda w: ops.run(config, w=w, out=out)) if config is not None
                else (lambda w: ops.run_torch(w)))
        return graph_replay_us(call, sets, replays=iters)[0]


def _compile_worker(kernel: str, n: int, k: int, m: int, dtype: torch.dtype,
                    configs: list) -> int:
    """Compile ``configs`` for (M, N, K) into Triton's on-disk cache; how many compiled. Errors
    are left for the timing pass, which reports them."""
    ops = Operands(kernel, m, n, k, dtype, seed=0, values=False)
    out = torch.empty(m, n, dtype=ops.out_dtype, device=ops.x.device)
    sa, sb = ops.scales or (None, None)
    done = 0
    for config in configs:
        try:
            ops._launch(ops.x, ops.w, None, out, sa, sb, config, warmup=True)
            done += 1
        except Exception:  # reported by the timing pass, with its message
            pass
    return done


def precompile(kernel: str, space: SearchSpace, nks: list[tuple[int, int]], ms: list[int],
               dtype: torch.dtype, jobs: int, out) -> None:
    """Compile every config of every (N, K) in ``jobs`` processes before timing: Triton compiles
    one kernel at a time per process, and a few hundred configs would otherwise take most of
    the run. The timing pass then loads them from the cache."""
    import concurrent.futures as cf
    import multiprocessing as mp

    started = time.monotonic()
    tasks = []
    for n, k in nks:
        configs = list(dict.fromkeys(c for m in ms
                                     for c in kernel_configs(kernel, space, m, n, k, dtype)))
        per_task = max(1, -(-len(configs) // jobs))
        tasks += [(kernel, n, k, max(ms), dtype, configs[i:i + per_task])
                  for i in range(0, len(configs), per_task)]
    compiled = 0
    try:
        with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            for done in pool.map(_compile_worker, *zip(*tasks)):
                compiled += done
    # An optional speed-up: whatever stops it (a worker out of memory or killed), the timing
    # pass compiles what is missing itself.
    except Exception as e:
        out.write(f"precompiling stopped ({type(e).__name__}: {str(e)[:200]}); the rest "
                  f"compiles while timing\n")
        return
    out.write(f"precompiled {compiled} (config, N, K) in {time.monotonic() - started:.0f} s with "
              f"{jobs} processes\n")


def tune_nk(kernel: str, space: SearchSpace, n: int, k: int, ms: list[int], dtype: torch.dtype,
            atol: float, rtol: float, iters: int, failures: list[Failure]
            ) -> tuple[dict[int, dict], dict[int, float], dict]:
    """{M: {config name: µs}} of the configs that ran and matched torch, {M: torch's µs}, and
    {config name: config} of every config tried."""
    timings: dict[int, dict] = {}
    torch_us: dict[int, float] = {}
    configs_by_name: dict = {}
    for m in ms:
        ops = Operands(kernel, m, n, k, dtype, seed=m * 7919 + n)
        timings[m] = {}
        torch_us[m] = time_config(ops, None, iters)
        for config in kernel_configs(kernel, space, m, n, k, dtype):
            configs_by_name[config.name] = config
            try:
                y = ops.run(config).float()
            # Any failure to compile (CompilationError, PTXASError, OutOfResources are Triton's
            # own exception types) or to launch skips this config, never the run.
            except Exception as e:
                failures.append(Failure(n, k, m, config.name, f"{type(e).__name__}: {e}"[:200]))
                continue
            bad = ~torch.isclose(y, ops.reference, atol=atol, rtol=rtol)
            if bool(bad.any()):
                failures.append(Failure(n, k, m, config.name,
                                        f"{int(bad.sum())} of {bad.numel()} elements differ from "
                                        f"torch beyond atol={atol} rtol={rtol}"))
                continue
            timings[m][config.name] = time_config(ops, config, iters)
    return timings, torch_us, configs_by_name


def pick_buckets(timings: dict[int, dict], configs_by_name: dict,
                 torch_us: dict[int, float] | None = None) -> tuple[dict, list[str]]:
    """Per bucket: the config with the lowest geometric mean of time / fastest over the bucket's
    M values (among configs that ran at all of them), and notes on the buckets left out. A
    bucket whose pick is slower than torch there (geometric mean over its M) is left out: a
    shape without a CSV row then runs torch, as it would without the file. No ``any``: a bucket
    that no tuned M fell into keeps torch too, rather than a config picked for other M (a
    split-K config tuned at M <= 256 would run M = 4096 far slower than cuBLAS)."""
    chosen, notes = {}, []
    for bucket, _ in triton_json.BUCKETS:
        ms = [m for m in timings if triton_json.bucket_of(m) == bucket and timings[m]]
        if not ms:
            continue
        common = set.intersection(*(set(timings[m]) for m in ms))
        if not common:
            continue

        def score(name):
            return statistics.fmean(math.log(timings[m][name] / min(timings[m].values()))
                                    for m in ms)

        best = min(sorted(common), key=score)
        if torch_us:
            vs_torch = math.exp(statistics.fmean(math.log(timings[m][best] / torch_us[m])
                                                 for m in ms))
            if vs_torch > 1.0:
                notes.append(f"{bucket} left to torch (best config {vs_torch:.2f}x its time)")
                continue
        chosen[bucket] = best
    return ({b: triton_json.BucketConfig(name, params_of(configs_by_name[name]))
             for b, name in chosen.items()}, notes)


def tune_and_pick(args: argparse.Namespace, space: SearchSpace, n: int, k: int,
                  dtype: torch.dtype, failures: list[Failure]) -> tuple[dict, list[str]]:
    timings, torch_us, configs_by_name = tune_nk(args.kernel, space, n, k, args.m, dtype,
                                                 args.atol, args.rtol, args.iters, failures)
    # On the CPU both are interpreter wall times: no basis to leave a bucket to torch.
    return pick_buckets(timings, configs_by_name, torch_us if torch.cuda.is_available() else None)


def run(args: argparse.Namespace, out=None) -> int:
    from gemmtune.device import current_device

    out = out or sys.stderr
    dtype, tag = DTYPES[args.dtype]
    space = SearchSpace.from_file(args.space) if args.space else SearchSpace()
    arch = current_device().arch
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    failures: list[Failure] = []
    winners: dict[str, Counter] = {}
    params_by_name: dict[str, dict] = {}
    kept: dict[tuple[int, int], dict] = {}
    for nk in args.nk if args.resume else []:
        configs = _readable(out_dir / triton_json.file_name(arch, tag, *nk), out)
        if configs is not None:
            kept[nk] = configs
    todo = [nk for nk in args.nk if nk not in kept]
    if args.jobs > 1 and todo and torch.cuda.is_available():
        precompile(args.kernel, space, todo, args.m, dtype, args.jobs, out)
    progress = Progress(len(args.nk), f"tune-triton {args.kernel} {tag}", out)
    written, missing = [], []
    for n, k in args.nk:
        started = time.monotonic()
        path = out_dir / triton_json.file_name(arch, tag, n, k)
        if (n, k) in kept:  # --resume: a file from an earlier run counts as tuned
            chosen = kept[(n, k)]
            note = "kept from an earlier run"
        else:
            chosen, left_out = tune_and_pick(args, space, n, k, dtype, failures)
            if chosen:
                triton_json.write_configs(path, chosen)
                written.append(path)
            else:
                # No config beat torch (or none ran): an older file for this (N, K) must not
                # keep sending shapes to configs this run found slower.
                path.unlink(missing_ok=True)
                if not left_out:
                    missing.append((n, k))
            note = "; ".join([f"{len(chosen)} bucket(s) in {time.monotonic() - started:.1f}s",
                              *left_out])
        for bucket, cfg in chosen.items():
            if bucket != triton_json.ANY:
                winners.setdefault(bucket, Counter())[cfg.kernel] += 1
                params_by_name[cfg.kernel] = cfg.params
        progress.update(f"N={n} K={k}: {note}", ok=(n, k) not in missing)
    if winners:
        default = {b: triton_json.BucketConfig(c.most_common(1)[0][0],
                                               params_by_name[c.most_common(1)[0][0]])
                   for b, c in winners.items()}
        # The arch default also names the most common winner over all buckets, for a reader
        # that wants one config.
        overall = Counter(name for c in winners.values() for name in c.elements())
        best = overall.most_common(1)[0][0]
        default[triton_json.ANY] = triton_json.BucketConfig(best, params_by_name[best])
        path = out_dir / triton_json.file_name(arch, tag)
        triton_json.write_configs(path, default)
        written.append(path)
    for f in failures:
        out.write(f"skipped N={f.n} K={f.k} M={f.m} {f.config}: {f.why}\n")
    out.write(f"wrote {len(written)} file(s) to {out_dir}; {len(failures)} config run(s) "
              f"skipped\n")
    for n, k in missing:
        out.write(f"no config of the search space ran correctly for N={n} K={k}: no file\n")
    return 1 if missing else 0


def _readable(path: Path, out) -> dict | None:
    """The configs of an earlier run's file, or None (missing, or unreadable: said, re-tuned)."""
    if not path.is_file():
        return None
    try:
        return triton_json.read_configs(path)
    except ValueError as e:
        out.write(f"{e}; tuning this (N, K) again\n")
        return None


def _nk(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--nk expects N,K (e.g. 4096,4096), got {text!r}")
    if n <= 0 or k <= 0:
        raise argparse.ArgumentTypeError(f"--nk: N and K must be positive, got {text!r}")
    return n, k


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kernel", choices=KERNELS, help="Triton kernel family")
    p.add_argument("--nk", type=_nk, action="append", required=True, metavar="N,K",
                   help="a weight shape; repeat for several")
    p.add_argument("--m", type=lambda t: [int(v) for v in t.split(",")],
                   default=[1, 16, 32, 64, 128, 256, 1024], metavar="M,M,...",
                   help="token counts (default 1,16,32,64,128,256,1024)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--space", metavar="JSON", help="search space: lists per key of "
                   "SearchSpace (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages, "
                   "NUM_KSPLIT, cache_modifier)")
    p.add_argument("--atol", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=1e-2)
    p.add_argument("--iters", type=int, default=20, help="timed graph replays per config")
    p.add_argument("--resume", action="store_true",
                   help="keep the per-(N, K) files already in the output folder (a run cut off "
                        "goes on where it stopped); the default file counts them too")
    p.add_argument("--jobs", type=int, default=1, metavar="J",
                   help="compile the configs in J processes before timing (GPU only)")
    p.add_argument("-o", "--output", default="out/triton_configs", metavar="DIR")

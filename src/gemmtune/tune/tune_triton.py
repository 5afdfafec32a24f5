"""``gemmtune tune-triton KERNEL --nk N,K ... --m 16,32,...``: per-kernel Triton JSON configs,
tuned by the one engine.

Every (N, K) x M becomes a shape of the family that owns the dtype (bf16/fp16: ``bf16``;
fp8/int8: ``a8w8``), and the engine tunes those shapes as it tunes any table: the candidates are
the kernel's configs from an editable search space (pruned to what fits) beside the family's
torch baseline, each run in a worker process (a config that raises, hangs or crashes is
recorded, the run goes on), checked against the fp32 reference by the correctness gate and timed
as deployed (CUDA-graph replay over copies larger than L2). Every candidate's result goes to a
profile file in the output folder; the JSON export, the last step, reads it: per (N, K) and M
bucket the config with the best geometric-mean time relative to each M's fastest is written to
``{arch}-GEMM-{TAG}-N={N}-K={K}.json`` unless torch was faster there, and
``{arch}-GEMM-{TAG}.json`` gets, in the buckets a config won for at least half of the (N, K),
the winner that runs all of the run's shapes of the bucket fastest, if that beats torch
(``triton_json.default_of``, ``across_shapes_vs_torch``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import torch

from gemmtune.kernels.problem import Scaling
from gemmtune.tables import triton_json
from gemmtune.tables.schema import Schema
from gemmtune.tables.store import Row, read_table, write_table
from gemmtune.tables.values import LibType
from gemmtune.tune.engine import MIN_NOISE, TuneConfig, Tuner, default_gpus
from gemmtune.tune.family import Candidate, FamilyTuner, TuneOptions

KERNELS = ("splitk", "tile", "persistent")


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
                   dtype: torch.dtype, block_scales: bool = False) -> list:
    """The space's configs of ``kernel`` that fit (M, N, K) on ``dtype`` (and FP8 block scales,
    with ``block_scales``), each once. A block_m taller than M needs (16 or M's next power of
    two) only computes padding rows: pruned, unless nothing else is left. Split-K configs get
    programmatic dependent launch where the GPU has it, as the tuner's candidates do."""
    bms = [bm for bm in space.BLOCK_SIZE_M if bm <= max(16, 1 << (m - 1).bit_length())] \
        or [min(space.BLOCK_SIZE_M)]
    from gemmtune.kernels.triton._checks import why_not_block_scaled

    if kernel == "splitk":
        from gemmtune.kernels.triton import gemm_splitk as module
        from gemmtune.kernels.triton._splits import pdl_where_supported

        pdl = pdl_where_supported()
        make = [module.SplitKConfig(bm, bn, bk, sk, w, s, pdl) for bm in bms
                for bn in space.BLOCK_SIZE_N for bk in space.BLOCK_SIZE_K
                for sk in space.NUM_KSPLIT for w in space.num_warps for s in space.num_stages]
    else:
        if kernel == "tile":
            from gemmtune.kernels.triton import gemm_tile as module

            cls = module.TileConfig
        else:
            from gemmtune.kernels.triton import gemm_persistent as module

            cls = module.PersistentConfig
        make = [cls(bm, bn, bk, g, w, s) for bm in bms
                for bn in space.BLOCK_SIZE_N for bk in space.BLOCK_SIZE_K
                for g in space.GROUP_SIZE_M for w in space.num_warps for s in space.num_stages]
    return [c for c in dict.fromkeys(make) if module.fits(c, m, n, k, dtype)
            and not (block_scales and why_not_block_scaled(c, dtype))]


def params_of(config) -> dict:
    """A config in the guide's JSON keys."""
    return {"BLOCK_SIZE_M": config.block_m, "BLOCK_SIZE_N": config.block_n,
            "BLOCK_SIZE_K": config.block_k, "GROUP_SIZE_M": getattr(config, "group_m", 1),
            "num_warps": config.num_warps, "num_stages": config.num_stages,
            "NUM_KSPLIT": getattr(config, "split_k", 1), "cache_modifier": None}


class SpaceTuner:
    """A GEMM family's tuner whose candidates are one kernel's configs from a search space, plus
    the family's torch baseline; everything else (inputs, the checked run, timing) is the
    family tuner's own, reached through attribute look-up. Built in each worker as
    ``functools.partial(SpaceTuner, tuner_cls, kernel, space)``."""

    def __init__(self, tuner_cls: type, kernel: str, space: SearchSpace):
        self.base: FamilyTuner = tuner_cls()
        self.kernel = kernel
        self.space = space

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def candidates(self, key: tuple, libtypes: frozenset[str]) -> list[Candidate]:
        """torch's baseline and the space's configs; FP8 split-K configs that sum a long K
        with fast accumulation also run promoted (``gemm_splitk.promoted_twin``), as the
        table tuners' do."""
        p = self.base.shape(key)
        baseline = self.base.candidates(key, frozenset({LibType.torch.value}))
        configs = kernel_configs(self.kernel, self.space, p.m, p.n, p.k, p.dtype,
                                 p.scaling is Scaling.block)
        if self.kernel == "splitk" and p.scaling is not Scaling.block:
            from gemmtune.kernels.triton.gemm_splitk import promoted_twin, why_not_fits

            twins = [promoted_twin(c, p.k, p.dtype) for c in configs]
            configs += [t for t in twins
                        if t is not None and why_not_fits(t, p.m, p.n, p.k, p.dtype) is None]
        found = [Candidate(c.name, LibType.triton.value, splitk=getattr(c, "split_k", 0))
                 for c in configs]
        return [dataclasses.replace(c, solidx=i) for i, c in enumerate(baseline + found)]


@dataclass(frozen=True)
class TritonTarget:
    """What tune-triton needs of the family that owns the dtype (``gemmtune.cli`` finds it)."""

    tuner: type  # the family's GEMM tuner class
    gemm_key: Callable[[int, int, int], tuple]  # (M, N, K) -> the family's key in this dtype
    tag: str  # TAG of the JSON files
    dtype: torch.dtype


@dataclass
class Failure:
    n: int
    k: int
    m: int
    config: str
    why: str


@dataclass(frozen=True)
class RunFiles:
    """What a run leaves in the output folder beside the JSON files: the shapes it tuned, the
    engine's table of winners, and its profile (every candidate's result), which the export
    reads and ``--resume`` continues from."""

    shapes: Path
    table: Path
    profile: Path

    @classmethod
    def of(cls, out_dir: Path, kernel: str, tag: str) -> RunFiles:
        stem = out_dir / f"tune-triton-{kernel}-{tag}"
        return cls(Path(f"{stem}-shapes.csv"), Path(f"{stem}.csv"), Path(f"{stem}-profile.csv"))


class Screened(NamedTuple):
    """One candidate's result in a profile file: its status, screen time and why it failed."""

    status: str
    us: float
    detail: str


def read_profile(path: Path, schema: Schema, device: tuple[str, int, str]
                 ) -> dict[tuple, dict[str, Screened]]:
    """{key: {kernelName: Screened}} of one device from a profile file; the last result of a
    candidate wins (a re-run appends)."""
    results: dict[tuple, dict[str, Screened]] = {}
    if not path.exists():
        return results
    with open(path, newline="", encoding="utf-8") as f:
        for record in csv.DictReader(f):
            if (record["arch"], int(record["cu_num"]), record.get("gpu", "")) != device:
                continue
            key = schema.make_key(col.parse(record[col.name]) for col in schema.key)
            results.setdefault(key, {})[record["kernelName"]] = Screened(
                record["status"], float(record["us"]), record["detail"])
    return results


def timings_of(results: dict[str, Screened]) -> tuple[dict[str, float], float | None]:
    """(µs of the configs that passed, µs of the torch baseline or None) of one shape."""
    configs, torch_us = {}, None
    for name, screened in results.items():
        if screened.status != "ok" or not math.isfinite(screened.us):
            continue
        if LibType.of_kernel(name) is LibType.torch:
            torch_us = screened.us
        else:
            configs[name] = screened.us
    return configs, torch_us


def pick_buckets(timings: dict[int, dict], configs_by_name: dict,
                 torch_us: dict[int, float] | None = None) -> tuple[dict, list[str]]:
    """Per bucket: the config with the lowest geometric mean of time / fastest over the bucket's
    M values (among configs that ran at all of them), and notes on the buckets left out. A
    bucket whose pick is slower than torch there (geometric mean over its M, where torch has a
    time at each; ``torch_us`` None: no comparison) is left out: a
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
        # A fast-accumulating FP8 config gives way to its promoted twin within the noise, as in
        # the table tuners (gemm_splitk.promoted_twin).
        twin = _promoted_name(configs_by_name[best])
        if twin in common and score(twin) <= score(best) + math.log1p(MIN_NOISE):
            best = twin
        if torch_us is not None and all(m in torch_us for m in ms):
            vs_torch = math.exp(statistics.fmean(math.log(timings[m][best] / torch_us[m])
                                                 for m in ms))
            if vs_torch > 1.0:
                notes.append(f"{bucket} left to torch (best config {vs_torch:.2f}x its time)")
                continue
        chosen[bucket] = best
    return ({b: triton_json.BucketConfig(name, params_of(configs_by_name[name]))
             for b, name in chosen.items()}, notes)


class _Measured(NamedTuple):
    """One shape of a profile as the default rule reads it."""

    configs: dict[str, float]  # µs of the configs that passed
    torch_us: float
    failed: frozenset[str]  # configs that ran and did not pass (wrong, error, timeout, ...)


def across_shapes_vs_torch(results: dict) -> Callable[[str, str], float | None]:
    """``(bucket, kernel) ->`` the kernel's time over torch's, geometric mean over the shapes of
    ``results`` whose M lies in the bucket (None where no such shape has torch's time): how one
    config would serve every (N, K) tuned. A shape the kernel was no candidate for counts as
    torch's own time (dispatch runs torch where a default config cannot run the shape); one it
    failed on (the gate, an error, a time-out) rules it out (inf): dispatch would run it."""
    per_bucket: dict[str, list[_Measured]] = {}
    for key, found in results.items():
        configs, torch_us = timings_of(found)
        if torch_us is not None:
            failed = frozenset(name for name, s in found.items()
                               if name not in configs and LibType.of_kernel(name)
                               is not LibType.torch)
            per_bucket.setdefault(triton_json.bucket_of(key.M), []).append(
                _Measured(configs, torch_us, failed))

    def vs_torch(bucket: str, kernel: str) -> float | None:
        shapes = per_bucket.get(bucket)
        if not shapes:
            return None
        if any(kernel in shape.failed for shape in shapes):
            return math.inf
        return math.exp(statistics.fmean(
            math.log(shape.configs.get(kernel, shape.torch_us) / shape.torch_us)
            for shape in shapes))

    return vs_torch


def _promoted_name(config) -> str | None:
    """The name of a fast-accumulating split-K config's promoted twin, or None."""
    from gemmtune.kernels.triton.gemm_splitk import SplitKConfig, promoted

    if not isinstance(config, SplitKConfig) or config.promote_k:
        return None
    return promoted(config).name


def export_nk(kernel: str, space: SearchSpace, target: TritonTarget, n: int, k: int, ms: list[int],
              results: dict, failures: list[Failure], on_gpu: bool) -> tuple[dict, list[str]]:
    """The buckets of one (N, K) from the profile's results of its shapes: the configs of
    ``kernel`` it names (as they ran, PDL included) that lie in ``space``. ``on_gpu``: the
    profile was measured on a GPU, so torch's times there decide the buckets it keeps (on the
    CPU both are interpreter wall times: no basis for that)."""
    timings: dict[int, dict] = {}
    torch_us: dict[int, float] = {}
    configs_by_name: dict = {}
    for m in ms:
        shape = results.get(target.gemm_key(m, n, k), {})
        for name, screened in shape.items():
            if screened.status != "ok" and LibType.of_kernel(name) is not LibType.torch:
                failures.append(Failure(n, k, m, name,
                                        f"{screened.status}: {screened.detail}"[:200]))
        configs_by_name.update(configs_in_space(kernel, space, shape))
        timings[m], baseline = timings_of(shape)
        timings[m] = {name: us for name, us in timings[m].items() if name in configs_by_name}
        if baseline is not None:
            torch_us[m] = baseline
    return pick_buckets(timings, configs_by_name, torch_us if on_gpu else None)


def configs_in_space(kernel: str, space: SearchSpace, names) -> dict:
    """{name: config} of the names that are ``kernel``'s configs with every parameter it has in
    ``space`` (a resumed run with a smaller space exports from that space only)."""
    cls = _config_class(kernel)
    ignored = {"GROUP_SIZE_M"} if kernel == "splitk" else {"NUM_KSPLIT"}
    found = {}
    for name in names:
        if not name.startswith(f"triton.{kernel}:"):
            continue
        config = cls.from_name(name)
        params = params_of(config)
        if all(params[key] in getattr(space, key) for key in params
               if key not in ignored and key != "cache_modifier"):
            found[name] = config
    return found


def _config_class(kernel: str) -> type:
    if kernel == "splitk":
        from gemmtune.kernels.triton.gemm_splitk import SplitKConfig

        return SplitKConfig
    if kernel == "tile":
        from gemmtune.kernels.triton.gemm_tile import TileConfig

        return TileConfig
    from gemmtune.kernels.triton.gemm_persistent import PersistentConfig

    return PersistentConfig


def profile_devices(path: Path) -> set[tuple[str, int, str]]:
    """The (arch, cu_num, gpu) of every device a profile file has results of."""
    if not path.exists():
        return set()
    with open(path, newline="", encoding="utf-8") as f:
        return {(r["arch"], int(r["cu_num"]), r.get("gpu", "")) for r in csv.DictReader(f)}


def run(args: argparse.Namespace, target: TritonTarget, out=None) -> int:
    from gemmtune.device import current_device

    out = out or sys.stderr
    space = SearchSpace.from_file(args.space) if args.space else SearchSpace()
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = RunFiles.of(out_dir, args.kernel, target.tag)
    if getattr(args, "export_only", False):
        for what, path in (("profile", files.profile), ("table", files.table)):
            if not path.is_file():
                raise ValueError(f"--export-only reads the run's {what}, {path}, which is not "
                                 f"there: copy the run's output folder (-o) whole")
        # The device the profile measured, wherever the export runs.
        devices = profile_devices(files.profile)
        if len(devices) != 1:
            raise ValueError(f"{files.profile}: --export-only needs a profile of one device, "
                             f"found {len(devices)}: {sorted(devices)}")
        (device,) = devices
    else:
        here = current_device()
        device = (here.arch, here.cu_num, here.gpu)
    arch, _, gpu = device
    prefix = triton_json.tuned_prefix(arch, gpu)
    kept: dict[tuple[int, int], dict] = {}
    for nk in args.nk if args.resume else []:
        configs = _readable(out_dir / triton_json.file_name(prefix, target.tag, *nk), out)
        if configs is not None:
            kept[nk] = configs
    todo = [nk for nk in args.nk if nk not in kept]
    tuner_factory = functools.partial(SpaceTuner, target.tuner, args.kernel, space)
    schema = target.tuner.schema
    if todo and not getattr(args, "export_only", False):
        write_table(files.shapes, schema, [Row("", 0, target.gemm_key(m, n, k))
                                           for n, k in todo for m in args.m], untuned=True)
        gpus = default_gpus()
        config = TuneConfig(
            input=files.shapes, output=files.table, profile=files.profile,
            workers=args.jobs or max(1, len(gpus)),
            options=TuneOptions(err_ratio=args.errRatio, iters=args.iters,
                                accurate_iters=5 * args.iters),
            retune_all=not args.resume, timeout=args.timeout, gpus=gpus)
        summary = Tuner(tuner_factory, config, out=out).run()
        if summary.interrupted:
            return summary.exit_code
    # Only the shapes the run finished (the engine's table has them): a shape cut off mid-way
    # has screens of only some of its configs.
    finished = {row.key for row in read_table(files.table, schema).rows} \
        if files.table.exists() else set()
    results = {key: found for key, found in read_profile(files.profile, schema, device).items()
               if key in finished}
    failures: list[Failure] = []
    chosen_by_nk: dict[tuple[int, int], dict] = {}
    written, missing = [], []
    for n, k in args.nk:
        path = out_dir / triton_json.file_name(prefix, target.tag, n, k)
        if (n, k) in kept:  # --resume: a file from an earlier run counts as tuned
            chosen, note = kept[(n, k)], "kept from an earlier run"
        elif not any(target.gemm_key(m, n, k) in finished for m in args.m):
            # --export-only of a run that never got to this (N, K): its file stays as it is
            # (and counts in the default, as a kept one does).
            out.write(f"tune-triton {args.kernel} {target.tag} N={n} K={k}: no shape finished; "
                      f"its file is left as it is\n")
            earlier = _readable(path, out)
            if earlier is not None:
                chosen_by_nk[(n, k)] = earlier
            continue
        else:
            chosen, left_out = export_nk(args.kernel, space, target, n, k, args.m, results,
                                         failures, on_gpu=arch != "cpu")
            if chosen or left_out:
                # Written even when empty (torch won every bucket): an older file must not keep
                # sending shapes to configs this run found slower, and an empty one keeps the
                # (N, K) on torch where a default file would name a config.
                triton_json.write_configs(path, chosen)
                written.append(path)
            else:
                # No config ran correctly: no file, so that --resume tunes it again.
                path.unlink(missing_ok=True)
                missing.append((n, k))
            note = "; ".join([f"{len(chosen)} bucket(s)", *left_out])
        chosen_by_nk[(n, k)] = chosen
        out.write(f"tune-triton {args.kernel} {target.tag} N={n} K={k}: {note}\n")
    if chosen_by_nk:
        # Empty where torch won every bucket in most (N, K): an older default must not outlive
        # that, nor a default of the arch in another folder speak for this GPU.
        # Judged on this run's shapes only: the profile may hold other (N, K) and M of
        # earlier runs into the same folder.
        ours = {target.gemm_key(m, n, k) for n, k in args.nk for m in args.m}
        vs_torch = across_shapes_vs_torch({key: found for key, found in results.items()
                                           if key in ours}) if arch != "cpu" else None
        written.append(triton_json.write_configs_default(
            out_dir, prefix, target.tag, chosen_by_nk.values(), len(chosen_by_nk), vs_torch))
    for f in failures:
        out.write(f"skipped N={f.n} K={f.k} M={f.m} {f.config}: {f.why}\n")
    out.write(f"wrote {len(written)} file(s) to {out_dir}; {len(failures)} config run(s) "
              f"skipped; every candidate's result in {files.profile}\n")
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


def add_arguments(p: argparse.ArgumentParser, dtypes: list[str]) -> None:
    p.add_argument("kernel", choices=KERNELS, help="Triton kernel family")
    p.add_argument("--nk", type=_nk, action="append", required=True, metavar="N,K",
                   help="a weight shape; repeat for several")
    p.add_argument("--m", type=lambda t: [int(v) for v in t.split(",")],
                   default=[1, 16, 32, 64, 128, 256, 1024], metavar="M,M,...",
                   help="token counts (default 1,16,32,64,128,256,1024)")
    p.add_argument("--dtype", choices=dtypes, default=dtypes[0],
                   help=f"input dtype (default {dtypes[0]}); it picks the family whose shapes "
                        f"are tuned")
    p.add_argument("--space", metavar="JSON", help="search space: lists per key of "
                   "SearchSpace (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, num_warps, num_stages, "
                   "NUM_KSPLIT, cache_modifier)")
    p.add_argument("--errRatio", type=float, default=0.05, metavar="R",
                   help="the correctness gate's largest fraction of elements outside tolerance "
                        "(default 0.05, as gemmtune tune)")
    p.add_argument("--iters", type=int, default=20, help="timed graph replays per config")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds a config may take (compile included) before its worker is "
                        "killed (default 60)")
    p.add_argument("--resume", action="store_true",
                   help="keep the per-(N, K) files already in the output folder and the shapes "
                        "the last run finished (a run cut off goes on where it stopped)")
    p.add_argument("--export-only", action="store_true",
                   help="tune nothing: write the JSON files from the output folder's profile "
                        "(of one device, named after it), e.g. of a run cut off before its end "
                        "or copied from the GPU machine")
    p.add_argument("--jobs", "--mp", type=int, default=None, metavar="J",
                   help="worker processes (default: one per GPU); more than the GPUs compile "
                        "configs in parallel while timing stays one worker per GPU")
    p.add_argument("-o", "--output", default="out/triton_configs", metavar="DIR")

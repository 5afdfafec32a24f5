"""Triton per-kernel JSON configs (the seed's Triton tuning guide): one file per (N, K),
``{arch}-GEMM-{TAG}-N={N}-K={K}.json``, holding one config per M bucket, and a per-arch default
``{arch}-GEMM-{TAG}.json`` (the most common winner per bucket over the tuned (N, K)). Files may
also hold the guide's optional finer ``M_LEQ_<x>`` buckets. A file may name the GPU model
instead of the arch (``H100-80GB-HBM3-GEMM-...``, what tune-triton writes on a GPU); look-up
prefers it, as table look-up prefers rows of the same model.

A shape that has no CSV row runs what the per-(N, K) file names for M's bucket (``lookup``), and
for an (N, K) without a file, what the default names (``lookup_default``). A file decides for its
(N, K): a bucket it has no entry for (torch was faster there), or an empty file (``{}``: torch
won every bucket), keeps torch. The default is a function of the per-(N, K) files
(``default_of``), for the buckets a config won (beat torch) in at least half of the tuned (N, K)
(a bucket torch won more often is left out, so such shapes keep torch): per bucket, the winner
that runs all the tuned (N, K) fastest where the run's timings say so, and only where that is
faster than torch; else the most common winner. Files are read from
``$GEMMTUNE_TRITON_CONFIG_DIR`` (colon-separated folders, first match wins) and then from the
package's ``configs/triton/`` (``files_in_force`` lists them; ``GEMMTUNE_TRITON_JSON=0`` turns
the fallback off).
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from gemmtune import _env
from gemmtune.tables.store import atomic_write_text

# (bucket, largest M it holds), in order; "any" holds whatever the others do not.
BUCKETS: tuple[tuple[str, int], ...] = (
    ("small", 16), ("medium_M32", 32), ("medium_M64", 64), ("medium_M128", 128),
    ("large", 256), ("xlarge", 1 << 62),
)
ANY = "any"
# Optional finer buckets, ``M_LEQ_<x>``: the smallest x >= M wins over the standard buckets.
_FINE = re.compile(r"M_LEQ_([0-9]+)")
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "configs" / "triton"
# The JSON keys of one config, as the seed's guide spells them.
KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps",
        "num_stages", "NUM_KSPLIT", "cache_modifier")


def bucket_of(m: int) -> str:
    for name, top in BUCKETS:
        if m <= top:
            return name
    return BUCKETS[-1][0]


def tuned_prefix(arch: str, gpu: str = "") -> str:
    """The prefix of the files a tuning run writes: the GPU model where there is one (dispatch
    looks for it before the arch's, so a user's own run beats the shipped ``sm_90`` files)."""
    return gpu or arch


def file_name(arch: str, tag: str, n: int | None = None, k: int | None = None) -> str:
    base = f"{arch}-GEMM-{tag}"
    return f"{base}.json" if n is None else f"{base}-N={n}-K={k}.json"


@dataclass(frozen=True)
class BucketConfig:
    """One bucket's config: the guide's keys plus ``kernel``, our ``kernelName`` for it."""

    kernel: str
    params: dict

    def to_json(self) -> dict:
        return {**{key: self.params.get(key) for key in KEYS}, "kernel": self.kernel}


def write_configs(path: Path, configs: dict[str, BucketConfig]) -> None:
    """Write one file's buckets (and ``any``) atomically."""
    unknown = {b for b in configs if not _is_bucket(b)}
    if unknown:
        raise ValueError(f"{path}: unknown bucket(s) {sorted(unknown)}; buckets are "
                         f"{[b for b, _ in BUCKETS] + [ANY]} and M_LEQ_<int>")
    text = json.dumps({b: c.to_json() for b, c in configs.items()}, indent=2, sort_keys=False)
    atomic_write_text(path, text + "\n")


def read_configs(path: Path) -> dict[str, BucketConfig]:
    """A file's buckets; ValueError naming the file and what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object of buckets, got {type(data).__name__}")
    configs = {}
    for bucket, entry in data.items():
        if not _is_bucket(bucket):
            raise ValueError(f"{path}: unknown bucket {bucket!r}; buckets are "
                             f"{[b for b, _ in BUCKETS] + [ANY]} and M_LEQ_<int>")
        if not isinstance(entry, dict) or not isinstance(entry.get("kernel"), str):
            raise ValueError(f"{path}: bucket {bucket!r} needs a \"kernel\" name (e.g. "
                             f"\"triton.splitk:BM16.BN32.BK256.SK4.W2.S4\")")
        configs[bucket] = BucketConfig(entry["kernel"], {k: entry.get(k) for k in KEYS})
    return configs


def search_dirs() -> list[Path]:
    return _env.triton_config_dirs() + [SHIPPED_DIR]


@functools.lru_cache(maxsize=256)
def _load(path: Path, mtime_ns: int) -> dict[str, BucketConfig]:  # mtime in the cache key
    return read_configs(path)


# What a look-up found: no file at all (the caller may look further), or a file and what it names
# for M (None: the file leaves M's bucket to torch).
NO_FILE = object()


def lookup(arch: str, tag: str, n: int, k: int, m: int, gpu: str = ""):
    """The kernel name the per-(N, K) file gives M's bucket (or its ``any``); None where the file
    leaves the bucket to torch; ``NO_FILE`` where there is no file. A file named after the GPU
    model (``H100-80GB-HBM3-GEMM-...``) wins over one named after its arch (``sm_90-GEMM-...``),
    in any of the folders."""
    return _lookup(arch, tag, n, k, m, gpu)


def lookup_default(arch: str, tag: str, m: int, gpu: str = ""):
    """The same for the default file (``{arch}-GEMM-{TAG}.json``)."""
    return _lookup(arch, tag, None, None, m, gpu)


def _prefixes(arch: str, gpu: str) -> tuple[str, ...]:
    """File-name prefixes in the order dispatch prefers them: the GPU model's, then the arch's."""
    return (gpu, arch) if gpu else (arch,)


def _lookup(arch: str, tag: str, n: int | None, k: int | None, m: int, gpu: str):
    for prefix in _prefixes(arch, gpu):
        name = file_name(prefix, tag, n, k)
        for folder in search_dirs():
            path = folder / name
            if path.is_file():
                found = pick(_load(path, path.stat().st_mtime_ns), m)
                return found.kernel if found else None
    return NO_FILE


class FilesInForce(NamedTuple):
    """The Triton JSON files dispatch reads for one tag on one device."""

    per_nk: list[Path]  # one per (N, K): the file that wins for it
    default: Path | None


def files_in_force(arch: str, tag: str, gpu: str = "") -> FilesInForce:
    """What ``lookup`` and ``lookup_default`` would read for ``tag``: per (N, K) the first file
    by the same preference (the GPU model's name, then the arch's; folders in order)."""
    winners: dict[str, Path] = {}
    default = None
    for prefix in _prefixes(arch, gpu):
        base = file_name(prefix, tag)[:-len(".json")]
        for folder in search_dirs():
            for path in sorted(folder.glob(f"{base}-N=*-K=*.json")):
                winners.setdefault(path.name[len(base):], path)
            if default is None and (folder / f"{base}.json").is_file():
                default = folder / f"{base}.json"
    return FilesInForce(sorted(winners.values()), default)


def default_of(per_nk: Iterable[dict[str, BucketConfig]], tuned: int,
               vs_torch: Callable[[str, str], float | None] | None = None
               ) -> dict[str, BucketConfig]:
    """The default file's buckets from the per-(N, K) files of ``tuned`` (N, K) (an (N, K) with no
    file counts as torch's in every bucket), for the buckets configs won in at least half of
    them. No ``any``: the default serves (N, K) no one tuned, and a config picked for some M
    buckets must not run M far from them.

    Which config: ``vs_torch(bucket, kernel)``, where given, is that config's time over torch's
    across every tuned shape of the bucket (geometric mean; None: not measured): the bucket then
    holds the winner that runs the other (N, K) fastest, and only if that is faster than torch.
    One config has to serve (N, K) it was not picked for: block-scale winners that each won
    their own (N, K) ran unseen ones at 0.61-1.06x torch (docs/benchmarks.md, session 19).
    Without it, the most common winner."""
    winners: dict[str, Counter] = {}
    configs: dict[str, BucketConfig] = {}
    for buckets in per_nk:
        for bucket, config in buckets.items():
            if bucket != ANY:
                winners.setdefault(bucket, Counter())[config.kernel] += 1
                configs[config.kernel] = config
    chosen = {}
    for bucket, count in sorted(winners.items(), key=lambda item: _order(item[0])):
        if 2 * sum(count.values()) < tuned:
            continue
        scored = [] if vs_torch is None else sorted(
            (ratio, name) for name in count if (ratio := vs_torch(bucket, name)) is not None)
        if not scored:
            chosen[bucket] = configs[count.most_common(1)[0][0]]
        elif scored[0][0] < 1.0:
            chosen[bucket] = configs[scored[0][1]]
    return chosen


def write_configs_default(folder: Path, prefix: str, tag: str,
                          per_nk: Iterable[dict[str, BucketConfig]], tuned: int,
                          vs_torch: Callable[[str, str], float | None] | None = None) -> Path:
    """Write ``{prefix}-GEMM-{TAG}.json`` in ``folder``: ``default_of(per_nk, tuned, vs_torch)``,
    empty (``{}``) where no bucket qualifies. Returns its path."""
    path = Path(folder) / file_name(prefix, tag)
    write_configs(path, default_of(per_nk, tuned, vs_torch))
    return path


def write_default(folder: Path, prefix: str, tag: str, tuned: int | None = None) -> Path:
    """Write ``{prefix}-GEMM-{TAG}.json`` from the folder's per-(N, K) files of that prefix and tag
    (``tuned``: how many (N, K) were tuned, by default the number of files, an empty one being
    an (N, K) torch won throughout), by the most common winner per bucket: the files hold no
    timings (tune-triton's own default also weighs its profile, ``default_of``'s ``vs_torch``).
    A default with no bucket is written empty (``{}``): it keeps torch for every untuned
    (N, K), also against a default of the arch in another folder. Returns its path."""
    files = sorted(Path(folder).glob(f"{file_name(prefix, tag)[:-len('.json')]}-N=*-K=*.json"))
    return write_configs_default(folder, prefix, tag, (read_configs(path) for path in files),
                                 len(files) if tuned is None else tuned)


def _order(bucket: str) -> tuple[int, int]:
    names = [b for b, _ in BUCKETS]
    if bucket in names:
        return (0, names.index(bucket))
    match = _FINE.fullmatch(bucket)
    return (1, int(match.group(1))) if match else (2, 0)


def pick(configs: dict[str, BucketConfig], m: int) -> BucketConfig | None:
    """M's config in one file: the smallest ``M_LEQ_x`` with x >= M, else M's standard bucket,
    else ``any``."""
    fine = sorted((int(match.group(1)), b) for b in configs
                  if (match := _FINE.fullmatch(b)) and int(match.group(1)) >= m)
    if fine:
        return configs[fine[0][1]]
    return configs.get(bucket_of(m)) or configs.get(ANY)


def _is_bucket(name: str) -> bool:
    return name == ANY or name in {b for b, _ in BUCKETS} or _FINE.fullmatch(name) is not None

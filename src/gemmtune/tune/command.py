"""``gemmtune tune FAMILY``: the engine's command line, with the seeds' (AITER's) flag names.
``--run_config`` (benchmark a table instead of tuning) is the bench's, run by ``gemmtune.cli``."""

from __future__ import annotations

import argparse
from pathlib import Path

from gemmtune.tables.values import LibType
from gemmtune.tune.engine import TuneConfig, Tuner, default_gpus
from gemmtune.tune.family import FamilyTuner, TuneOptions

LIBTYPES = tuple(t.value for t in LibType)


def _libtypes(text: str) -> frozenset[str]:
    """``all`` or nothing (every backend the family has; the default) or a comma list of
    LIBTYPES."""
    names = {t.strip() for t in text.split(",") if t.strip()}
    if not names or names == {"all"}:
        return frozenset()
    unknown = names - set(LIBTYPES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown libtype(s) {', '.join(sorted(unknown))}; "
                                         f"expected all or a comma list of {', '.join(LIBTYPES)}")
    return frozenset(names)


def _prefixes(text: str) -> tuple[str, ...]:
    """A comma list of kernel-name prefixes (``triton.gemv``, ``cublaslt:``)."""
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not names:
        raise argparse.ArgumentTypeError("expected a comma list of kernel-name prefixes, "
                                         "e.g. triton.gemv")
    return names


def add_tune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-i", "--untune_file", "--input_file", dest="input", required=True,
                   metavar="CSV", help="shapes to tune (an untuned CSV: key columns)")
    p.add_argument("-o", "--tune_file", "--tuned_file", dest="output",
                   metavar="CSV", help="tuned table to write; rows already there are kept and "
                                       "their shapes skipped unless --all")
    p.add_argument("-o2", "--profile_file", dest="profile", metavar="CSV",
                   help="also append every candidate's result (status, us, error) here")
    p.add_argument("--mp", type=int, default=None, metavar="N",
                   help="worker processes (default: one per visible GPU, or 1); more than the "
                        "GPUs compile Triton candidates in parallel while GPU work (checks, "
                        "timing) stays one worker per GPU at a time")
    p.add_argument("--errRatio", type=float, default=None, metavar="R",
                   help="largest fraction of output elements allowed outside tolerance "
                        "(default: the family's, 0.05 for the GEMMs and 0.5 for fmoe as in the "
                        "seed; the relative-norm bound applies either way)")
    p.add_argument("--routing", choices=("uniform", "zipf"), default=None,
                   help="fmoe only: how tokens are routed to experts while tuning: uniform "
                        "(default) or zipf (expert popularity ~ 1/rank^1.2, a seeded ranking); "
                        "the profile (-o2) records it with each shape's seed")
    p.add_argument("--ep", type=int, default=None, metavar="N",
                   help="fmoe only: the shapes are one rank of N-way expert parallelism (as "
                        "`gemmtune shapes --ep N` writes them): tokens are routed over N times "
                        "the row's experts, of which the row's are local (default 1)")
    p.add_argument("--batch", type=int, default=10, metavar="N",
                   help="checkpoint the output every N tuned shapes (default 10)")
    p.add_argument("--all", action="store_true", help="retune shapes already in the output")
    p.add_argument("--last", action="store_true", help="tune only the last input row")
    p.add_argument("--sort", action="store_true",
                   help="tune in (N, K, ...) then M order instead of input order")
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls before timing (default 3)")
    p.add_argument("--iters", type=int, default=20,
                   help="timed graph replays in the screen (default 20; the best few are re-timed "
                        "with 5x as many)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds a candidate may take (compile included) before its worker is "
                        "killed and it is recorded as hung (default 60)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every candidate's result")
    p.add_argument("--libtype", type=_libtypes, default=frozenset(), metavar="L,L",
                   help=f"backends to try: all or a comma list of {','.join(LIBTYPES)} "
                        f"(default: every backend of the family available here)")
    p.add_argument("--kernels", type=_prefixes, default=(), metavar="PREFIX,...",
                   help="challengers only: try the candidates whose kernel names start with "
                        "these (e.g. triton.gemv) or match them with wildcards (e.g. "
                        "'triton.splitk:*SW1') against each shape's row in the output, whose "
                        "kernel is re-timed in the same run, and the torch baseline (where "
                        "--libtype allows it); shapes with a row are tuned again (resumable like "
                        "--all), shapes without one get a row chosen among those alone")
    p.add_argument("--compare", action="store_true",
                   help="print old vs new time for shapes that already had a row")
    p.add_argument("--update_improved", action="store_true",
                   help="retune shapes that have a row, replacing it only if the new winner is "
                        "faster by --min_improvement_pct")
    p.add_argument("--min_improvement_pct", type=float, default=3.0, metavar="P",
                   help="gain needed by --update_improved (default 3)")


def config_from_args(args: argparse.Namespace, default_err_ratio: float = 0.05) -> TuneConfig:
    if not args.output:
        raise ValueError("-o/--tune_file is required: the tuned table to write")
    gpus = default_gpus()
    workers = args.mp if args.mp is not None else max(1, len(gpus))
    err_ratio = default_err_ratio if args.errRatio is None else args.errRatio
    if workers < 1 or args.batch < 1 or args.timeout <= 0 or args.iters < 1:
        raise ValueError("--mp, --batch and --iters must be >= 1 and --timeout > 0")
    if not 0 <= err_ratio <= 1:
        raise ValueError(f"--errRatio {err_ratio}: a fraction of the output, 0 to 1")
    if not Path(args.input).exists():
        raise FileNotFoundError(f"{args.input}: no such untuned file (make one with gemmtune "
                                f"shapes or gemmtune capture)")
    if not Path(args.input).is_file():
        raise ValueError(f"-i {args.input} is a folder; name the untuned CSV file in it")
    return TuneConfig(
        input=Path(args.input), output=Path(args.output),
        profile=Path(args.profile) if args.profile else None, workers=workers,
        options=TuneOptions(err_ratio=err_ratio, warmup=args.warmup, iters=args.iters,
                            accurate_iters=5 * args.iters),
        batch=args.batch, retune_all=args.all, last_only=args.last, sort=args.sort,
        timeout=args.timeout, verbose=args.verbose, libtypes=args.libtype,
        compare=args.compare, update_improved=args.update_improved, kernels=args.kernels,
        min_improvement_pct=args.min_improvement_pct, gpus=gpus)


def run_tune(tuner_class: type[FamilyTuner], args: argparse.Namespace, out=None) -> int:
    """Tune as ``args`` say; progress and the report go to ``out`` (default: ``sys.stderr`` as
    it is at the call, which a caller such as pytest's capture may have replaced)."""
    config = config_from_args(args, tuner_class.default_err_ratio)
    return Tuner(tuner_class.factory_from_args(args), config, out=out).run().exit_code

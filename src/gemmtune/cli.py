"""``gemmtune``: one entry point, one verb per step of the workflow (capture → tune → use → check)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

EPILOG = """workflow:
  gemmtune shapes --model llama3-70b --tp 8 -o shapes/      # or: gemmtune capture -o shapes/ -- python serve.py
  gemmtune lookup bf16 M=100 N=4096 K=4096                   # which row a call would use, and why
  gemmtune bench bf16 --model llama3-8b                      # tuned vs torch vs roofline, checked
"""


def _key_value(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. M=128")
    return name.strip(), value.strip()


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. "
                                         "1,16,128") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def _presets() -> tuple[str, ...]:
    from gemmtune.models.shapes import PRESETS

    return PRESETS


def _family_names(having: str | None = None) -> list[str]:
    """Names the CLI takes for the registered families (``a8w8-blockscale`` and
    ``a8w8_blockscale``), of those that have ``having`` (dispatcher, tuner, bench) if given."""
    from gemmtune.families import all_families

    chosen = [f for f in all_families() if having is None or getattr(f, having) is not None]
    return [f.cli_name for f in chosen] + [f.name for f in chosen if f.name != f.cli_name]


# ---------------------------------------------------------------------------------------- lookup
def _cmd_lookup(args) -> int:
    from gemmtune.device import DeviceId, current_device
    from gemmtune.dispatch import table_index
    from gemmtune.families import get_family
    from gemmtune.tables.values import BadValue

    family = get_family(args.family)
    schema = family.schema
    given = dict(args.key)
    unknown = sorted(set(given) - set(schema.key_names))
    if unknown:
        print(f"error: {family.cli_name} has no key column(s) {', '.join(unknown)}; its key "
              f"is {', '.join(schema.key_names)}", file=sys.stderr)
        return 2
    values = []
    for col in schema.key:
        text = given.get(col.name, col.default)
        if text is None:
            print(f"error: {col.name}=... is required (key: {', '.join(schema.key_names)})",
                  file=sys.stderr)
            return 2
        try:
            values.append(col.parse(text))
        except BadValue as e:
            print(f"error: {col.name}: {e}", file=sys.stderr)
            return 2
    key = schema.make_key(values)
    device = DeviceId.parse(args.device) if args.device else current_device()
    note = ""
    if family.dispatcher is not None:
        decision = family.dispatcher.decide(key, device)
        rule, kernel_name, row, note = decision.rule, decision.kernel_name, decision.row, \
            decision.note
    else:
        match = table_index(schema, device).find(key)
        rule, row = match.rule, match.row
        kernel_name = (row.kernel_names(schema) or ("",))[0] if row else \
            "(family default; this family's op has not landed yet)"
    print(f"device:     {device}")
    print(f"shape:      {schema.describe_key(key)}")
    print(f"rule:       {rule.value}")
    print(f"kernelName: {kernel_name}")
    if note:
        print(f"note:       {note}")
    if row is not None:
        print(f"row:        {row.source}")
        print(f"            {schema.describe_key(row.key)} us={row.us:g}")
    return 0


# --------------------------------------------------------------------------------------- capture
def _cmd_capture(args) -> int:
    from gemmtune import _env
    from gemmtune.tables.store import check_writable_dir

    out = Path(args.output)
    check_writable_dir(out, "shapes folder (-o)")
    if not args.command:
        return _merge_and_report(Path(args.shards) if args.shards else _env.capture_dir(), out)
    command = args.command[1:] if args.command[0] == "--" else args.command
    with tempfile.TemporaryDirectory(prefix="gemmtune-capture-") as shards:
        env = dict(os.environ, GEMMTUNE_TUNE_GEMM="1", GEMMTUNE_CAPTURE_DIR=shards)
        print(f"capturing shapes of: {' '.join(command)}", file=sys.stderr)
        status = subprocess.call(command, env=env)
        if status != 0:
            print(f"warning: the command exited with status {status}; merging what it captured",
                  file=sys.stderr)
        merged = _merge_and_report(Path(shards), out)
    # A child killed by a signal reports -N; a shell reports 128 + N.
    status = 128 - status if status < 0 else status
    return status or merged


def _merge_and_report(shard_dir: Path, out: Path) -> int:
    from gemmtune.families import all_families
    from gemmtune.tables.capture import merge_captures

    reports = merge_captures(shard_dir, out, {f.name: f.schema for f in all_families()})
    if not reports:
        print(f"no captured shapes under {shard_dir} (was GEMMTUNE_TUNE_GEMM=1 set while the "
              f"ops ran?)", file=sys.stderr)
    for r in reports:
        print(f"{r.family}: {r.new_shapes} new shape(s) from {r.shards} shard(s) -> "
              f"{r.output} ({r.total_shapes} in all)")
        for e in r.errors:
            print(f"  skipped bad shard line: {e}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------- shapes
def _cmd_shapes(args) -> int:
    from gemmtune.families import get_family
    from gemmtune.models.shapes import load_model_dir, load_preset, untuned_rows
    from gemmtune.tables.store import check_writable_dir, update_table
    from gemmtune.tables.values import QuantType

    spec = load_model_dir(args.model_dir) if args.model_dir else load_preset(args.model)
    wanted = ({get_family(f).name for f in args.families} if args.families
              else {"bf16", "fmoe"})
    out = Path(args.output)
    check_writable_dir(out, "shapes folder (-o)")
    generated = untuned_rows(spec, args.tp, args.nsets,
                             fmoe_q_type=QuantType.from_str(args.q_type or "No"), ep=args.ep)
    asked = wanted if args.families else set()  # the default asks fmoe only of MoE models
    for name in sorted(asked - set(generated)):
        print(f"{name}: no shapes: {spec.name} generates {', '.join(generated)}",
              file=sys.stderr)
    for name, rows in generated.items():
        if name not in wanted:
            continue
        schema = get_family(name).schema
        path = out / schema.untuned_file
        written = update_table(path, schema, rows, untuned=True, replace=False)
        print(f"{name}: {len(rows)} row(s) of {spec.name} tp={args.tp} -> {path} "
              f"({len(written)} in the file)")
    return 0


# ---------------------------------------------------------------------------------------- tables
def _cmd_tables(args) -> int:
    from gemmtune import _env
    from gemmtune.device import current_device
    from gemmtune.tables import triton_json
    from gemmtune.dispatch import table_index
    from gemmtune.families import all_families
    from gemmtune.tables.sources import table_sources, write_merged

    device = current_device()
    print(f"device {device}")
    for family in all_families():
        schema = family.schema
        sources = table_sources(schema)
        index = table_index(schema, device)
        similar = len(index) - index.same_gpu_rows
        which = (f" ({index.same_gpu_rows} of {device.gpu}, {similar} similar-gpu: another model"
                 f" or none named)" if device.gpu and similar else "")
        print(f"{family.cli_name:<16} {len(index):>6} row(s) for this device{which} from "
              f"{len(sources.paths)} file(s)" + (" (shipped tables replaced)"
                                                 if sources.replaced_shipped else ""))
        for p in sources.paths:
            print(f"{'':<18}{p}")
        for tag in dict.fromkeys(family.triton_json_tags.values()):
            files = triton_json.files_in_force(device.arch, tag, device.gpu)
            state = "" if _env.triton_json_enabled() else " (not used: GEMMTUNE_TRITON_JSON=0)"
            print(f"{'':<18}Triton JSON {tag}: {len(files.per_nk)} (N, K) file(s), default "
                  f"{files.default or 'none'}{state}")
        try:
            merged = write_merged(schema)
        except OSError as e:
            print(f"{'':<18}merged copy not written: {e}")
            continue
        if merged is not None:
            print(f"{'':<18}merged copy: {merged}")
    return 0


# ------------------------------------------------------------------------------------------ tune
def _cmd_tune(args) -> int:
    from gemmtune.families import get_family

    family = get_family(args.family)
    if args.run_config:
        from gemmtune.bench import run_config
        from gemmtune.tables.store import check_writable_dir

        out = Path(args.output or "out/run_config")
        check_writable_dir(out, "result folder (-o)")
        return run_config(family, Path(args.input), out)
    from gemmtune.tune.command import run_tune

    try:
        return run_tune(family.tuner_class(), args)
    except RuntimeError as e:  # a worker could not start (no GPU driver, broken install, ...)
        print(f"gemmtune tune: error: {e}", file=sys.stderr)
        return 2


def _triton_dtypes() -> list[str]:
    """--dtype values of tune-triton: the dtypes some family has Triton JSON configs for."""
    from gemmtune.families import all_families
    from gemmtune.families._gemm import SHORT_DTYPES

    tagged = {d for f in all_families() for d in f.triton_json_tags}
    return [short for short, dtype in SHORT_DTYPES.items() if dtype in tagged]


def _cmd_tune_triton(args) -> int:
    from gemmtune.families import all_families, get_family
    from gemmtune.families._gemm import SHORT_DTYPES
    from gemmtune.tables.store import check_writable_dir
    from gemmtune.tune.tune_triton import KERNELS, TritonTarget, run

    dtype = SHORT_DTYPES[args.dtype]
    owners = [f for f in all_families() if dtype in f.triton_json_tags]
    if args.family:
        owners = [f for f in owners if f.name == get_family(args.family).name]
    else:
        owners = [f for f in owners if not f.triton_json_by_name_only]
    if len(owners) != 1:
        found = (f"the families {', '.join(f.cli_name for f in owners)}: choose one with --family"
                 if owners else "no family" + (f" {args.family}" if args.family else ""))
        print(f"gemmtune tune-triton: error: --dtype {args.dtype} is tuned by {found}",
              file=sys.stderr)
        return 2
    family = owners[0]
    kernels = [k for k in KERNELS if f"triton.{k}" in family.dispatcher.registry.prefixes]
    if args.kernel not in kernels:
        print(f"gemmtune tune-triton: error: the {family.cli_name} family has no {args.kernel} "
              f"kernel; use {' or '.join(kernels)}", file=sys.stderr)
        return 2
    target = TritonTarget(family.tuner_class(),
                    lambda m, n, k: family.gemm_key(m, n, k, args.dtype),
                    family.triton_json_tags[dtype], dtype)
    try:
        check_writable_dir(Path(args.output), "tune-triton folder (-o)")
        return run(args, target)
    except ValueError as e:  # a bad --space file
        print(f"gemmtune tune-triton: error: {e}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------------------- bench
def _cmd_bench(args) -> int:
    import torch

    from gemmtune.bench import run_bench
    from gemmtune.families import get_family
    from gemmtune.tables.store import check_writable_dir

    family = get_family(args.family)
    check_writable_dir(Path(args.output), "bench folder (-o)")
    if (args.q_type or args.ep != 1) and family.name != "fmoe":
        raise ValueError(f"--q_type and --ep are for fmoe's experts; {family.cli_name} takes "
                         f"--dtype and --tp")
    if family.bench_runner is not None:
        return family.run_bench_runner(args)
    op = family.bench_op(args.dtype)
    shapes, title = _bench_shapes(args, family, gpu=torch.cuda.is_available())
    return run_bench(_taken(shapes, family, args.dtype or family.bench_dtypes[0]), family, op,
                     Path(args.output), title)


def _taken(shapes: list, family, dtype: str) -> list:
    """The shapes whose weight the family takes (``Family.why_not_gemm``); the others said and
    left out (a pre-shuffled weight must tile: a router's 8 x 4096 does not)."""
    kept = []
    for s in shapes:
        why = family.refuses_gemm(s.N, s.K, dtype)
        if why is None:
            kept.append(s)
        else:
            print(f"{family.cli_name}: {s.name} M={s.M} N={s.N} K={s.K} left out: {why}",
                  file=sys.stderr)
    if not kept:
        raise ValueError(f"{family.cli_name}: none of the shapes has a weight it takes")
    return kept


def _bench_shapes(args, family, gpu: bool) -> tuple[list, str]:
    from gemmtune.bench import BenchShape
    from gemmtune.models.shapes import DEFAULT_M, dense_projections, load_preset
    from gemmtune.tables.store import read_table

    if args.shapes:
        rows = read_table(args.shapes, family.schema, untuned=True).rows
        return [BenchShape("csv", r.key.M, r.key.N, r.key.K) for r in rows], f"{args.shapes}"
    ms = args.M or (list(DEFAULT_M) if gpu else [1, 16])
    projections = dense_projections(load_preset(args.model), args.tp)
    return ([BenchShape(p.name, m, p.N, p.K) for p in projections for m in ms],
            f"{args.model} tp={args.tp} {args.dtype or family.bench_dtypes[0]}")


def _cmd_precompile(args) -> int:
    from gemmtune.prebuild import precompile, print_progress

    # This process serves nothing: warming it would only cost time.
    report = precompile(args.families, args.jobs, print_progress if args.verbose else None,
                        warm=False)
    print(report.summary())
    return 1 if report.failed else 0


def _benched() -> list:
    from gemmtune.families import all_families

    return [f for f in all_families() if f.bench is not None]


def _bench_dtypes() -> list[str]:
    return list(dict.fromkeys(d for f in _benched() for d in f.bench_dtypes))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gemmtune", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Per-shape tuned GEMM and fused-MoE dispatch for NVIDIA GPUs: capture the "
                    "shapes a workload runs, tune them, dispatch from CSV tables.",
        epilog=EPILOG)
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("lookup", help="show the table row a call would use and the rule that "
                                      "found it (exact, padded, coarse, nearest, default)",
                       description="Show the row a call with this shape would dispatch to. Key "
                                   "columns not given take the family's defaults.",
                       epilog="example: gemmtune lookup bf16 M=100 N=4096 K=4096")
    p.add_argument("family", choices=_family_names(), help="table family")
    p.add_argument("key", nargs="+", type=_key_value, metavar="KEY=VALUE",
                   help="shape columns, e.g. M=100 N=4096 K=4096 dtype=bf16")
    p.add_argument("--device", metavar="ARCH:CU_NUM",
                   help="match rows of this GPU instead of the current one, e.g. sm_90:132")
    p.set_defaults(func=_cmd_lookup)

    p = sub.add_parser("capture", help="record the shapes a program runs into untuned CSVs",
                       description="Run COMMAND with shape capture on and merge what it met into "
                                   "OUTPUT/<family untuned file>; or, with --merge, merge shards "
                                   "left by processes run with GEMMTUNE_TUNE_GEMM=1.",
                       epilog="examples:\n  gemmtune capture -o shapes/ -- python serve.py\n"
                              "  GEMMTUNE_TUNE_GEMM=1 python serve.py; gemmtune capture --merge "
                              "-o shapes/",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="folder of the untuned CSVs (rows already there are kept)")
    p.add_argument("--merge", action="store_true",
                   help="only merge existing shards (default when no COMMAND is given)")
    p.add_argument("--shards", metavar="DIR",
                   help="shard folder to merge (default: $GEMMTUNE_CAPTURE_DIR or "
                        "~/.cache/gemmtune/capture)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="program to run with capture on")
    p.set_defaults(func=_cmd_capture)

    p = sub.add_parser("shapes", help="write a model's GEMM and MoE shapes into untuned CSVs",
                       description="Generate the untuned tables of a model from its config.json "
                                   "(read locally; nothing is downloaded) or a bundled preset.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="NAME", choices=_presets(),
                     help="bundled preset: " + ", ".join(_presets()))
    src.add_argument("--model_dir", "--model-dir", metavar="DIR",
                     help="folder holding a Hugging Face config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--nsets", type=_int_list, metavar="M,M,...",
                   default=None, help="token counts M (default 1,16,32,...,8192)")
    p.add_argument("--families", type=lambda t: [f.strip() for f in t.split(",")],
                   metavar="F,F", help="only these families (default: bf16, and fmoe for MoE "
                                       "models; a8w8 gives the same GEMMs with FP8 weights)")
    p.add_argument("--q_type", "--q-type", default=None, metavar="QUANT",
                   help="fmoe rows for FP8 experts quantised this way: per_Token, per_1x128 or "
                        "per_Tensor (default: bf16 experts)")
    p.add_argument("--ep", type=int, default=1, metavar="N",
                   help="fmoe rows of one rank of N-way expert parallelism: num_experts / N "
                        "whole experts (tune them with `gemmtune tune fmoe --ep N`; default 1)")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="folder of the untuned CSVs (rows already there are kept)")
    p.set_defaults(func=_cmd_shapes)

    from gemmtune.tune.command import add_tune_arguments

    p = sub.add_parser("tune", help="tune every shape of an untuned CSV across backends and write "
                                    "the winners into a tuned table",
                       description="Check every candidate of every backend against an fp32 "
                                   "reference, time the valid ones as deployed (CUDA-graph "
                                   "replay, cold weights) and write the fastest per shape. "
                                   "Candidates run in worker processes: one that raises, hangs "
                                   "or crashes is recorded and the run goes on. Killed and "
                                   "restarted with the same command, it resumes.",
                       epilog="example: gemmtune tune bf16 -i shapes/bf16_untuned_gemm.csv "
                              "-o bf16_tuned.csv -o2 profile.csv")
    p.add_argument("family", choices=_family_names("tuner"), help="table family to tune")
    add_tune_arguments(p)
    p.add_argument("--run_config", action="store_true",
                   help="instead of tuning, benchmark the production op with -i as its only "
                        "table (a tuned table): each row's shape against torch and the floors "
                        "(gemmtune bench); -o names the result folder (default out/run_config)")
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("tune-triton", help="tune a Triton kernel's per-(N, K) JSON configs",
                       description="Per (N, K) and M bucket, the fastest config of an editable "
                                   "search space that matches torch; writes "
                                   "{arch}-GEMM-{TAG}-N={N}-K={K}.json per (N, K) and a "
                                   "{arch}-GEMM-{TAG}.json default. A shape without a CSV row "
                                   "runs what its (N, K)'s file names, else what the default "
                                   "names (folders in $GEMMTUNE_TRITON_CONFIG_DIR, then the "
                                   "shipped ones).",
                       epilog="example: gemmtune tune-triton splitk --nk 4096,4096 --nk 576,7168 "
                              "--m 1,16,32,64 -o configs")
    from gemmtune.tune.tune_triton import add_arguments as add_tune_triton_arguments

    add_tune_triton_arguments(p, _triton_dtypes())
    p.add_argument("--family", choices=_family_names("tuner"),
                   help="the family whose shapes are tuned, where several take --dtype "
                        "(default: the one that does)")
    p.set_defaults(func=_cmd_tune_triton)

    p = sub.add_parser("tables", help="list the tables in force for this device and write "
                                      "their merged copies",
                       description="Each family's table files (shipped, model_configs, "
                                   "GEMMTUNE_CONFIG_* overlays) and its rows for this device; "
                                   "the merged table of each family is written to "
                                   "$GEMMTUNE_CACHE_DIR/merged/ for inspection.")
    p.set_defaults(func=_cmd_tables)

    p = sub.add_parser("precompile", help="build every Triton kernel the tables in force name "
                                          "for this GPU into Triton's cache",
                       description="Compile, in parallel processes, the Triton kernel of every "
                                   "table row in force for this GPU (shipped tables, "
                                   "model_configs and GEMMTUNE_CONFIG_* overlays) for the row's "
                                   "shape, into Triton's cache (TRITON_CACHE_DIR, default "
                                   "~/.triton/cache), so that a serving process's first calls "
                                   "load them instead of compiling. Run it on the machine that "
                                   "serves, with the same variables set. In Python, "
                                   "gemmtune.precompile() at a server's start does the same and "
                                   "also pays Triton's once-per-process start (about 0.6 s) "
                                   "there.",
                       epilog="example: gemmtune precompile --families bf16,a8w8 -j 8")
    p.add_argument("--families", type=lambda t: [f.strip() for f in t.split(",") if f.strip()],
                   metavar="F,F", help="only these families (default: every family with a "
                                       "tuner: " + ", ".join(
                                           n for n in _family_names("tuner") if "_" not in n)
                                       + ")")
    p.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                   help="worker processes (default: one per CPU core, at most 8)")
    p.add_argument("-v", "--verbose", action="store_true", help="a line per kernel built")
    p.set_defaults(func=_cmd_precompile)

    p = sub.add_parser("bench", help="time tuned vs torch vs the roofline per shape; check "
                                     "every tuned result; table, CSV and plot",
                       description="In one run on one device: per shape, torch's default and the "
                                   "tuned op (through the tables in force) timed alike (CUDA-graph "
                                   "replay, cold weights), the speed-up, the roofline efficiency "
                                   "(ceilings measured in the same run) and the chosen kernel; the "
                                   "tuned output is checked against an fp32 reference. Runs on "
                                   "the CPU when there is no GPU (and says so).",
                       epilog="examples: gemmtune bench bf16 --model llama3-70b --tp 8 --M 1,16,64; "
                              "gemmtune bench fmoe --model qwen3-30b-a3b")
    p.add_argument("family", choices=_family_names("benchable"), help="op family")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="llama3-8b", choices=_presets(),
                     help="model preset whose dense projections to run (default llama3-8b)")
    src.add_argument("--shapes", metavar="CSV", help="an untuned CSV of shapes instead")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--M", type=_int_list, default=None, metavar="M,M,...",
                   help="token counts (default 1,16,...,8192 on a GPU, fmoe 1,2,4,...,8192; "
                        "1,16 on the CPU, fmoe 1,3)")
    p.add_argument("--dtype", default=None, choices=_bench_dtypes(),
                   help="; ".join(f"{f.cli_name}: {', '.join(f.bench_dtypes)}"
                                  for f in _benched()) + " (the first is the default)")
    p.add_argument("--q_type", "--q-type", default=None, metavar="QUANT",
                   help="fmoe: FP8 experts quantised this way (per_Token, per_1x128 or "
                        "per_Tensor), timed against the bf16 op of the same shape too (default: "
                        "bf16 experts)")
    p.add_argument("--ep", type=int, default=1, metavar="N",
                   help="fmoe: one rank of N-way expert parallelism (num_experts / N whole "
                        "experts, tokens routed over all; default 1)")
    p.add_argument("-o", "--output", default="out/bench", metavar="DIR",
                   help="folder for bench_<family>.csv and .png (default out/bench)")
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "verb", None) == "shapes":
        from gemmtune.models.shapes import DEFAULT_M

        args.nsets = args.nsets or list(DEFAULT_M)
    if getattr(args, "verb", None) == "capture" and not args.command and not args.merge:
        args.merge = True
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"gemmtune {args.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

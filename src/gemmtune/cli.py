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


def _family_names() -> list[str]:
    from gemmtune.tables.schema import Family

    return [f.value.replace("_", "-") for f in Family] + [f.value for f in Family if "_" in f.value]


# ---------------------------------------------------------------------------------------- lookup
def _cmd_lookup(args) -> int:
    from gemmtune.device import DeviceId, current_device
    from gemmtune.ops._dispatch import table_index
    from gemmtune.tables.schema import schema_for
    from gemmtune.tables.values import BadValue

    schema = schema_for(args.family)
    given = dict(args.key)
    unknown = sorted(set(given) - set(schema.key_names))
    if unknown:
        print(f"error: {schema.family.value} has no key column(s) {', '.join(unknown)}; its key "
              f"is {', '.join(schema.key_names)}", file=sys.stderr)
        return 2
    key = []
    for col in schema.key:
        text = given.get(col.name, col.default)
        if text is None:
            print(f"error: {col.name}=... is required (key: {', '.join(schema.key_names)})",
                  file=sys.stderr)
            return 2
        try:
            key.append(col.parse(text))
        except BadValue as e:
            print(f"error: {col.name}: {e}", file=sys.stderr)
            return 2
    device = DeviceId.parse(args.device) if args.device else current_device()
    dispatcher = _dispatcher_for(schema.family)
    if dispatcher is not None:
        decision = dispatcher.decide(tuple(key), device)
        rule, kernel_name, row = decision.rule, decision.kernel_name, decision.row
    else:
        match = table_index(schema.family, device).find(tuple(key))
        rule, row = match.rule, match.row
        kernel_name = (row.kernel_names(schema) or ("",))[0] if row else \
            "(family default; this family's op has not landed yet)"
    print(f"device:     {device}")
    print("shape:      " + " ".join(f"{n}={v}" for n, v in zip(schema.key_names, key)))
    print(f"rule:       {rule.value}")
    print(f"kernelName: {kernel_name}")
    if dispatcher is not None and decision.note:
        print(f"note:       {decision.note}")
    if row is not None:
        print(f"row:        {row.source}")
        print("            " + " ".join(f"{n}={v}" for n, v in zip(schema.key_names, row.key))
              + f" us={row.us:g}")
    return 0


def _dispatcher_for(family):
    from gemmtune.tables.schema import Family

    if family is Family.bf16:
        from gemmtune.ops.gemm_a16w16 import DISPATCH

        return DISPATCH
    if family is Family.a8w8:
        from gemmtune.ops.gemm_a8w8 import DISPATCH

        return DISPATCH
    if family is Family.a8w8_blockscale:
        from gemmtune.ops.gemm_a8w8_blockscale import DISPATCH

        return DISPATCH
    return None


# --------------------------------------------------------------------------------------- capture
def _cmd_capture(args) -> int:
    from gemmtune import _env

    out = Path(args.output)
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
    from gemmtune.tables.capture import merge_captures

    reports = merge_captures(shard_dir, out)
    if not reports:
        print(f"no captured shapes under {shard_dir} (was GEMMTUNE_TUNE_GEMM=1 set while the "
              f"ops ran?)", file=sys.stderr)
    for r in reports:
        print(f"{r.family.value}: {r.new_shapes} new shape(s) from {r.shards} shard(s) -> "
              f"{r.output} ({r.total_shapes} in all)")
        for e in r.errors:
            print(f"  skipped bad shard line: {e}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------- shapes
def _cmd_shapes(args) -> int:
    from gemmtune.models.shapes import load_model_dir, load_preset, untuned_rows
    from gemmtune.tables.schema import Family, schema_for
    from gemmtune.tables.store import update_table

    spec = load_model_dir(args.model_dir) if args.model_dir else load_preset(args.model)
    wanted = ({Family.from_str(f) for f in args.families} if args.families
              else {Family.bf16, Family.fmoe})
    out = Path(args.output)
    generated = untuned_rows(spec, args.tp, args.nsets)
    asked = wanted if args.families else set()  # the default asks fmoe only of MoE models
    for family in sorted(asked - set(generated), key=lambda f: f.value):
        print(f"{family.value}: no shapes: {spec.name} generates "
              f"{', '.join(f.value for f in generated)}", file=sys.stderr)
    for family, rows in generated.items():
        if family not in wanted:
            continue
        schema = schema_for(family)
        path = out / schema.untuned_file
        written = update_table(path, schema, rows, untuned=True, replace=False)
        print(f"{family.value}: {len(rows)} shape(s) of {spec.name} tp={args.tp} -> {path} "
              f"({len(written)} in the file)")
    return 0


# ---------------------------------------------------------------------------------------- tables
def _cmd_tables(args) -> int:
    from gemmtune.device import current_device
    from gemmtune.ops._dispatch import table_index
    from gemmtune.tables.schema import SCHEMAS
    from gemmtune.tables.sources import merged_cache_path, table_sources

    device = current_device()
    print(f"device {device}")
    for family, schema in SCHEMAS.items():
        sources = table_sources(schema)
        index = table_index(family, device)
        print(f"{family.value:<16} {len(index):>6} row(s) for this device from "
              f"{len(sources.paths)} file(s)" + (" (shipped tables replaced)"
                                                 if sources.replaced_shipped else ""))
        for p in sources.paths:
            print(f"{'':<18}{p}")
        if sources.paths:
            print(f"{'':<18}merged copy: {merged_cache_path(schema)}")
    return 0


# ------------------------------------------------------------------------------------------ tune
def _cmd_tune(args) -> int:
    from gemmtune.tune.command import run_tune
    from gemmtune.tune.families import factory

    try:
        return run_tune(factory(args.family), args)
    except RuntimeError as e:  # a worker could not start (no GPU driver, broken install, ...)
        print(f"gemmtune tune: error: {e}", file=sys.stderr)
        return 2


def _cmd_tune_triton(args) -> int:
    from gemmtune.tune.tune_triton import run

    try:
        return run(args)
    except ValueError as e:  # a bad --space file
        print(f"gemmtune tune-triton: error: {e}", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------------------- bench
def _cmd_bench(args) -> int:
    import torch

    from gemmtune.bench import a8w8_blockscale_op, a8w8_op_for, bf16_op, run_bench

    if args.family == "a8w8-blockscale":
        if args.dtype not in ("bf16", "fp8"):  # bf16 is the flag's default: not given
            print(f"gemmtune bench: error: a8w8-blockscale benches fp8 only, not {args.dtype}",
                  file=sys.stderr)
            return 2
        op = a8w8_blockscale_op()
    elif args.family == "bf16":
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        if args.dtype not in dtypes:
            print(f"gemmtune bench: error: bf16 benches --dtype bf16, fp16 or fp32, not "
                  f"{args.dtype}", file=sys.stderr)
            return 2
        op = bf16_op(dtypes[args.dtype])
    else:
        dtypes = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
        dtype_name = args.dtype if args.dtype != "bf16" else "fp8"  # bf16 is the flag's default
        if dtype_name not in dtypes:
            print(f"gemmtune bench: error: a8w8 benches --dtype fp8 or int8, not {args.dtype}",
                  file=sys.stderr)
            return 2
        args.dtype = dtype_name
        op = a8w8_op_for(dtypes[dtype_name])
    shapes, title = _bench_shapes(args, gpu=torch.cuda.is_available())
    return run_bench(shapes, op, Path(args.output), title)


def _bench_shapes(args, gpu: bool) -> tuple[list[tuple[str, int, int, int]], str]:
    from gemmtune.models.shapes import DEFAULT_M, dense_projections, load_preset
    from gemmtune.tables.schema import Family, schema_for
    from gemmtune.tables.store import read_table

    if args.shapes:
        rows = read_table(args.shapes, schema_for(Family.from_str(args.family)),
                          untuned=True).rows
        return [("csv", r.key[0], r.key[1], r.key[2]) for r in rows], f"{args.shapes}"
    ms = args.M or (list(DEFAULT_M) if gpu else [1, 16])
    projections = dense_projections(load_preset(args.model), args.tp)
    return ([(p.name, m, p.N, p.K) for p in projections for m in ms],
            f"{args.model} tp={args.tp} {args.dtype}")


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
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="folder of the untuned CSVs (rows already there are kept)")
    p.set_defaults(func=_cmd_shapes)

    from gemmtune.tune.command import add_tune_arguments
    from gemmtune.tune.families import TUNABLE

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
    p.add_argument("family", choices=TUNABLE, help="table family to tune")
    add_tune_arguments(p)
    p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("tune-triton", help="tune a Triton kernel's per-(N, K) JSON configs",
                       description="Per (N, K) and M bucket, the fastest config of an editable "
                                   "search space that matches torch; writes "
                                   "{arch}-GEMM-{TAG}-N={N}-K={K}.json per (N, K) and a "
                                   "{arch}-GEMM-{TAG}.json default. Dispatch uses a per-(N, K) "
                                   "file for shapes without a CSV row (folders in "
                                   "$GEMMTUNE_TRITON_CONFIG_DIR, then the shipped ones).",
                       epilog="example: gemmtune tune-triton splitk --nk 4096,4096 --nk 576,7168 "
                              "--m 1,16,32,64 -o configs")
    from gemmtune.tune.tune_triton import add_arguments as add_tune_triton_arguments

    add_tune_triton_arguments(p)
    p.set_defaults(func=_cmd_tune_triton)

    p = sub.add_parser("tables", help="list the tables in force for this device",
                       description="Each family's table files (shipped, model_configs, "
                                   "GEMMTUNE_CONFIG_* overlays) and its rows for this device.")
    p.set_defaults(func=_cmd_tables)

    p = sub.add_parser("bench", help="time tuned vs torch vs the roofline per shape; check "
                                     "every tuned result; table, CSV and plot",
                       description="In one run on one device: per shape, torch's default and the "
                                   "tuned op (through the tables in force) timed alike (CUDA-graph "
                                   "replay, cold weights), the speed-up, the roofline efficiency "
                                   "(ceilings measured in the same run) and the chosen kernel; the "
                                   "tuned output is checked against an fp32 reference. Runs on "
                                   "the CPU when there is no GPU (and says so).",
                       epilog="example: gemmtune bench bf16 --model llama3-70b --tp 8 --M 1,16,64")
    p.add_argument("family", choices=["bf16", "a8w8", "a8w8-blockscale"], help="op family")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="llama3-8b", choices=_presets(),
                     help="model preset whose dense projections to run (default llama3-8b)")
    src.add_argument("--shapes", metavar="CSV", help="an untuned CSV of shapes instead")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--M", type=_int_list, default=None, metavar="M,M,...",
                   help="token counts (default 1,16,...,8192 on a GPU; 1,16 on the CPU)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp8", "int8"],
                   help="bf16: bf16 (default), fp16 or fp32; a8w8: fp8 (default) or int8")
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

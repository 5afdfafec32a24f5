"""``python tests/run_faulty_tuner.py ARGS``: ``gemmtune tune bf16 ARGS`` with the faulty family."""

import sys

from faulty_family import FaultyFamily

from gemmtune.cli import build_parser
from gemmtune.tune.command import run_tune

if __name__ == "__main__":
    args = build_parser().parse_args(["tune", "bf16", *sys.argv[1:]])
    sys.exit(run_tune(FaultyFamily, args))

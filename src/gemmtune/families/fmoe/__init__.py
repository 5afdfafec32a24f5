"""The fused-MoE family: ``fused_moe`` (``op``), dispatched from ``tuned_fmoe.csv``, and its
tuner (``tuner``: ``gemmtune tune fmoe``); ``gemmtune bench fmoe`` is ``gemmtune.bench_moe``."""

from __future__ import annotations

from gemmtune.families._family import Family
from gemmtune.families.fmoe.op import DISPATCH, SCHEMA

FAMILY = Family("fmoe", SCHEMA, DISPATCH, tuner="gemmtune.families.fmoe.tuner:FmoeTuner",
                bench_runner="gemmtune.bench_moe:bench_from_args")

"""The fused-MoE family: ``fused_moe`` (``op``), dispatched from ``tuned_fmoe.csv``."""

from __future__ import annotations

from gemmtune.families._family import Family
from gemmtune.families.fmoe.op import DISPATCH, SCHEMA

FAMILY = Family("fmoe", SCHEMA, DISPATCH)

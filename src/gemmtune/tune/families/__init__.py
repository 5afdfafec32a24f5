"""One module per tunable family; ``factory(name)`` gives the class the tuner's workers build."""

from __future__ import annotations

from collections.abc import Callable

TUNABLE = ("bf16", "a8w8", "a8w8-blockscale")


def factory(name: str) -> Callable:
    """The family class for ``gemmtune tune NAME`` (a top-level class, so workers can unpickle it)."""
    normalized = name.replace("-", "_")
    if normalized == "bf16":
        from gemmtune.tune.families.bf16 import Bf16Family

        return Bf16Family
    if normalized == "a8w8":
        from gemmtune.tune.families.a8w8 import A8w8Family

        return A8w8Family
    if normalized == "a8w8_blockscale":
        from gemmtune.tune.families.a8w8_blockscale import A8w8BlockscaleFamily

        return A8w8BlockscaleFamily
    raise ValueError(f"no tuner for family {name!r} yet; tunable: {', '.join(TUNABLE)}")

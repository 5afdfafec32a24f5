"""The registry of families, by name: built-in ones register when ``gemmtune.families`` is
imported; ``register_family`` adds another (a plug-in, or a test's throw-away family)."""

from __future__ import annotations

import threading

from gemmtune.families._family import Family

_FAMILIES: dict[str, Family] = {}
_lock = threading.Lock()


def register_family(family: Family, *, replace: bool = False) -> Family:
    """Make ``family`` known to the CLI (tune, bench, lookup, tables, capture) by its name.
    A second family of the same name is refused unless ``replace``."""
    with _lock:
        if family.name in _FAMILIES and not replace and _FAMILIES[family.name] is not family:
            raise ValueError(f"a family named {family.name!r} is registered already; pass "
                             f"replace=True to replace it")
        _FAMILIES[family.name] = family
    return family


def unregister_family(name: str) -> None:
    with _lock:
        _FAMILIES.pop(name.replace("-", "_"), None)


def all_families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    with _lock:
        return tuple(_FAMILIES.values())


def get_family(name: str) -> Family:
    """The family called ``name`` (``a8w8-blockscale`` or ``a8w8_blockscale``); ValueError
    listing the known names."""
    found = _FAMILIES.get(name.strip().replace("-", "_").lower())
    if found is None:
        known = ", ".join(f.cli_name for f in all_families())
        raise ValueError(f"unknown family {name!r}; expected one of {known}")
    return found

"""The registry of families, by name: built-in ones register when ``gemmtune.families`` is
imported; ``register_family`` adds another (a plug-in, or a test's throw-away family)."""

from __future__ import annotations

import re
import threading

from gemmtune.families._family import Family

_FAMILIES: dict[str, Family] = {}
_lock = threading.Lock()


def register_family(family: Family, *, replace: bool = False) -> Family:
    """Make ``family`` known to the CLI (tune, bench, lookup, tables, capture) by its name.
    Refused, with the reason: a name other than lower-case letters, digits and underscores (the
    CLI also takes it with dashes), a second family of the same name unless ``replace``, and a
    table file or overlay variable that another family has."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", family.name):
        raise ValueError(f"family name {family.name!r}: use lower-case letters, digits and "
                         f"underscores (the CLI also accepts dashes for underscores)")
    with _lock:
        others = [f for f in _FAMILIES.values() if f.name != family.name]
        if family.name in _FAMILIES and not replace and _FAMILIES[family.name] is not family:
            raise ValueError(f"a family named {family.name!r} is registered already; pass "
                             f"replace=True to replace it")
        mine = _claims(family)
        for other in others:
            shared = mine & _claims(other)
            if shared:
                raise ValueError(f"family {family.name!r} would share {', '.join(sorted(shared))} "
                                 f"with family {other.name!r}; give it files and variables of "
                                 f"its own")
        _FAMILIES[family.name] = family
    return family


def _claims(family: Family) -> set[str]:
    """What two families must not share: table file names and overlay variables."""
    schema = family.schema
    return {schema.tuned_file, schema.untuned_file, *schema.env_names}


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

"""Every environment variable gemmtune reads, in one place, read lazily.

Each knob is read when asked for (never at import time), so tests can set variables with
``monkeypatch.setenv`` and see the effect. The seeds' ``AITER_*`` names are accepted as aliases;
when both are set the ``GEMMTUNE_*`` name wins.
"""

from __future__ import annotations

import os
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _first_set(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            return value
    return None


def _flag(*names: str) -> bool:
    value = _first_set(*names)
    if value is None:
        return False
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{names[0]}={value!r}: expected one of 1/0, true/false, yes/no, on/off")


def cache_dir() -> Path:
    """Where merged tables, capture shards and memos live; never inside the installed package."""
    value = os.environ.get("GEMMTUNE_CACHE_DIR")
    return Path(value).expanduser() if value else Path.home() / ".cache" / "gemmtune"


def capture_enabled() -> bool:
    """``GEMMTUNE_TUNE_GEMM=1`` (alias ``AITER_TUNE_GEMM``): record every new shape an op meets."""
    return _flag("GEMMTUNE_TUNE_GEMM", "AITER_TUNE_GEMM")


def capture_dir() -> Path:
    """Folder of per-process capture shards (``GEMMTUNE_CAPTURE_DIR``, default under the cache)."""
    value = os.environ.get("GEMMTUNE_CAPTURE_DIR")
    return Path(value).expanduser() if value else cache_dir() / "capture"


def log_tuned_config() -> bool:
    """``GEMMTUNE_LOG_TUNED_CONFIG=1`` (alias ``AITER_LOG_TUNED_CONFIG``): log each decision once."""
    return _flag("GEMMTUNE_LOG_TUNED_CONFIG", "AITER_LOG_TUNED_CONFIG")


def replace_shipped_tables() -> bool:
    """``GEMMTUNE_CONFIG_REPLACE=1``: a family's user tables replace its shipped ones instead of
    adding to them."""
    return _flag("GEMMTUNE_CONFIG_REPLACE", "AITER_CONFIG_REPLACE")


def table_overlay(env_names: tuple[str, ...]) -> str | None:
    """The colon-separated overlay paths of one family (first of its names that is set)."""
    return _first_set(*env_names)


def device_override() -> str | None:
    """``GEMMTUNE_DEVICE=ARCH:CU_NUM[:GPU]`` (e.g. ``sm_90:132:H200``): act as that GPU when
    matching table rows."""
    return os.environ.get("GEMMTUNE_DEVICE") or None


def triton_json_enabled() -> bool:
    """``GEMMTUNE_TRITON_JSON=0``: a shape without a table row runs its family's torch backend,
    whatever Triton JSON config files say (default: on)."""
    return os.environ.get("GEMMTUNE_TRITON_JSON") is None or _flag("GEMMTUNE_TRITON_JSON")


def triton_config_dirs() -> list[Path]:
    """``GEMMTUNE_TRITON_CONFIG_DIR``: colon-separated folders of Triton JSON configs, searched
    before the shipped ones."""
    value = os.environ.get("GEMMTUNE_TRITON_CONFIG_DIR", "")
    return [Path(p).expanduser() for p in value.split(os.pathsep) if p]


def _lock_base() -> Path:
    import tempfile

    return Path(os.environ.get("GEMMTUNE_LOCK_DIR") or tempfile.gettempdir())


def lock_dir() -> Path:
    """``GEMMTUNE_LOCK_DIR``: where the per-GPU timing locks live. Shared by every user of the
    machine, like the GPUs: the system temp folder by default."""
    return _lock_base() / "gemmtune-gpus"


def table_lock_dir() -> Path:
    """Where the locks of table and log files live (one per file, named after its path), so
    that no ``.lock`` file is left beside an output: under ``GEMMTUNE_LOCK_DIR`` as well."""
    return _lock_base() / "gemmtune-tables"


def visible_devices() -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of GPU names (indices or UUIDs); None when unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def deterministic() -> bool:
    """``GEMMTUNE_DETERMINISTIC=1``, or torch's own switch (``torch.use_deterministic_algorithms``):
    table rows whose Gluon kernels add K's splits into one sum in arrival order (``.R1``) run
    with the splits summed in order instead, and stream-K (``.K<n>``) as whole tiles (wsring's
    persistent programs, ring's a program a tile), bitwise reproducible (and as slow as that is
    where the row chose adding). Read when a kernel name is first resolved in the process: set
    it before the first call."""
    import torch

    return _flag("GEMMTUNE_DETERMINISTIC") or torch.are_deterministic_algorithms_enabled()

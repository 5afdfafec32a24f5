"""Fixtures that keep tests from seeing the user's tables, variables and caches."""

from __future__ import annotations

import os

import pytest

_PREFIXES = ("GEMMTUNE_", "AITER_")


@pytest.fixture(autouse=True)
def isolated_gemmtune(tmp_path_factory, monkeypatch):
    """Fresh cache folder, no overlay or capture variables, empty dispatch caches."""
    import gemmtune

    for name in list(os.environ):
        if name.startswith(_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setenv("GEMMTUNE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    gemmtune.reset()
    yield
    gemmtune.reset()

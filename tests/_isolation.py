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


@pytest.fixture
def without_shipped_json(tmp_path_factory, monkeypatch):
    """No Triton JSON config files anywhere: a shape without a table row runs the family's torch
    backend even on a GPU, where the shipped default files would name a Triton kernel for it.
    For the tests of what dispatch does without a row; tests/test_triton_json.py covers the
    files."""
    from gemmtune.tables import triton_json

    monkeypatch.setattr(triton_json, "SHIPPED_DIR", tmp_path_factory.mktemp("no-json"))

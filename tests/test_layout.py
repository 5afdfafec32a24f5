"""The layout's promises that the import contracts (pyproject.toml, lint-imports) cannot see:
what a process running the ops actually loads, and the registry of families."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest

from gemmtune.families import Family, all_families, get_family, register_family
from gemmtune.tables.values import LibType


def test_running_the_ops_loads_no_tuner_bench_or_measurement():
    script = textwrap.dedent("""
        import sys, torch, gemmtune
        from gemmtune import quant
        x, w = torch.randn(3, 32), torch.randn(16, 32)
        gemmtune.gemm_a16w16(x, w)
        xq, xs = quant.per_token_fp8(x)
        wq, ws = quant.per_channel_fp8(w)
        gemmtune.gemm_a8w8(xq, wq, xs, ws)
        print(sorted(m for m in sys.modules
                     if m.split(".")[:2] in (["gemmtune", "tune"], ["gemmtune", "bench"],
                                             ["gemmtune", "measure"], ["gemmtune", "cli"])))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_built_in_families_are_registered_by_name():
    names = [f.name for f in all_families()]
    assert names[:3] == ["bf16", "a8w8", "a8w8_blockscale"]
    assert {"a4w4_blockscale", "batched_bf16", "batched_a8w8", "fmoe"} <= set(names)
    assert get_family("a8w8-blockscale") is get_family("a8w8_blockscale")
    with pytest.raises(ValueError, match="unknown family 'nope'; expected one of bf16, a8w8"):
        get_family("nope")


def test_the_backends_of_a_family_are_its_registrys():
    assert get_family("a8w8_blockscale").dispatcher.registry.libtypes == \
        {LibType.torch, LibType.triton}
    assert get_family("bf16").dispatcher.registry.libtypes == set(LibType)
    with pytest.raises(ValueError, match="unknown LibType 'cutlass'"):
        get_family("bf16").dispatcher.registry.register("cutlass.sm90", lambda name: None)


def test_register_family_refuses_what_would_clash():
    bf16 = get_family("bf16").schema
    with pytest.raises(ValueError, match="a family named 'bf16' is registered already"):
        register_family(Family("bf16", bf16))
    clash = dataclasses.replace(bf16, family="mine", env_names=("GEMMTUNE_CONFIG_MINE",))
    with pytest.raises(ValueError, match=r"'mine' would share bf16_tuned_gemm.csv, "
                                         r"bf16_untuned_gemm.csv with family 'bf16'"):
        register_family(Family("mine", clash))
    with pytest.raises(ValueError, match="family name 'My-Fam': use lower-case letters"):
        register_family(Family("My-Fam", dataclasses.replace(bf16, family="My-Fam")))
    assert "mine" not in [f.name for f in all_families()]

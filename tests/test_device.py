"""Device identity: what table rows must match."""

from __future__ import annotations

import pytest
import torch

from gemmtune.device import DeviceId, current_device


def test_without_gpu_the_device_is_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU identity")
    assert current_device() == DeviceId("cpu", 0)


@pytest.mark.gpu
def test_gpu_identity_is_arch_and_sm_count():
    props = torch.cuda.get_device_properties(0)
    dev = current_device()
    assert dev.arch == f"sm_{props.major}{props.minor}" and dev.cu_num == props.multi_processor_count


def test_override_from_environment(monkeypatch):
    monkeypatch.setenv("GEMMTUNE_DEVICE", "sm_90:132")
    assert current_device() == DeviceId("sm_90", 132)
    assert str(current_device()) == "sm_90:132"


@pytest.mark.parametrize("bad", ["sm_90", "sm_90:", ":132", "sm_90:x"])
def test_bad_override_is_a_clear_error(monkeypatch, bad):
    monkeypatch.setenv("GEMMTUNE_DEVICE", bad)
    with pytest.raises(ValueError, match="expected ARCH:CU_NUM"):
        current_device()


def test_env_flags_reject_unclear_values(monkeypatch):
    from gemmtune import _env

    monkeypatch.setenv("AITER_TUNE_GEMM", "1")
    assert _env.capture_enabled()
    monkeypatch.setenv("GEMMTUNE_TUNE_GEMM", "0")  # the GEMMTUNE_ name wins over the alias
    assert not _env.capture_enabled()
    monkeypatch.setenv("GEMMTUNE_TUNE_GEMM", "maybe")
    with pytest.raises(ValueError, match="GEMMTUNE_TUNE_GEMM='maybe'"):
        _env.capture_enabled()


def test_the_gpu_model_is_spelled_for_a_table_column(monkeypatch):
    from gemmtune.device import gpu_name

    assert gpu_name("NVIDIA H100 80GB HBM3") == "H100-80GB-HBM3"
    assert gpu_name("NVIDIA H200") == "H200"
    assert gpu_name("NVIDIA H100 PCIe") == "H100-PCIe"
    monkeypatch.setenv("GEMMTUNE_DEVICE", "sm_90:132:NVIDIA H200")
    assert current_device() == DeviceId("sm_90", 132, "H200")
    assert str(current_device()) == "sm_90:132:H200"


@pytest.mark.gpu
def test_the_gpu_names_its_model():
    assert current_device().gpu and " " not in current_device().gpu

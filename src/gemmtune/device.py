"""Identity of the GPU that table rows must match: its architecture and SM count."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from gemmtune import _env

CPU_ARCH = "cpu"


@dataclass(frozen=True)
class DeviceId:
    """``arch`` like ``sm_90`` (``cpu`` without a GPU) and ``cu_num``, the SM count (0 on the CPU)."""

    arch: str
    cu_num: int

    def __str__(self) -> str:
        return f"{self.arch}:{self.cu_num}"

    @classmethod
    def parse(cls, text: str) -> "DeviceId":
        arch, sep, cu = text.partition(":")
        if not sep or not arch or not cu.strip().isdigit():
            raise ValueError(f"device {text!r}: expected ARCH:CU_NUM, e.g. sm_90:132 or cpu:0")
        return cls(arch.strip(), int(cu))


@functools.cache
def _detect(index: int) -> DeviceId:
    props = torch.cuda.get_device_properties(index)
    return DeviceId(f"sm_{props.major}{props.minor}", props.multi_processor_count)


def current_device(index: int | None = None) -> DeviceId:
    """The device whose rows dispatch uses: ``GEMMTUNE_DEVICE`` if set; else CUDA device ``index``
    (a tensor's ``get_device()``; -1 means the CPU), by default the current one; ``cpu:0``
    without a GPU, so that tables, dispatch and tests work there too."""
    override = _env.device_override()
    if override:
        return DeviceId.parse(override)
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else -1
    if index < 0:
        return DeviceId(CPU_ARCH, 0)
    return _detect(index)


def has_gpu() -> bool:
    return torch.cuda.is_available()

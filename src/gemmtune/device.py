"""Identity of the GPU that table rows must match: its architecture, SM count and model.

H100 SXM and H200 are both ``sm_90`` with 132 SMs but differ by 1.4x in memory bandwidth, so a
row also names the GPU model (``gpu``, e.g. ``H100-80GB-HBM3``); look-up prefers rows of the
same model and falls back to rows of the same ``arch, cu_num`` (DESIGN: Device identity).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from gemmtune import _env

CPU_ARCH = "cpu"


def gpu_name(marketing: str) -> str:
    """The ``gpu`` column's spelling of a device name: ``NVIDIA H100 80GB HBM3`` ->
    ``H100-80GB-HBM3`` (no vendor prefix, words joined by dashes, only [A-Za-z0-9._-])."""
    name = re.sub(r"^NVIDIA\s+", "", marketing.strip())
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")


@dataclass(frozen=True)
class DeviceId:
    """``arch`` like ``sm_90`` (``cpu`` without a GPU), ``cu_num`` the SM count (0 on the CPU),
    and ``gpu`` the model (``H100-80GB-HBM3``; "" where unknown)."""

    arch: str
    cu_num: int
    gpu: str = ""

    def __str__(self) -> str:
        return f"{self.arch}:{self.cu_num}" + (f":{self.gpu}" if self.gpu else "")

    @classmethod
    def parse(cls, text: str) -> "DeviceId":
        parts = text.split(":")
        if len(parts) not in (2, 3) or not parts[0].strip() or not parts[1].strip().isdigit():
            raise ValueError(f"device {text!r}: expected ARCH:CU_NUM or ARCH:CU_NUM:GPU, e.g. "
                             f"sm_90:132, sm_90:132:H200 or cpu:0")
        gpu = gpu_name(parts[2]) if len(parts) == 3 else ""
        return cls(parts[0].strip(), int(parts[1]), gpu)


@functools.cache
def _detect(index: int) -> DeviceId:
    props = torch.cuda.get_device_properties(index)
    return DeviceId(f"sm_{props.major}{props.minor}", props.multi_processor_count,
                    gpu_name(props.name))


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

"""What the tuning engine needs from a family's tuner: candidates, inputs, a checked run, a timer.

A tuner object lives in a worker process (it may hold CUDA state); the engine in the parent only
exchanges picklable values with it: keys (the family's key NamedTuples), candidate names, and the
dataclasses below. The engine knows no family: it is handed a tuner class.
"""

from __future__ import annotations

import abc
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from gemmtune.tables.schema import Schema


@dataclass(frozen=True)
class Candidate:
    """One solution for a shape. ``name`` is its ``kernelName``, the whole truth about it.
    ``simplicity`` ranks what to keep when timings tie within noise, lowest first: the
    family's baseline (torch) and a library's own default choice (0 or 1, in the family's
    order), 2 anything tuned, 3 a tuned config that is kept only where it is faster beyond the
    noise than the rest (an FP8 config with fast accumulation beside its promoted twin)."""

    name: str
    libtype: str
    simplicity: int = 2
    splitk: int = 0
    solidx: int = 0
    refused: str = ""  # why it is not run here (recorded as refused, with this reason), or ""
    # A solution ``compose`` made of screened parts: their names, in order (fmoe's stages).
    parts: tuple[str, ...] = ()


class Status(str, enum.Enum):
    ok = "ok"
    wrong = "wrong"  # ran, but failed the correctness gate
    error = "error"  # raised
    timeout = "timeout"  # did not answer within --timeout; its worker was killed
    crash = "crash"  # killed its worker process (abort, segfault, os._exit, illegal address)
    skipped = "skipped"  # a known crasher from an earlier run
    refused = "refused"  # not run here, for the reason its family gave (Candidate.refused)
    oom = "oom"  # ran out of GPU memory when built or checked, and again when tried once more


CRASHING = (Status.timeout, Status.crash)


@dataclass
class Evaluation:
    name: str
    status: Status
    err_ratio: float = math.nan  # fraction of elements outside atol + rtol * |ref|
    rel_err: float = math.nan  # ||out - ref|| / ||ref||
    us: float = math.inf
    spread: float = 0.0  # (p90 - p10) / median of the timed repetitions
    detail: str = ""
    fatal: bool = False  # the worker's CUDA context is unusable afterwards: replace it
    seconds: float = 0.0  # wall time of the evaluation as the tuner saw it (compile included)

    @property
    def ok(self) -> bool:
        return self.status is Status.ok


class DeviceInfo(NamedTuple):
    """What a worker reports of its device: the row columns arch, cu_num, gpu and env."""

    arch: str
    cu_num: int
    gpu: str
    env: str


@dataclass(frozen=True)
class TuneOptions:
    err_ratio: float = 0.05
    warmup: int = 3
    iters: int = 20
    accurate_iters: int = 100


@dataclass
class Prepared:
    """Inputs and fp32 reference of one shape, kept in the worker between candidates."""

    key: tuple
    seed: int
    inputs: Any
    reference: torch.Tensor
    extra: dict = field(default_factory=dict)


class FamilyTuner(abc.ABC):
    """The per-family half of tuning. Implementations must keep their own promises: ``run``
    writes into an output poisoned with NaN (so an unwritten output can never pass), inputs are
    fresh random data (never zeros)."""

    schema: Schema  # the family's table: key columns, result columns, file names
    # How ``time`` measures, stored in each row's ``timing`` column.
    timing_label = "graph.coldL2"
    # ``--errRatio`` when not given: the largest fraction of elements outside atol + rtol.
    default_err_ratio = 0.05

    def device_info(self) -> DeviceInfo:
        """The device this worker tunes on, and the environment fingerprint of its rows."""
        from gemmtune.device import current_device
        from gemmtune.tune.fingerprint import fingerprint

        dev = current_device()
        return DeviceInfo(dev.arch, dev.cu_num, dev.gpu, fingerprint())

    @abc.abstractmethod
    def candidates(self, key: tuple, libtypes: frozenset[str]) -> list[Candidate]:
        """Every candidate of the allowed backends that can run ``key``, pruned by shape."""

    @abc.abstractmethod
    def prepare(self, key: tuple, seed: int) -> Prepared:
        """Fresh random inputs for ``key`` (from ``seed``) and their fp32 reference."""

    def precompile(self, name: str, prepared: Prepared) -> None:
        """Build candidate ``name`` for these inputs without running it on the GPU (a Triton
        compile). The engine calls this outside the per-GPU lock that serialises ``run`` and
        ``time``, so several workers sharing a GPU compile at once. Default: nothing to build."""

    @abc.abstractmethod
    def run(self, name: str, prepared: Prepared) -> torch.Tensor:
        """Run candidate ``name`` once on the prepared inputs into a NaN-poisoned output."""

    @abc.abstractmethod
    def tolerance(self, key: tuple) -> tuple[float, float, float]:
        """(atol, rtol, bound on ||out - ref|| / ||ref||) for this key's output dtype."""

    @abc.abstractmethod
    def time(self, name: str, prepared: Prepared, iters: int, warmup: int) -> tuple[float, float]:
        """(median µs per call, spread) as deployed: CUDA-graph replay, cold operands."""

    def time_many(self, names: list[str], prepared: Prepared, iters: int,
                  warmup: int) -> list[tuple[float, float]]:
        """``time`` of each of ``names``, compared with each other. Families whose timings can
        alternate between candidates override this (drift then hits all of them alike); this
        default times them one after another."""
        return [self.time(name, prepared, iters, warmup) for name in names]

    def compose(self, key: tuple, candidates: list[Candidate], passing: list[Evaluation]
                ) -> tuple[list[Candidate], list[Evaluation]]:
        """The whole solutions to re-time and choose from, given the screened candidates that
        passed: by default those. A family whose candidates are parts (fmoe: stage 1 and stage 2
        configs, screened apart) pairs them here, in the parent process, from the screen's
        results alone; an evaluation it makes carries the parts' estimate of the time."""
        return candidates, passing

    @classmethod
    def factory_from_args(cls, args) -> Callable[[], FamilyTuner]:
        """What makes this family's tuners for the ``gemmtune tune`` arguments ``args``: the
        class itself, unless the family reads an option of its own (fmoe: ``--routing`` and
        ``--ep``)."""
        if getattr(args, "routing", None) is not None:
            raise ValueError("--routing is an option of fmoe (how tokens are routed to experts "
                             "while tuning); this family has no routing")
        if getattr(args, "ep", None) is not None:
            raise ValueError("--ep is an option of fmoe (expert parallelism); this family has "
                             "no experts")
        return cls

    def inputs_note(self, seed: int) -> str:
        """How a shape's inputs are made from ``seed``, for the profile: enough to remake them."""
        return f"seed={seed}"

    def is_fatal(self, error: BaseException) -> bool:
        """Whether ``error`` leaves the worker unusable (a sticky CUDA error): then it is replaced
        and the candidate remembered as a crasher."""
        text = str(error)
        return "illegal memory access" in text or "CUDA error" in text or "misaligned" in text

    def metrics(self, key: tuple, us: float) -> tuple[float, float]:
        """(TFLOP/s, GB/s) of a call of ``key`` taking ``us``."""
        return 0.0, 0.0

    def result_fields(self, key: tuple, candidate: Candidate, evaluation: Evaluation,
                      env: str) -> dict:
        """The result columns of a GEMM table row for the winning candidate."""
        tflops, bw = self.metrics(key, evaluation.us)
        return {
            "libtype": candidate.libtype, "solidx": candidate.solidx, "splitK": candidate.splitk,
            "us": round(evaluation.us, 4), "kernelName": candidate.name,
            "err_ratio": round(evaluation.err_ratio, 6), "tflops": round(tflops, 2),
            "bw": round(bw, 2), "timing": self.timing_label,
            "spread": round(evaluation.spread, 4), "env": env,
        }

"""Eager calls of a planned chain of Triton launches (a fused MoE's routing, quantisers, stages
and sum) at the cost of the compiled kernels' own launchers.

A fused MoE call is a few launches through ``kernel[grid](...)``: Triton's binder specialises
each of a kernel's 30-45 arguments on every call, and the Python around the launches derives
routing sizes, buffers and strides that the call's shapes fix. A ``ChainCall`` records one call
of its function: every launch made through ``_checks.start`` with its compiled kernel, each
tensor argument placed as one of the call's tensors (a role, told by address), the returned
output, or a buffer of the call's own. Later calls replay the launches through Triton's C
launcher with the roles' new addresses, the same buffers and a new output.

What may be recorded (else the function runs as it is, on every call; ``refusal`` says why):
- only Triton launches touch the GPU: the torch ops seen in the call (launches excepted) only
  allocate or view, so no fill or copy that each call needs is left out of a replay;
- no launch takes Triton's scratch memory, each passes its constexprs by name, and host TMA
  descriptors only where Triton's launcher is known (each is encoded once per address, as the
  GEMM replays do);
- the roles are distinct, contiguous tensors, no argument views a role at an offset, and the
  output owns its memory;
- the buffers kept hold at most ``KEPT_BYTES_MAX`` (the intermediates of a decode step, not
  those of a long prefill, whose launches cost little beside their kernels).

The launches seen are those made through ``_checks.start`` (a GEMM ``Replay`` declines while a
chain records, so its launch goes that way too) and torch's ops; a solution launching anything
else (cuBLASLt) would not be replayed right. No MoE solution does.

All recordings together keep at most ``KEPT_BYTES_TOTAL``: a server meets many token counts, a
recording each. Past it the least recently replayed give their buffers back (their calls record
again when next made).

The buffers serve the recording's device, stream and thread only: stream order puts one call's
use of them before the next call's. A call from elsewhere, inside a CUDA-graph capture, with a
profiler's launch hooks set, or with a role whose contiguity or 16-byte alignment differs from
the recording's runs the function (counted in ``declines``, captures aside).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from triton.tools.tensor_descriptor import TensorDescriptor

from gemmtune.kernels.triton import _checks, _replay
from gemmtune.kernels.triton._replay import KernelCall

# The most bytes of buffers a recording keeps alive, and all recordings together.
KEPT_BYTES_MAX = 64 << 20
KEPT_BYTES_TOTAL = 512 << 20
# The torch ops a recorded call may run besides its launches.
_ALLOCATION_AND_VIEW_OPS = frozenset(
    getattr(torch.ops.aten, name) for name in (
        "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view",
        "_unsafe_view", "reshape", "as_strided", "alias", "expand", "slice", "select",
        "unsqueeze", "squeeze", "permute", "t", "transpose", "detach", "unflatten", "flatten"))
# Whether the current stream is capturing a CUDA graph, and the current device (a CPU build has
# neither to ask).
_capturing = torch.cuda.is_current_stream_capturing if torch.cuda.is_available() else \
    (lambda: False)
_current_device = torch._C._cuda_getDevice if torch.cuda.is_available() else (lambda: 0)
# Recording attempts before a refusal is final: the first call of a stream may make its
# workspaces (a fill the calls after it do not repeat).
_ATTEMPTS = 2


class _OpsSeen(TorchDispatchMode):
    """Notes the first torch op of a recorded call that neither allocates nor views."""

    def __init__(self):
        super().__init__()
        self.other: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.other is None and func.overloadpacket not in _ALLOCATION_AND_VIEW_OPS:
            self.other = str(func)
        return func(*args, **(kwargs or {}))


class _Made(NamedTuple):
    """One launch as a recorded call made it."""

    call: KernelCall
    compiled: object


class _Described(NamedTuple):
    """A host TMA descriptor around a role's tensor: the C launch's arguments it expands to
    (``width`` of them from ``position``), made per address by ``encoded``."""

    position: int
    width: int
    role: int
    encoded: _replay.EncodedDescriptor


class _Launch(NamedTuple):
    """One launch of a recording: ``run(*grid, stream, *between, *arguments)`` with each role's
    address put at its positions, and each descriptor around a role expanded in place."""

    run: Callable
    grid: tuple
    between: tuple
    template: tuple  # the arguments: a buffer's address (or descriptor) as made, 0 for a role
    patches: tuple  # (position, role)
    described: tuple  # _Described


class _Launcher(NamedTuple):
    """How a replay launches a compiled kernel: ``run(*grid, stream, *between, *arguments)``,
    with ``descriptors`` (Triton's metadata per host TMA descriptor argument) where the C launch
    takes them expanded."""

    run: Callable
    between: tuple
    descriptors: list | None


def _launcher(compiled) -> _Launcher | str:
    """Triton's C launch where its version is known, else the compiled kernel's launcher; or
    why the kernel cannot be replayed."""
    launcher = compiled.run
    if getattr(launcher, "global_scratch_size", 0) or getattr(launcher, "profile_scratch_size",
                                                              0):
        return "a launch takes Triton's scratch memory"
    direct = _replay.direct_launch(compiled)
    if direct is not None:
        return _Launcher(direct.c_launch, direct.between, direct.descriptors)
    compiled[(1, 1, 1)]  # loads the kernel: its function handle
    return _Launcher(launcher, (compiled.function, compiled.packed_metadata, None, None, None),
                     None)


class _Places:
    """Where a recorded call's tensors belong: the roles by address (the output last), the
    buffers the recording keeps."""

    def __init__(self, roles: tuple, out: torch.Tensor):
        present = [t for t in roles if t is not None]
        self.addresses = {t.data_ptr(): r for r, t in enumerate(roles) if t is not None}
        self.addresses[out.data_ptr()] = len(roles)
        self.storages = {t.untyped_storage().data_ptr() for t in present + [out]}
        self.distinct = len(self.addresses) == len(present) + 1  # the output among them too
        self.kept: dict[int, torch.Tensor] = {}  # a buffer's storage address -> a view of it

    def place(self, t: torch.Tensor) -> int | str | None:
        """The role of ``t``, None for a buffer (kept), or why the recording cannot place it."""
        address = t.data_ptr()
        role = self.addresses.get(address)
        if role is not None:
            return role
        storage = t.untyped_storage()
        if storage.data_ptr() in self.storages:
            return "an argument views one of the call's tensors at an offset"
        self.kept.setdefault(storage.data_ptr(), t)
        return None

    def kept_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.kept.values())


def _laid_out(t: torch.Tensor | None) -> bool | None:
    """A role as a recording pins it: absent (None), or its 16-byte alignment."""
    return None if t is None else t.data_ptr() % 16 == 0


class Recording:
    """A recorded call's launches, replayed with new tensors in its roles."""

    def __init__(self, launches: list[_Launch], places: _Places, kept_bytes: int, roles: tuple,
                 out: torch.Tensor, stream: int, device_index: int):
        self._launches = tuple(launches)
        self._kept = tuple(places.kept.values())  # alive while the recording is
        self.kept_bytes = kept_bytes
        self.used = next(_USES)
        self.evicted = False
        self._layouts = tuple(_laid_out(t) for t in roles)
        self._out_shape, self._out_dtype = tuple(out.shape), out.dtype
        self._out_like_role = out.dtype == roles[0].dtype and out.device == roles[0].device
        self._device = device_index
        self.stream = stream
        self.thread = threading.get_ident()

    @classmethod
    def of(cls, launched: list[_Made], roles: tuple, out, ops_seen: str | None,
           device_index: int, stream: int) -> "Recording | str":
        """The recording of a call that launched ``launched`` and returned ``out``, or why
        none."""
        if ops_seen is not None:
            return f"the call runs {ops_seen} (a recorded call only launches, allocates, views)"
        if not launched:
            return "the call launches no Triton kernel"
        if not isinstance(out, torch.Tensor) or not out.is_contiguous() \
                or out.data_ptr() != out.untyped_storage().data_ptr():
            return "the call's output does not own its memory"
        # (The roles' contiguity and distinct addresses ChainCall checked before recording.)
        places = _Places(roles, out)
        if not places.distinct:
            return "the call's output is one of its tensors"
        launches = []
        for launch in launched:
            recorded = _recorded_launch(launch, places)
            if isinstance(recorded, str):
                return recorded
            launches.append(recorded)
        kept_bytes = places.kept_bytes()
        if kept_bytes > KEPT_BYTES_MAX:
            return (f"its buffers hold {kept_bytes} bytes (a recording keeps at most "
                    f"{KEPT_BYTES_MAX})")
        return cls(launches, places, kept_bytes, roles, out, stream, device_index)

    def launch(self, roles: tuple) -> torch.Tensor | None:
        """The recorded launches with these tensors in the roles (dtypes, shapes and devices as
        recorded: the caller's key holds them), and their output; None where this call must run
        the function instead."""
        if (threading.get_ident() != self.thread or _current_device() != self._device
                or _replay.current_stream(self._device) != self.stream
                or _capturing() or not _replay.no_launch_hooks()):
            return None
        addresses = []
        for t, aligned in zip(roles, self._layouts):
            if t is None:
                if aligned is not None:
                    return None
                addresses.append(0)
                continue
            address = t.data_ptr()
            if aligned is None or (not address & 15) is not aligned or not t.is_contiguous():
                return None
            addresses.append(address)
        first = roles[0]
        out = (first.new_empty(self._out_shape) if self._out_like_role else
               torch.empty(self._out_shape, dtype=self._out_dtype, device=first.device))
        addresses.append(out.data_ptr())
        self.used = next(_USES)
        stream = self.stream
        for launch in self._launches:
            args = list(launch.template)
            for position, role in launch.patches:
                args[position] = addresses[role]
            for d in launch.described:
                args[d.position:d.position + d.width] = d.encoded.arguments(addresses[d.role])
            launch.run(*launch.grid, stream, *launch.between, *args)
        return out


    def evict(self) -> None:
        """Give the buffers back: the call that made this records again."""
        self.evicted, self._kept, self._launches = True, (), ()


# Every live recording (dropped with its ChainCall), a clock of their uses, and a lock for two
# threads recording at once.
_RECORDINGS: "weakref.WeakSet[Recording]" = weakref.WeakSet()
_USES = itertools.count()
_KEEPING = threading.Lock()


def _keep(recording: Recording) -> None:
    """Count ``recording`` in, evicting the least recently used others past KEPT_BYTES_TOTAL."""
    with _KEEPING:
        others = sorted((r for r in _RECORDINGS if not r.evicted), key=lambda r: r.used)
        kept = recording.kept_bytes + sum(r.kept_bytes for r in others)
        for oldest in others:
            if kept <= KEPT_BYTES_TOTAL:
                break
            oldest.evict()
            kept -= oldest.kept_bytes
        _RECORDINGS.add(recording)


def _recorded_launch(made: _Made, places: _Places) -> _Launch | str:
    """One launch of a recording, or why it cannot be replayed."""
    call, compiled = made
    if compiled is None:
        return "the kernels are interpreted"
    if callable(call.grid):
        return "a launch's grid is a function"
    launcher = _launcher(compiled)
    if isinstance(launcher, str):
        return launcher
    try:
        arguments = _replay.all_arguments(call)
    except KeyError as e:
        return f"a launch leaves its argument {e} to its default"
    described_count = sum(isinstance(value, TensorDescriptor) for value in arguments)
    if described_count and len(launcher.descriptors or ()) != described_count:
        return "a launch takes host TMA descriptors its launcher's version does not expand"
    metas = iter(launcher.descriptors or ())
    template, patches, described = [], [], []
    for value in arguments:
        if isinstance(value, TensorDescriptor):
            expanded = _expanded(value, next(metas), places, len(template))
            if isinstance(expanded, str):
                return expanded
            pieces, entry = expanded
            template.extend(pieces)
            if entry is not None:
                described.append(entry)
            continue
        if not isinstance(value, torch.Tensor):
            template.append(value)
            continue
        role = places.place(value)
        if isinstance(role, str):
            return role
        if role is None:
            template.append(value.data_ptr())
        else:
            patches.append((len(template), role))
            template.append(0)
    return _Launch(launcher.run, _replay.grid3(call.grid), launcher.between, tuple(template),
                   tuple(patches), tuple(described))


def _expanded(descriptor: TensorDescriptor, meta, places: _Places,
              position: int) -> tuple[tuple, _Described | None] | str:
    """A host descriptor's arguments to the C launch as made now, and where it is around a
    role, how each call expands it again; or why it cannot be placed."""
    base = descriptor.base
    role = places.place(base)
    if isinstance(role, str):
        return role
    # (A buffer's descriptor is encoded once, here: the role it names is never read.)
    geometry = _replay.DescribedRole(role or 0, list(descriptor.shape), list(descriptor.strides),
                                     list(descriptor.block_shape), descriptor.padding)
    encoded = _replay.EncodedDescriptor(geometry, meta)
    arguments = encoded.arguments(base.data_ptr())
    if role is None:  # around a buffer of the recording's: the same every call
        return arguments, None
    return arguments, _Described(position, len(arguments), role, encoded)


def record(fn: Callable, roles: tuple, device_index: int):
    """Run ``fn(roles)`` once, recording its launches: -> (its output, a Recording or why
    none)."""
    launched: list[_Made] = []

    def observe(kernel, grid, launch, *args, **kwargs):
        with _disable_current_modes():
            compiled = launch(*args, **kwargs)
        launched.append(_Made(KernelCall(kernel, grid, args, kwargs, {}), compiled))
        return compiled

    stream = _replay.current_stream(device_index)
    seen = _OpsSeen()
    _checks.LAUNCHES.record = observe
    try:
        with seen:
            out = fn(roles)
    finally:
        _checks.LAUNCHES.record = None
    return out, Recording.of(launched, roles, out, seen.other, device_index, stream)


class ChainCall:
    """``fn(roles)`` (a call's tensors in fixed places, the first a tensor, -> a new tensor)
    for calls whose roles have the same dtypes, shapes and devices (the caller's key): its
    launches replayed once recorded. ``refusal``: why these calls are never recorded."""

    def __init__(self, fn: Callable, device_index: int, refusal: str | None = None):
        self._fn = fn
        self._device = device_index
        self._recording: Recording | None = None
        if refusal is None and device_index < 0:
            refusal = "the call is not on a GPU"
        self.refusal = refusal
        self._attempts = 0 if refusal else _ATTEMPTS
        self.declines = 0  # calls a recording could not serve

    def __call__(self, roles: tuple):
        recording = self._recording
        if recording is not None:
            if not recording.evicted:
                out = recording.launch(roles)
                if out is not None:
                    return out
                if not _capturing():  # (a capture is meant to run the function)
                    self.declines += 1
                return self._fn(roles)
            self._recording, self._attempts = None, _ATTEMPTS
        if (not self._attempts or _capturing() or not _replay.no_launch_hooks()
                or not _distinct_and_contiguous(roles)):
            return self._fn(roles)
        out, recorded = record(self._fn, roles, self._device)
        if isinstance(recorded, Recording):
            _keep(recorded)
            self._recording, self.refusal = recorded, None
        else:
            self._attempts -= 1
            self.refusal = recorded
        return out


def _distinct_and_contiguous(roles: tuple) -> bool:
    """Whether this call's tensors could be recorded (else it says nothing of the next call's:
    no attempt is spent on it)."""
    present = [t for t in roles if t is not None]
    return (all(t.is_contiguous() for t in present)
            and len({t.data_ptr() for t in present}) == len(present))

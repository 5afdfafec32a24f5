"""Eager calls of a planned Triton GEMM at the cost of the compiled kernel's own launcher.

``kernel[grid](...)`` pays, on every call, Triton's binder (each argument's specialisation), a
cache look-up, and our launch function's argument building: together 1-2x an ``F.linear``
(benchmarks/host_cost_probe.py). For a planned shape none of that changes between calls but
the tensors. So the first call goes the slow way and keeps what it launched (``KernelCall``)
and the compiled kernel; later calls whose tensors Triton would specialise the same way (same
dtypes, shapes, strides, 16-byte alignment) replay it: the recorded arguments with the new
tensors put where the first call's were, through the compiled kernel's runner.

A call whose tensors are all contiguous can go further (``launch_fast``): the caller's key
already pins their dtypes, shapes and devices, so only contiguity and 16-byte alignment are
checked, and the tensors' addresses go to Triton's C launcher as integers, which spares the
launcher a ``data_ptr()`` call and a driver query per pointer and Triton's Python wrapper
around it (measured on an H100 host: the C launch 4.2-4.5 µs with integers, 5.2-5.4 µs with
tensors; the compiled kernel's ``[grid]`` runner 8.6-10.1 µs; F.linear 14 µs).

Buffers the first call took from its stream (split-K partials and tile counters) stay in the
recording, so a recording serves the stream it was made on only; none is made while a CUDA
graph is being captured (its buffers would come from the graph's pool). Settings read at each
launch belong in the caller's key (``input_precision``, from torch's tf32 switch); Triton's
debug and instrumentation switches are not followed by a recording.
"""

from __future__ import annotations

import operator
import types
from typing import NamedTuple

import torch
import triton
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

from gemmtune.kernels.triton import _checks

try:  # Gluon's host descriptor (triton.ring's): Triton's own with a shared-memory layout
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError:  # a Triton without Gluon
    GluonDescriptor = None
_DESCRIPTOR_TYPES = tuple(t for t in (TensorDescriptor, GluonDescriptor) if t is not None)


class KernelCall(NamedTuple):
    """One launch as a launch function builds it: ``kernel[grid](*args, **constexprs,
    **options)``."""

    kernel: object  # the @triton.jit function
    grid: tuple
    args: tuple  # the leading (non-constexpr) parameters, in signature order
    constexprs: dict  # the rest, by name
    options: dict  # num_warps, num_stages
    launch_pdl: bool = False
    # False where the launch holds a buffer made for this call alone (a recording would keep it)
    replayable: bool = True


def launch(call: KernelCall, warmup: bool = False):
    """Launch (or with ``warmup`` compile) ``call`` the usual way; the compiled kernel (None
    under the interpreter)."""
    return _checks.start(call.kernel, call.grid, warmup, call.launch_pdl)(
        *call.args, **call.constexprs, **call.options)


# Triton versions whose compiled kernel's launcher (``CompiledKernel.run``) is the Python
# ``CudaLauncher`` around a C ``launch`` taking, in this order: the grid, stream, function,
# cooperative and PDL flags, the two scratch buffers, the packed metadata, the launch metadata,
# the two hooks and the arguments. Other versions replay through ``CompiledKernel.run``.
_DIRECT_LAUNCH_VERSIONS = ("3.6.",)


class DirectLaunch(NamedTuple):
    """Triton's C launch function of a compiled kernel, and what it takes between the stream
    and the kernel's own arguments."""

    c_launch: object
    between: tuple
    # Per host TMA descriptor argument, in order, what the launcher's Python wrapper encodes
    # it with (Triton's ``tensordesc_meta`` entry: swizzle, element size and type, block), or
    # None for a kernel without such arguments.
    descriptors: list | None = None


def direct_launch(compiled) -> DirectLaunch | None:
    """How to call Triton's C launch function for a kernel that needs no scratch memory, on a
    Triton whose launcher is known; else None. A kernel taking host TMA descriptors has its C
    launch wrapped in a Python function that encodes each descriptor on every call: the C
    launch and the descriptors' metadata are read from that wrapper's closure."""
    if not triton.__version__.startswith(_DIRECT_LAUNCH_VERSIONS):
        return None
    launcher = compiled.run
    c_launch = getattr(launcher, "launch", None)
    descriptors = None
    if not isinstance(c_launch, types.BuiltinFunctionType):
        closure = _closure_of(c_launch)
        c_launch, descriptors = closure.get("launcher"), closure.get("tensordesc_meta")
        if not isinstance(c_launch, types.BuiltinFunctionType) or descriptors is None:
            return None
    if (getattr(launcher, "global_scratch_size", 1)
            or getattr(launcher, "profile_scratch_size", 1)):
        return None
    return DirectLaunch(c_launch, (compiled.function, launcher.launch_cooperative_grid,
                                   launcher.launch_pdl, None, None, compiled.packed_metadata,
                                   None, None, None), descriptors)


def _closure_of(fn) -> dict:
    """A Python function's free variables by name (empty for anything else)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    return dict(zip(code.co_freevars, (cell.cell_contents for cell in cells)))


def _layout(t: torch.Tensor | None) -> tuple | None:
    """What Triton specialises a tensor argument on, and what the recorded launch was built
    from: its dtype, shape (a scale's shape picks its mode), strides and 16-byte alignment."""
    if t is None:
        return None
    return t.dtype, t.shape, t.stride(), t.data_ptr() % 16 == 0


def current_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)


def grid3(grid: tuple) -> tuple:
    return tuple(grid) + (1,) * (3 - len(grid))


def all_arguments(call: KernelCall) -> list:
    """Every argument of the launch in signature order, constexprs included (what the compiled
    kernel's launcher takes)."""
    names = call.kernel.arg_names
    return list(call.args) + [call.constexprs[n] for n in names[len(call.args):]]


class DescribedRole(NamedTuple):
    """A leading argument that is a host TMA descriptor of a role's tensor (the persistent
    kernel's x and w, Triton's; the TMA-ring kernel's, Gluon's): rebuilt around each call's
    tensor with the recorded geometry."""

    role: int
    shape: list
    strides: list
    block_shape: list
    padding: str
    layout: object = None  # a Gluon descriptor's shared-memory layout; None for Triton's

    def around(self, t: torch.Tensor):
        if _LIGHT_DESCRIPTORS:
            return _Descriptor(t, self.shape, self.strides, self.block_shape, self.padding)
        if self.layout is not None:
            return GluonDescriptor(t, self.shape, self.strides, self.block_shape, self.layout,
                                   self.padding)
        return TensorDescriptor(t, self.shape, self.strides, self.block_shape, self.padding)


class _Descriptor:
    """What Triton 3.6's launcher reads of a ``TensorDescriptor`` (base, shape, strides,
    padding), without the dataclass's checks, which the recording's guards stand for (the same
    dtype, shape, strides and 16-byte alignment as the checked descriptor recorded)."""

    __slots__ = ("base", "shape", "strides", "block_shape", "padding")

    def __init__(self, base, shape, strides, block_shape, padding):
        self.base, self.shape, self.strides = base, shape, strides
        self.block_shape, self.padding = block_shape, padding


# The launcher's wrapper reads only those fields in the versions whose launcher is known.
_LIGHT_DESCRIPTORS = triton.__version__.startswith(_DIRECT_LAUNCH_VERSIONS)
# Descriptors kept per described argument of a recording, by address (then all dropped): more
# than the layers of a model sharing one shape (Qwen3-235B has 94).
_DESCRIPTORS_KEPT = 256


def _tma_fill():
    """Triton's C function that encodes a CUtensorMap (what its launcher's wrapper calls)."""
    return triton.runtime.driver.active.utils.fill_tma_descriptor


class EncodedDescriptor:
    """A described role's arguments to Triton 3.6's C launch, as its launcher's Python wrapper
    makes them from a descriptor (``make_tensordesc_arg``): a CUtensorMap and the shape and
    strides, or with no descriptor metadata the address, shape, strides and padding. Given the
    recorded geometry they depend on the address alone, so they are made once per address (a
    CUtensorMap is passed by value at launch: one may serve launches still queued)."""

    __slots__ = ("role", "_make", "_made")

    def __init__(self, described: DescribedRole, meta: dict | None):
        self.role = described.role
        shape, strides = list(described.shape), list(described.strides)
        padding = described.padding == "nan"
        if meta is None:
            tail = (*shape, *strides, padding, *shape, *strides)
            self._make = lambda address: (address, *tail)
        else:
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

            if meta["fp4_padded"]:
                shape[-1] *= 2
            fill = _tma_fill()
            encoding = (meta["swizzle"], meta["elem_size"],
                        TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], meta["block_size"], shape,
                        strides, int(padding))
            self._make = lambda address: (fill(address, *encoding), *shape, *strides)
        self._made: dict[int, tuple] = {}

    def arguments(self, address: int) -> tuple:
        made = self._made.get(address)
        if made is None:
            if len(self._made) >= _DESCRIPTORS_KEPT:
                self._made.clear()
            made = self._made[address] = self._make(address)
        return made


def _encoded_pieces(lead_roles: tuple, descriptors: list) -> tuple | None:
    """Per leading argument, its role (an address) or its EncodedDescriptor; None unless the
    described arguments are exactly the kernel's descriptor arguments (then in order)."""
    described = [r for r in lead_roles if isinstance(r, DescribedRole)]
    if len(described) != len(descriptors):
        return None
    metas = iter(descriptors)
    return tuple(EncodedDescriptor(r, next(metas)) if isinstance(r, DescribedRole) else r
                 for r in lead_roles)


def _role_of(value, roles: tuple):
    """The role whose tensor ``value`` is (by identity), a DescribedRole where it is a host
    descriptor of one, or None."""
    for r, t in enumerate(roles):
        if t is not None and value is t:
            return r
    if isinstance(value, _DESCRIPTOR_TYPES):
        base = _role_of(value.base, roles)
        if isinstance(base, int):
            return DescribedRole(base, list(value.shape), list(value.strides),
                                 list(value.block_shape), value.padding,
                                 getattr(value, "layout", None))
    return None


def _lead_roles(template: list, roles: tuple) -> tuple | None:
    """The role of each leading argument that is one of the roles' tensors (by identity: a
    missing bias or scale is passed as x, so its place follows x's) or a descriptor of one, or
    None where such an argument also comes after another argument (a replay passes the
    tensors, then the rest)."""
    roles_at = [_role_of(value, roles) for value in template]
    lead = next((i for i, r in enumerate(roles_at) if r is None), len(template))
    if any(r is not None for r in roles_at[lead:]):
        return None
    return tuple(roles_at[:lead])


def no_launch_hooks() -> bool:
    """Whether no launch hook is set (a profiler sets them; Triton keeps each in a chain, None
    in older versions)."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return ((enter is None or not getattr(enter, "calls", True))
            and (leave is None or not getattr(leave, "calls", True)))


class Replay:
    """A recorded launch and its compiled kernel, replayed with new tensors in the roles of
    the first call's: x, w, the output, bias, scale_a, scale_b (each a tensor or None, the
    same ones present every call)."""

    def __init__(self, call: KernelCall, compiled, roles: tuple, arguments: list,
                 lead_roles: tuple, stream: int, device_index: int):
        self._grid = grid3(call.grid)
        self._runner = compiled[self._grid]  # also loads the kernel (its function handle)
        self._compiled = compiled
        self._device = device_index
        self._lead_roles = lead_roles
        self._rest = tuple(arguments[len(lead_roles):])
        # Checked per call: every role but the output, which the caller makes as in the first
        # call.
        self._checked = tuple(r for r in range(len(roles)) if r != 2)
        self._layouts = tuple(_layout(roles[r]) for r in self._checked)
        # Tensors left in the recording are the first call's own buffers, bound to its stream.
        bound = any(isinstance(value, torch.Tensor) for value in self._rest)
        self.stream = stream if bound else None
        # launch_fast: each role's 16-byte alignment (None where absent), the leading arguments'
        # roles as a picker of the addresses, the launcher; only for contiguous recordings.
        self._aligned = tuple(None if t is None else t.data_ptr() % 16 == 0 for t in roles)
        # The roles present, with their alignment, and those absent: what launch_fast checks.
        self._present = tuple((r, aligned) for r, aligned in enumerate(self._aligned)
                              if aligned is not None)
        self._absent = tuple(r for r, aligned in enumerate(self._aligned) if aligned is None)
        self._described = any(isinstance(r, DescribedRole) for r in lead_roles)
        self._pick = (operator.itemgetter(*lead_roles) if len(lead_roles) > 1
                      else lambda addresses: (addresses[lead_roles[0]],))
        contiguous = all(t is None or t.is_contiguous() for t in roles)
        self._direct = direct_launch(compiled) if contiguous else None
        # With descriptors: each made once per address, handed to the C launch as the wrapper
        # around it would have expanded them.
        self._encoded = None
        if self._direct is not None and self._direct.descriptors is not None:
            self._encoded = _encoded_pieces(lead_roles, self._direct.descriptors)
            if self._encoded is None:
                self._direct = None
        self._contiguous = contiguous

    @classmethod
    def record(cls, call: KernelCall, compiled, roles: tuple, device_index: int):
        """A Replay of a launch just made, or None where none may be made: no compiled kernel
        (the interpreter), a graph capture under way, a buffer made for this call alone, one
        tensor in two roles (its places could not be told apart for a later call's two), or a
        launch whose tensors' arguments do not come first."""
        present = [t for t in roles if t is not None]
        if (compiled is None or not call.replayable
                or len({id(t) for t in present}) < len(present)
                or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())):
            return None
        arguments = all_arguments(call)
        lead_roles = _lead_roles(arguments, roles)
        if lead_roles is None:
            return None
        return cls(call, compiled, roles, arguments, lead_roles, current_stream(device_index),
                   device_index)

    def serves(self, roles: tuple) -> bool:
        """Whether these tensors, on the current stream, would launch exactly as recorded (and
        no chain is being recorded: its recording sees launches made through _checks.start
        only)."""
        if _checks.LAUNCHES.record is not None:
            return False
        for r, layout in zip(self._checked, self._layouts):
            if _layout(roles[r]) != layout:
                return False
        return self.stream is None or current_stream(self._device) == self.stream

    def launch_fast(self, roles: tuple) -> bool:
        """Launch as recorded with these tensors, whose dtypes, shapes and devices the caller
        has matched to the recording's (its call key holds them), and True; or False where this
        call must go the checked way: a tensor not contiguous or aligned otherwise than
        recorded, another stream for a recording bound to its own, a profiler's hooks, a chain
        being recorded (``_chain``)."""
        if not self._contiguous or _checks.LAUNCHES.record is not None:
            return False
        stream = current_stream(self._device)
        if self.stream is not None and stream != self.stream:
            return False
        # Only the present roles' addresses are read (in a model every step of this costs
        # several times what it does in a loop); an absent role must still be absent.
        addresses = [0, 0, 0, 0, 0, 0]
        for r, aligned in self._present:
            t = roles[r]
            if t is None:
                return False
            address = t.data_ptr()
            if (not address & 15) is not aligned or not t.is_contiguous():
                return False
            addresses[r] = address
        for r in self._absent:
            if roles[r] is not None:
                return False
        if not no_launch_hooks():
            return False
        if self._encoded is not None:  # the C launch's own expansion of each descriptor
            args = []
            for piece in self._encoded:
                if isinstance(piece, int):
                    args.append(addresses[piece])
                else:
                    args.extend(piece.arguments(addresses[piece.role]))
        elif self._described:  # a descriptor is built around its tensor, not an address
            args = [addresses[r] if isinstance(r, int) else r.around(roles[r.role])
                    for r in self._lead_roles]
        else:
            args = self._pick(addresses)
        if self._direct is not None:
            direct = self._direct
            direct.c_launch(*self._grid, stream, *direct.between, *args, *self._rest)
        else:
            compiled = self._compiled
            compiled.run(*self._grid, stream, compiled.function, compiled.packed_metadata, None,
                         None, None, *args, *self._rest)
        return True

    def _arguments_of(self, values: tuple) -> list:
        """The leading arguments from each role's value (a tensor or its address); a described
        role's descriptor around its tensor (``values`` then hold the tensors)."""
        return [values[r] if isinstance(r, int) else r.around(values[r.role])
                for r in self._lead_roles]

    def __call__(self, roles: tuple) -> None:
        args = self._arguments_of(roles)
        if no_launch_hooks():
            # The compiled kernel's launcher straight away (what its [grid] runner calls after
            # asking the driver for the current device and stream).
            compiled = self._compiled
            compiled.run(*self._grid, current_stream(self._device), compiled.function,
                         compiled.packed_metadata, None, None, None, *args, *self._rest)
        else:  # a profiler's launch hooks: through the runner, which calls them
            self._runner(*args, *self._rest)

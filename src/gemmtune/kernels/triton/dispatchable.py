"""A Triton config name (``triton.tile:...``, ``triton.splitk:...``, ``triton.gemv:...``,
``triton.persistent:...``, ``triton.frag:...``, ``triton.ring:...``, ``triton.wsring:...``, the
last three Gluon kernels;
``triton.w4:...``, ``triton.w4frag:...``, ``triton.w4xa:...`` and ``triton.w4wg:...`` (Gluon)
and ``triton.w4deq:...`` of MXFP4 weights)
as a callable for dispatch: checked once per problem, then each call only allocates and
launches; each kernel of one launch replays its first launch of a shape through the compiled
kernel's own launcher (``_replay``; ``triton.w4deq``, two launches, is not replayed). Called
as every backend is: ``kernel(x, w, bias, out_dtype, scale_a, scale_b, out=)`` with x (..., K)
and w (N, K).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import torch

from gemmtune import _env
from gemmtune.kernels.problem import GemmProblem, Scaling
from gemmtune.kernels.torch_ref import as_rows
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton._replay import Replay, launch

PREFIXES = ("triton.tile", "triton.splitk", "triton.gemv", "triton.persistent", "triton.frag",
            "triton.ring", "triton.wsring")
# The kernels of MXFP4 weights (gemm_a16w4's): w the codes (two a byte), scale_b their scales.
W4_PREFIX = "triton.w4"
W4FRAG_PREFIX = "triton.w4frag"
W4DEQ_PREFIX = "triton.w4deq"
W4WG_PREFIX = "triton.w4wg"
W4XA_PREFIX = "triton.w4xa"
MXFP4_PREFIXES = (W4_PREFIX, W4FRAG_PREFIX, W4DEQ_PREFIX, W4WG_PREFIX, W4XA_PREFIX)
# Gluon kernels: compiled for Hopper only, never in Triton's interpreter.
GLUON_PREFIXES = ("triton.frag", "triton.ring", "triton.wsring", W4FRAG_PREFIX, W4WG_PREFIX,
                  W4XA_PREFIX)


class _KernelModule(NamedTuple):
    module: ModuleType  # why_not_supported
    config_cls: type  # parses a name
    launch: Callable  # launch only (the plan checked the problem)
    validating_launch: Callable  # checks every argument, then launches
    call: Callable | None  # the launch as a KernelCall, where it can be replayed
    # (config, dtype) -> why the config cannot take FP8 block scales, or None
    why_not_block_scaled: Callable = _checks.why_not_block_scaled
    reads_tiled_w: bool = False  # its launch takes w_tiled (gemmtune.kernels.preshuffle)
    # It multiplies MXFP4 weights (and nothing else): a call brings w's scales (scale_b), and x's
    # (scale_a) where x is MXFP4 too; the other kernels take both scales or neither.
    mxfp4_weights: bool = False
    # config -> whether its launch may be replayed (``call``); None: every config's may
    replayed: Callable | None = None


def _kernel_module(prefix: str) -> _KernelModule:
    """Imported on first use, not with this module: importing a kernel module fixes for the
    process whether its kernels are interpreted (TRITON_INTERPRET), and tuner workers import the
    families before they set that variable."""
    if prefix == "triton.tile":
        from gemmtune.kernels.triton import gemm_tile as m

        return _KernelModule(m, m.TileConfig, m.launch_gemm_tile, m.gemm_tile, m.tile_call,
                             reads_tiled_w=True)
    if prefix == "triton.splitk":
        from gemmtune.kernels.triton import gemm_splitk as m

        return _KernelModule(m, m.SplitKConfig, m.launch_gemm_splitk, m.gemm_splitk,
                             m.splitk_call, reads_tiled_w=True)
    if prefix == "triton.gemv":
        from gemmtune.kernels.triton import gemm_gemv as m

        return _KernelModule(m, m.GemvConfig, m.launch_gemm_gemv, m.gemm_gemv, m.gemv_call,
                             m.why_not_block_scaled, reads_tiled_w=True)
    if prefix == "triton.persistent":
        from gemmtune.kernels.triton import gemm_persistent as m

        # Its host TMA descriptors of x and w are rebuilt around each replayed call's tensors.
        return _KernelModule(m, m.PersistentConfig, m.launch_gemm_persistent,
                             m.gemm_persistent, m.persistent_call)
    if prefix == "triton.frag":
        from gemmtune.kernels.triton import gemm_frag as m

        return _KernelModule(m, m.FragConfig, m.launch_gemm_frag, m.gemm_frag, m.frag_call,
                             reads_tiled_w=True)
    if prefix == "triton.ring":
        from gemmtune.kernels.triton import gemm_ring as m

        # Its Gluon TMA descriptors of x and w are rebuilt around each replayed call's tensors.
        return _KernelModule(m, m.RingConfig, m.launch_gemm_ring, m.gemm_ring, m.ring_call)
    if prefix == "triton.wsring":
        from gemmtune.kernels.triton import gemm_wsring as m

        # As the ring's: its TMA descriptors rebuilt around each replayed call's x and w.
        return _KernelModule(m, m.WsRingConfig, m.launch_gemm_wsring, m.gemm_wsring,
                             m.wsring_call, m.why_not_block_scaled)
    if prefix == W4_PREFIX:
        from gemmtune.kernels.triton import gemm_w4 as m

        # MXFP4 weights: w the codes (two a byte), scale_b their scales (gemm_a16w4).
        return _KernelModule(m, m.W4Config, m.launch_gemm_w4, m.gemm_w4_scaled, m.w4_call,
                             mxfp4_weights=True)
    if prefix == W4FRAG_PREFIX:
        from gemmtune.kernels.triton import gemm_w4frag as m

        # A config that dequantises MXFP4 x first makes two launches: not replayed.
        return _KernelModule(m, m.W4FragConfig, m.launch_gemm_w4frag, m.gemm_w4frag_scaled,
                             m.w4frag_call, mxfp4_weights=True, replayed=m.replayed)
    if prefix == W4XA_PREFIX:
        from gemmtune.kernels.triton import gemm_w4xa as m

        # Packed weights only (its configs name that layout: ``packed``).
        return _KernelModule(m, m.W4XaConfig, m.launch_gemm_w4xa, m.gemm_w4xa_scaled,
                             m.w4xa_call, mxfp4_weights=True)
    if prefix == W4WG_PREFIX:
        from gemmtune.kernels.triton import gemm_w4wg as m

        # Its Gluon TMA descriptor of x is rebuilt around each replayed call's x.
        return _KernelModule(m, m.W4WgConfig, m.launch_gemm_w4wg, m.gemm_w4wg_scaled,
                             m.w4wg_call, mxfp4_weights=True)
    if prefix == W4DEQ_PREFIX:
        from gemmtune.kernels.triton import gemm_w4deq as m

        # Two launches (the dequantising kernel, then cuBLAS): not replayed.
        return _KernelModule(m, m.W4DeqConfig, m.launch_gemm_w4deq, m.gemm_w4deq_scaled, None,
                             mxfp4_weights=True)
    raise ValueError(f"{prefix!r}: not a Triton kernel; prefixes: "
                     f"{', '.join(PREFIXES + MXFP4_PREFIXES)}")


def _layout(packed: bool) -> str:
    return "packed (gemmtune.quant.prepack_mxfp4)" if packed else "as quantised (row-major)"


class TritonKernel:
    """One named config of one Triton kernel family. ``block_scales``: the kernel applies FP8
    block scales (``gemm_a8w8_blockscale``), which its launch must be told. ``w_tiled``: it
    reads pre-shuffled weights (``gemm_a8w8_bpreshuffle``), as only some kernels can."""

    def __init__(self, name: str, block_scales: bool = False, w_tiled: bool = False):
        prefix = name.split(":", 1)[0]
        kernel = _kernel_module(prefix)
        if w_tiled and not kernel.reads_tiled_w:
            raise ValueError(f"{prefix} kernels do not read pre-shuffled weights; "
                             f"triton.frag, triton.splitk, triton.tile and triton.gemv do")
        self._module = kernel.module
        self._launch = kernel.launch
        self._validating_launch = kernel.validating_launch
        self._why_not_block_scaled = kernel.why_not_block_scaled
        self._mxfp4_weights = kernel.mxfp4_weights
        # (M, N, K, dtypes, bias and scales given, device) -> the Replay of its first launch
        self._replays: dict[tuple, Replay] = {}
        self.config = kernel.config_cls.from_name(name)
        replayed = kernel.replayed is None or kernel.replayed(self.config)
        self._call = kernel.call if replayed else None
        # Bitwise reproducible: what adds in arrival order does not (the same kernel
        # otherwise): added splits are summed in order, stream-K's parts of tiles become
        # whole tiles (the same tile and ring; wsring's programs stay persistent).
        arrival_ordered = {field: 0 for field in ("add_splits", "stream_k")
                           if getattr(self.config, field, 0)}
        if arrival_ordered and _env.deterministic():
            self.config = dataclasses.replace(self.config, **arrival_ordered)
        self.name = self.config.name
        # Only block-scaled and tiled kernels pass a flag: the common launch passes no extra
        # argument. The validating launchers (only called to explain a bad call) take no w_tiled.
        self._validating_kwargs = {"block_scales": True} if block_scales else {}
        self._launch_kwargs = {**self._validating_kwargs, **({"w_tiled": True} if w_tiled else {})}
        # An MXFP4 config may name its own weight layout (a ``packed`` field: triton.w4frag,
        # triton.w4deq; triton.w4xa's is always packed); the problems it takes must have that
        # layout.
        self._w_tiled = w_tiled or bool(getattr(self.config, "packed", 0))

    def __repr__(self) -> str:
        return f"TritonKernel({self.name!r})"

    def check(self, problem: GemmProblem) -> str | None:
        """Why this config cannot run ``problem``, or None."""
        if self._mxfp4_weights != (problem.scaling is Scaling.mxfp4):
            return (f"{self.name} multiplies MXFP4 weights only (gemm_a16w4)"
                    if self._mxfp4_weights else
                    f"{self.name} does not take MXFP4 weights; {' and '.join(MXFP4_PREFIXES)} "
                    f"configs do")
        blocks = bool(self._validating_kwargs)
        if blocks != (problem.scaling is Scaling.block):
            return (f"{self.name} was built {'with' if blocks else 'without'} block scales; the "
                    f"problem has {problem.scaling.value} scales")
        if problem.preshuffled != self._w_tiled:
            if self._mxfp4_weights:
                return (f"{self.name} reads MXFP4 weights {_layout(self._w_tiled)}; this "
                        f"problem's are {_layout(problem.preshuffled)}")
            return (f"{self.name} was built for pre-shuffled weights; the problem's are row-major"
                    if self._w_tiled else "pre-shuffled weights are read only by the "
                    "a8w8_bpreshuffle family's kernels (FP8/INT8)")
        why = self._module.why_not_supported(self.config, problem.m, problem.n, problem.k,
                                             problem.dtype, problem.out_dtype)
        if why is None and blocks:
            why = self._why_not_block_scaled(self.config, problem.dtype)
        if why is None and self._w_tiled and not self._mxfp4_weights:
            from gemmtune.kernels.triton._wlayout import why_not_tiled

            why = why_not_tiled(self.config, problem.n, problem.k, problem.dtype)
        return why

    def warmup(self, x, w, bias, out_dtype, scale_a, scale_b) -> None:
        """Compile for this call's arguments without running anything on the GPU."""
        x2 = x if x.dim() == 2 else as_rows(x)
        y = torch.empty((x2.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
        if y.numel() and not _checks.interpreted():
            self._launch(x2, w, bias, y, scale_a, scale_b, self.config, warmup=True,
                         **self._launch_kwargs)

    def __call__(self, x, w, bias, out_dtype, scale_a, scale_b, out=None):  # x (..., K), w (N, K)
        if (scale_b is None) if self._mxfp4_weights else (scale_a is None) != (scale_b is None):
            # The validating launcher explains what is wrong.
            return self._validating_launch(x, w, bias, out_dtype, scale_a, scale_b, self.config,
                                           **self._validating_kwargs)
        n = w.shape[0]
        x2 = x if x.dim() == 2 else as_rows(x)
        y = torch.empty((x2.shape[0], n), dtype=out_dtype, device=x.device) if out is None \
            else out.view(x2.shape[0], n)
        if y.numel():
            self._launch_or_replay(x2, w, bias, y, scale_a, scale_b, replayable=out is None)
        return y if x2 is x else y.view(x.shape[:-1] + (n,))

    def bind(self, x, w, bias, out_dtype, scale_a, scale_b):
        """This config's calls for arguments with the dtypes, shapes and devices of these (the
        op's call key holds them), as ``run(x, w, bias, scale_a=None, scale_b=None)``: it
        allocates the output and replays the recorded launch (``Replay.launch_fast``), or goes
        the checked way where the tensors' layout differs from the recording's. None (the
        plain call) for fp32 operands (whose precision follows torch's tf32 switch at each
        launch), the CPU, empty outputs and kernels that are not replayed."""
        n = w.shape[0]
        out_shape = (*x.shape[:-1], n)
        device = x.get_device()
        if (self._call is None or device < 0 or x.dtype == torch.float32
                or ((scale_b is None) if self._mxfp4_weights
                    else (scale_a is None) != (scale_b is None))
                or not math.prod(out_shape)):
            return None
        # x's rows and K: reshape(-1, 0) would be ambiguous where K is 0 (a default or a
        # forced kernel may take an empty sum)
        rows, k = math.prod(out_shape[:-1]), x.shape[-1]
        # The output: torch parses a shape given as separate ints, and no dtype or device, fastest
        # (x.new_empty(M, N) ~1.5 µs less than torch.empty((M, N), device="cuda:0", dtype=...)
        # on an H100 host; docs/benchmarks.md, session 13).
        same_dtype, where = out_dtype == x.dtype, torch.device("cuda", device)
        recording: list[Replay | None] = [None]
        empty = torch.empty

        def run(x, w, bias, scale_a=None, scale_b=None):
            y = x.new_empty(*out_shape) if same_dtype else \
                empty(*out_shape, dtype=out_dtype, device=where)
            replay = recording[0]
            if replay is None or not replay.launch_fast((x, w, y, bias, scale_a, scale_b)):
                x2 = x if x.dim() == 2 else x.reshape(rows, k)
                recording[0] = self._launch_or_replay(
                    x2, w, bias, y.view(-1, n), _dense(scale_a), _dense(scale_b),
                    replayable=True)
            return y

        return run

    def _launch_or_replay(self, x, w, bias, y, scale_a, scale_b, replayable: bool):
        """Launch, or replay this shape's recorded launch; the Replay that served or was
        recorded, if any. A caller's own output (``out``) may be laid out otherwise than the
        recording's, so it is always launched the usual way."""
        roles = (x, w, y, bias, scale_a, scale_b)
        device = y.get_device()
        # K = 0 (an empty sum) has no launch to record: the launch function writes the bias.
        if self._call is None or device < 0 or not replayable or not x.shape[1]:
            self._launch(x, w, bias, y, scale_a, scale_b, self.config, **self._launch_kwargs)
            return None
        # The tf32 switch picks fp32 operands' dot precision at each launch.
        key = (x.shape, w.shape[0], x.dtype, y.dtype, bias is None, scale_a is None, device,
               _checks.input_precision(x.dtype))
        replay = self._replays.get(key)
        if replay is not None and replay.serves(roles):
            replay(roles)
            return replay
        call = self._call(x, w, bias, y, scale_a, scale_b, self.config, **self._launch_kwargs)
        recorded = Replay.record(call, launch(call), roles, device)
        if recorded is not None:
            self._replays[key] = recorded
        return recorded


def _dense(scale: torch.Tensor | None) -> torch.Tensor | None:
    """A scale as the kernels read it: its values in order (a per-row scale may come strided)."""
    return scale if scale is None or scale.is_contiguous() else scale.contiguous()



"""The kernels a ``cublaslt:...`` table row resolves to: ``CublasLtKernel`` (bf16/fp16 inputs,
gemm_a16w16) and ``CublasLtScaledKernel`` (FP8 e4m3 with fp32 scales per tensor or per row,
gemm_a8w8). ``check(problem)`` plans once per shape; a call finds its plan with one dict lookup,
allocates the output and launches on the current stream.
"""

from __future__ import annotations

import torch

from gemmtune.kernels.cublaslt._bindings import nvmath_missing
from gemmtune.kernels.cublaslt.algo import LtAlgo, algo_of
from gemmtune.kernels.cublaslt.plans import (
    SCALINGS,
    WORKSPACE_BYTES,
    Plan,
    current_problem,
    get_plan,
    track,
    why_not_types,
)
from gemmtune.kernels.problem import GemmProblem, Scaling
from gemmtune.kernels.torch_ref import gemm_a8w8_ref, gemm_a16w16_ref, scaled_mm_torch

_SCALE_ALIGN = 16  # bytes; scale vectors at other addresses are copied


def _why_not_here() -> str | None:
    return nvmath_missing() or (None if torch.cuda.is_available() else
                                "no CUDA GPU: the cublaslt backend runs on NVIDIA GPUs only")


class CublasLtKernel:
    """A ``cublaslt:...`` row's kernel for bf16/fp16 inputs: ``check(problem)`` builds and
    validates the plan once per shape; each call then allocates the output and launches the
    planned algorithm."""

    def __init__(self, name: str):
        self.algo = LtAlgo.from_name(name)
        self.name = self.algo.name
        self._plans: dict[tuple, Plan] = {}  # (M, N, K, bias, dtype, out_dtype, scaling, device)
        track(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def check(self, problem: GemmProblem) -> str | None:
        """Why this algorithm cannot run ``problem`` on the current GPU, or None (the plan is
        then built)."""
        if problem.scaling is not Scaling.none:
            return (f"{problem.scaling.value} scales are not supported by the cublaslt backend "
                    f"of bf16/fp16 GEMMs; use torch.linear or triton.tile for scaled GEMMs")
        if problem.preshuffled:
            return "pre-shuffled weights are not supported by the cublaslt backend"
        why = why_not_types(problem.dtype, problem.out_dtype) or _why_not_here()
        if why:
            return why
        try:
            self._plan(problem.m, problem.n, problem.k, problem.has_bias, problem.dtype,
                       problem.out_dtype, torch.cuda.current_device())
        except ValueError as e:
            return str(e)
        return None

    def _plan(self, m, n, k, has_bias, dtype, out_dtype, device, scaling: str = "") -> Plan:
        plan = get_plan(self.algo, m, n, k, has_bias, dtype, out_dtype, device, scaling)
        self._plans[(m, n, k, has_bias, dtype, out_dtype, scaling, device)] = plan
        return plan

    def __call__(self, x, w, bias, out_dtype, scale_a, scale_b, out=None):
        # x (..., K), w (N, K), bias (N,) -> (..., N). ``out`` (optional: contiguous, M*N
        # elements, returned as given) lets the tuner poison the output. Host cost per call
        # measured on H200 (benchmarks/cublaslt_check.py): 0.99-1.12x F.linear's 16-52 us; the
        # plan is one dict hit, the rest torch.empty, pointers, the stream and cuBLASLt itself.
        if scale_a is not None or scale_b is not None:
            raise ValueError("cublaslt backend: per-tensor scale_a/scale_b are not supported")
        key = _plan_key(x, w, bias, out_dtype, "")
        m, n, k, dev = key[0], key[1], key[2], key[7]
        plan = self._plans.get(key)
        if plan is None:
            if min(m, n, k) < 1 or dev < 0:
                return _degenerate(x, w, bias, out_dtype, out)
            plan = self._plan(m, n, k, bias is not None, x.dtype, out_dtype, dev)
        return _run(plan, x, w, bias, out_dtype, out, m, n, dev)

    def bind(self, x, w, bias, out_dtype, scale_a, scale_b):
        """Calls with these arguments' dtypes, shapes and devices (dispatch's ``bind``): the
        plan found once, each call only allocates and launches; None where it is not planned."""
        key = _plan_key(x, w, bias, out_dtype, "")
        m, n, dev = key[0], key[1], key[7]
        plan = self._plans.get(key)
        if plan is None or scale_a is not None or scale_b is not None:
            return None

        def run(x, w, bias, scale_a=None, scale_b=None):
            return _run(plan, x, w, bias, out_dtype, None, m, n, dev)

        if bias is not None:
            return run
        return _bound_launch(plan, (*x.shape[:-1], n), x.dtype, out_dtype, dev, run,
                             scaled=False)


class CublasLtScaledKernel(CublasLtKernel):
    """A ``cublaslt:...`` row of the a8w8 table: FP8 x and w with fp32 scales, one per tensor or
    one per row of x / of w (a single value beside a vector is broadcast to a vector, since
    cuBLASLt takes one scale mode per call). Calls it cannot plan run ``scaled_mm_torch``."""

    def __init__(self, name: str):
        super().__init__(name)
        self._refused: set[tuple] = set()  # call keys cuBLASLt refused: they run torch

    def check(self, problem: GemmProblem) -> str | None:
        """Why this algorithm cannot run ``problem`` (FP8 e4m3 with per-tensor or per-row
        scales) here, or None; both scale modes are planned, since a problem does not say which
        a call brings."""
        if problem.scaling is not Scaling.rowwise:
            return (f"{problem.scaling.value} scales: the cublaslt backend of FP8 GEMMs takes "
                    f"scales per tensor or per row ({Scaling.rowwise.value})")
        if problem.preshuffled:
            return "pre-shuffled weights are not supported by the cublaslt backend"
        if problem.dtype != torch.float8_e4m3fn:
            return (f"{problem.dtype} weights: the cublaslt backend of gemm_a8w8 takes FP8 "
                    f"(e4m3) only")
        why = why_not_types(problem.dtype, problem.out_dtype, SCALINGS[0]) or _why_not_here()
        if why:
            return why
        try:
            for scaling in SCALINGS:
                self._plan(problem.m, problem.n, problem.k, problem.has_bias, problem.dtype,
                           problem.out_dtype, torch.cuda.current_device(), scaling)
        except ValueError as e:
            return str(e)
        return None

    def __call__(self, x, w, bias, out_dtype, scale_a, scale_b, out=None):
        if scale_a is None or scale_b is None:
            raise ValueError("cublaslt backend of gemm_a8w8: FP8 needs both scales")
        per_tensor = scale_a.numel() == 1 and scale_b.numel() == 1
        scaling = "tensor" if per_tensor else "outer"
        key = _plan_key(x, w, bias, out_dtype, scaling)
        m, n, k, dev = key[0], key[1], key[2], key[7]
        plan = self._plans.get(key)
        if plan is None:
            if min(m, n, k) < 1 or dev < 0 or key in self._refused:
                return self._fallback(x, w, bias, out_dtype, scale_a, scale_b, out)
            try:
                plan = self._plan(*key[:6], dev, scaling)
            except ValueError as e:
                # check() planned what the table row was tuned for (bf16 out, no bias); another
                # output dtype or a bias can be refused (cuBLASLt takes no fp32 bias with FP8):
                # such calls run torch, with one warning, rather than fail every time.
                import warnings

                self._refused.add(key)
                warnings.warn(f"gemmtune: {self.name} cannot run M={m} N={n} K={k} with "
                              f"{'a bias, ' if bias is not None else ''}{out_dtype} output and "
                              f"{scaling} scales ({e}); these calls run torch.scaled_mm",
                              stacklevel=2)
                return self._fallback(x, w, bias, out_dtype, scale_a, scale_b, out)
        return _run(plan, x, w, bias, out_dtype, out, m, n, dev,
                    _dense_scales(scale_a, scale_b, per_tensor, m, n))

    def bind(self, x, w, bias, out_dtype, scale_a, scale_b):
        """Calls with these arguments' dtypes, shapes and devices (dispatch's ``bind``): the
        plan found once, each call only lays out the scales, allocates and launches; None where it
        is not planned (a bias or an output dtype the row was not tuned for)."""
        per_tensor = scale_a.numel() == 1 and scale_b.numel() == 1
        key = _plan_key(x, w, bias, out_dtype, "tensor" if per_tensor else "outer")
        m, n, dev = key[0], key[1], key[7]
        plan = self._plans.get(key)
        if plan is None:
            return None

        def run(x, w, bias, scale_a, scale_b):
            return _run(plan, x, w, bias, out_dtype, None, m, n, dev,
                        _dense_scales(scale_a, scale_b, per_tensor, m, n))

        # Scales taken as they come: one value each, or dense vectors of M and N values (a
        # single value beside a vector is broadcast into a copy: the general way).
        as_they_come = scale_a.is_contiguous() and scale_b.is_contiguous() and (
            per_tensor or (scale_a.numel() == m and scale_b.numel() == n))
        if bias is not None or not as_they_come:
            return run
        return _bound_launch(plan, (*x.shape[:-1], n), x.dtype, out_dtype, dev, run,
                             scaled=True)

    @staticmethod
    def _fallback(x, w, bias, out_dtype, scale_a, scale_b, out):
        if x.is_cuda and min(x.numel(), w.numel()):
            return scaled_mm_torch(x, w, bias, out_dtype, scale_a, scale_b, out=out)
        return _degenerate_scaled(x, w, bias, out_dtype, scale_a, scale_b, out)


def _plan_key(x, w, bias, out_dtype, scaling: str) -> tuple:
    """What a kernel's plans are kept by: (M, N, K, has bias, dtype, out_dtype, scaling,
    device index)."""
    n, k = w.shape
    return (x.numel() // k if k else 0, n, k, bias is not None, x.dtype, out_dtype, scaling,
            x.get_device())


def _run(plan: Plan, x, w, bias, out_dtype, out, m: int, n: int, dev: int,
         scales: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Launch ``plan`` on the current stream of device ``dev``; ``scales``: the FP8 (w, x)
    scales, dense and aligned (``_dense_scales``).

    Host cost per call besides cuBLASLt's own (~7 us, 9-11 us with a split-K reduction) and
    torch.empty (3.4 us), from shared/notes/cublaslt-from-python.md: the plan dict hit 0.5 us,
    three data_ptr() 0.26 us, the stream 0.15 us. The per-stream workspace adds a dict hit
    (~0.05 us) and shapes with bias or scales this thread's descriptor, one threading.local
    read (~0.09 us; both timed with timeit on a 2-core CPU host); a pointer is written into the
    descriptor (one attribute set) only when it differs from the thread's last one.
    """
    if dev != torch._C._cuda_getDevice():
        with torch.cuda.device(dev):
            return _run(plan, x, w, bias, out_dtype, out, m, n, dev, scales)
    xp, wp = x.data_ptr(), w.data_ptr()
    if (xp | wp) & plan.align_mask or not (x.is_contiguous() and w.is_contiguous()):
        # Views with offsets or strides: copies are aligned and dense (torch allocations are
        # 512-byte aligned). Rare in models; the layouts in the plan assume dense rows.
        x, w = x.clone(memory_format=torch.contiguous_format), w.contiguous()
        if w.data_ptr() & plan.align_mask:
            w = w.clone()
        xp, wp = x.data_ptr(), w.data_ptr()
    desc = plan.desc
    if desc is None:  # a bias or scales: their pointers go into this thread's own descriptor
        try:
            own = plan.thread_local.own
        except AttributeError:
            own = plan.problem.new_thread_desc()
        if bias is not None:
            if bias.dtype != out_dtype or not bias.is_contiguous():
                bias = bias.to(out_dtype).contiguous()
            bp = bias.data_ptr()
            if bp & plan.align_mask:
                bias = bias.clone()
                bp = bias.data_ptr()
            if bp != own.bias_ptr:
                own.set_bias(bp)
        if scales is not None:
            # The tensors themselves stay referenced until the matmul is queued: a copy made
            # for them would otherwise go back to the allocator, which could hand its block
            # to the output below.
            pointers = (scales[0].data_ptr(), scales[1].data_ptr())
            if pointers != own.scale_ptrs:
                own.set_scales(*pointers)
        desc = own.desc
    if out is None:
        out = torch.empty((m, n) if x.dim() == 2 else x.shape[:-1] + (n,), dtype=out_dtype,
                          device=plan.device)
    _queue(plan, desc, xp, wp, out.data_ptr(), dev)
    return out


def _queue(plan: Plan, desc: int, xp: int, wp: int, op: int, dev: int) -> None:
    """cublasLtMatmul of ``plan`` with this descriptor and these pointers, on the current
    stream of device ``dev`` (the current device)."""
    # The stream is read on every call, never cached: a cached handle makes CUDA-graph capture
    # record nothing (silently) while the GEMM runs eagerly.
    stream = torch._C._cuda_getCurrentRawStream(dev)
    workspace = plan.workspaces.get(stream)
    if workspace is None:
        workspace = plan.device_state.workspace(stream)
    plan.matmul(plan.handle, desc, plan.alpha, wp, plan.a, xp, plan.b, plan.beta, op, plan.c,
                op, plan.c, plan.algo_ptr, workspace, WORKSPACE_BYTES, stream)


def _bound_launch(plan: Plan, out_shape: tuple, x_dtype, out_dtype, dev: int, general,
                  scaled: bool):
    """A bound call without a bias (the op's key pins every tensor's dtype, shape and device,
    and the scales' contiguity): it checks only the addresses' alignment, contiguity and the
    current device, allocates the output and queues the matmul; anything else goes
    ``general(x, w, bias, scale_a, scale_b)``. Scales (``scaled``) go into this thread's
    descriptor, written only when their addresses differ from its last call's."""
    if not scaled and plan.desc is None:  # a descriptor per call: the general way
        return general
    # The output: torch parses a shape given as separate ints, and no dtype or device, fastest
    # (x.new_empty(M, N) ~1.5 µs less than torch.empty((M, N), device="cuda:0", dtype=...) on
    # an H100 host; docs/benchmarks.md, session 13).
    same_dtype, where = out_dtype == x_dtype, torch.device("cuda", dev)
    mask, scale_mask = plan.align_mask, _SCALE_ALIGN - 1
    current_device = torch._C._cuda_getDevice
    fixed_desc, thread_local = plan.desc, plan.thread_local

    def run(x, w, bias, scale_a=None, scale_b=None):
        xp, wp = x.data_ptr(), w.data_ptr()
        if (xp | wp) & mask or dev != current_device() or not (
                x.is_contiguous() and w.is_contiguous()):
            return general(x, w, bias, scale_a, scale_b)
        desc = fixed_desc
        if scaled:
            pointers = (scale_b.data_ptr(), scale_a.data_ptr())  # cuBLAS's A is w
            if (pointers[0] | pointers[1]) & scale_mask:
                return general(x, w, bias, scale_a, scale_b)
            own = getattr(thread_local, "own", None) or plan.problem.new_thread_desc()
            if pointers != own.scale_ptrs:
                own.set_scales(*pointers)
            desc = own.desc
        out = x.new_empty(*out_shape) if same_dtype else \
            torch.empty(*out_shape, dtype=out_dtype, device=where)
        _queue(plan, desc, xp, wp, out.data_ptr(), dev)
        return out

    return run


def _dense_scales(scale_a, scale_b, per_tensor: bool, m: int, n: int) -> tuple:
    """The (w, x) scales as cuBLASLt takes them (its A is w): one value each, or a dense
    aligned vector each (a single value beside a vector broadcast to one). Copies made here
    must be kept alive by the caller until the matmul is queued."""
    if not per_tensor:
        scale_a, scale_b = scale_a.reshape(-1), scale_b.reshape(-1)
        if scale_a.numel() != m:
            scale_a = scale_a.expand(m)
        if scale_b.numel() != n:
            scale_b = scale_b.expand(n)
    return _aligned_dense(scale_b), _aligned_dense(scale_a)


def _aligned_dense(scale: torch.Tensor) -> torch.Tensor:
    if scale.is_contiguous() and scale.data_ptr() % _SCALE_ALIGN == 0:
        return scale
    return scale.clone(memory_format=torch.contiguous_format)  # dense, freshly aligned


def _degenerate(x, w, bias, out_dtype, out):
    """Empty M, N or K (cuBLASLt layouts need sizes >= 1), or a tensor off the GPU: the fp32
    reference."""
    y = gemm_a16w16_ref(x, w, bias, out_dtype)
    return y if out is None else out.copy_(y)


def _degenerate_scaled(x, w, bias, out_dtype, scale_a, scale_b, out):
    """Empty sizes or tensors off the GPU, FP8: the dequantised fp32 reference."""
    y = gemm_a8w8_ref(x, w, scale_a, scale_b, bias, out_dtype)
    return y if out is None else out.copy_(y.reshape(out.shape))


def heuristic_kernels(M: int, N: int, K: int, dtype: torch.dtype, out_dtype: torch.dtype,
                      has_bias: bool) -> list[CublasLtKernel]:
    """Kernels that run the heuristic's algorithms exactly as cuBLASLt returned them (not rebuilt
    from their names), best first: what checks that a name is the whole truth compare against."""
    prob = current_problem(M, N, K, dtype, out_dtype, has_bias)
    device = prob.device.index
    kernels = []
    for raw in prob.heuristic():
        algo = algo_of(raw)
        if algo is None:
            continue
        kernel = CublasLtKernel(algo.name)
        kernel._plans[(M, N, K, has_bias, dtype, out_dtype, "", device)] = Plan(prob, algo, raw)
        kernels.append(kernel)
    return kernels


def algo_bytes(kernel: CublasLtKernel, M: int, N: int, K: int, dtype: torch.dtype,
               out_dtype: torch.dtype, has_bias: bool) -> bytes:
    """The raw ``cublasLtMatmulAlgo_t`` a kernel runs for this shape on the current GPU."""
    device = torch.cuda.current_device()
    plan = kernel._plans.get((M, N, K, has_bias, dtype, out_dtype, "", device)) \
        or kernel._plan(M, N, K, has_bias, dtype, out_dtype, device)
    return plan.raw.tobytes()

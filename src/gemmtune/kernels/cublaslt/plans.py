"""Plans: what a call needs, built once per (algorithm, shape, dtypes, bias, scale mode, device).

A problem (``LtProblem``) is cuBLASLt's description of one (M, N, K, bias, dtypes, scale mode,
device): a matmul descriptor, three matrix layouts and a heuristic preference, shared by every
algorithm tried on it. A ``Plan`` is a problem plus one algorithm rebuilt from its name and
accepted by ``matmul_algo_check``, resolved to plain ints for the hot path. ``get_plan`` builds
and caches them; ``clear_plans`` forgets them.

Layout for torch's convention (cuBLAS is column-major, so it computes y.T = W @ x.T): m = N,
n = M, k = K; A = W as K x N with TRANSA = T, B = x as K x M, C = D = y as N x M, all with the
leading dimension of the row-major torch tensor.

Concurrency: no call writes what another call may be reading at the same time.
- Workspaces: one per (device, stream), ``WORKSPACE_BYTES`` each, allocated by the first GEMM
  on that stream (GEMMs of one stream run one after another, so they share it; torch keeps its
  own cuBLAS workspaces per stream the same way). Memory: 32 MiB per stream that ever ran a
  cuBLASLt GEMM, never freed; torch's stream pools bound the streams in practice (the default
  stream and 32 per priority level and device), external streams add theirs. A workspace first
  allocated during CUDA-graph capture comes from the graph's memory pool and is kept alive here.
  Limit: a graph replays with the workspace of the stream it was captured on, and
  ``torch.cuda.graph`` captures on one shared stream (from torch's pool, which hands its
  streams out again) unless given ``stream=``. Graphs replayed at the same time as each other,
  or as eager GEMMs on their capture stream, must be captured on streams of their own;
  replayed one after another, as serving engines do, they may share one.
- Descriptors: shapes whose calls bring pointers of their own (a bias, FP8 scales) write them
  into a copy of the problem's descriptor owned by the calling thread, made on that thread's
  first call with the same attributes; cuBLASLt reads the attributes when ``cublasLtMatmul``
  enqueues, so a later write affects neither an enqueued call nor a captured graph. Other shapes
  run the problem's own descriptor, which nothing writes after it is built.
- The handle (one per device) is not changed after it is created; cuBLAS documents its
  functions as callable from several host threads with one handle.
- Plans and problems are built under one lock; calls find them with a dict lookup.
"""

from __future__ import annotations

import threading
import weakref

import torch

from gemmtune.kernels.cublaslt._bindings import (
    COMPUTE_32F,
    CUDA_R_32F,
    CUDA_TYPES,
    EPILOGUE_BIAS,
    OP_T,
    bindings,
    enum_value,
    numpy,
    scalar,
    set_attr,
)
from gemmtune.kernels.cublaslt.algo import LtAlgo, cap_attr

# The workspace of one stream served every algorithm measured on H100 (largest need seen: 8 MiB).
WORKSPACE_BYTES = 32 * 2**20
HEURISTIC_REQUEST = 64  # cuBLASLt 13.1 returns at most 8 on H100 however many are asked for

_INPUT_DTYPES = (torch.bfloat16, torch.float16)
# How FP8 inputs are scaled: one fp32 value per operand, or one per row of x and of w.
SCALINGS = ("tensor", "outer")
_SCALED_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def why_not_types(dtype: torch.dtype, out_dtype: torch.dtype, scaling: str = "") -> str | None:
    """Why the backend takes no ``dtype`` inputs with ``out_dtype`` output and ``scaling`` (one
    of SCALINGS, or "" for bf16/fp16), or None."""
    if not (isinstance(dtype, torch.dtype) and isinstance(out_dtype, torch.dtype)):
        return (f"dtypes must be torch.dtype, got {dtype!r} and {out_dtype!r} (tables map their "
                f"names with gemmtune.tables.values.to_torch_dtype)")
    if dtype == torch.float8_e4m3fn or scaling:
        if dtype != torch.float8_e4m3fn or scaling not in SCALINGS:
            return (f"{dtype} with scaling {scaling or 'none'!r}: scaled cuBLASLt GEMMs take "
                    f"float8_e4m3fn inputs with scaling one of {SCALINGS}")
        if out_dtype not in _SCALED_OUT_DTYPES:
            return (f"output {out_dtype} from FP8 inputs is not supported by the cublaslt "
                    f"backend; use one of {', '.join(map(str, _SCALED_OUT_DTYPES))}")
        return None
    if dtype not in _INPUT_DTYPES:
        return (f"inputs of {dtype} are not supported by the cublaslt backend; it takes "
                f"bfloat16 or float16")
    if out_dtype not in (dtype, torch.float32):
        return (f"output {out_dtype} from {dtype} inputs is not supported by the cublaslt "
                f"backend; use {dtype} or torch.float32")
    return None


_lock = threading.RLock()


class _Device:
    """One GPU's cuBLASLt handle and its workspaces, one per stream that ran a GEMM."""

    def __init__(self, index: int):
        with torch.cuda.device(index):
            self.handle = bindings().create()
        self.index = index
        self.workspaces: dict[int, int] = {}  # raw stream handle -> workspace pointer
        self._buffers: list[torch.Tensor] = []  # every workspace, alive for the graphs using it

    def workspace(self, stream: int) -> int:
        """The workspace of ``stream`` (a raw handle; this device must be current), allocated
        on the stream's first GEMM: under graph capture from the graph's pool."""
        with _lock:
            ptr = self.workspaces.get(stream)
            if ptr is None:
                buf = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                  device=torch.device("cuda", self.index))
                self._buffers.append(buf)
                ptr = self.workspaces[stream] = buf.data_ptr()
            return ptr


class ThreadDesc:
    """One thread's copy of a problem's descriptor: the per-call pointers (bias, FP8 scales) are
    written only here, and each is written only when it differs from the last one."""

    __slots__ = ("desc", "bias_ptr", "scale_ptrs", "close", "_set", "_bias_attr",
                 "_scale_attrs", "_buf", "_buf_ptr", "_buf_size", "__weakref__")

    def __init__(self, problem: LtProblem):
        L = bindings()
        self.desc = problem.new_desc()
        self.close = weakref.finalize(self, L.matmul_desc_destroy, self.desc)
        self.close.atexit = False  # at exit the process frees it with the library
        self.bias_ptr, self.scale_ptrs = 0, (0, 0)  # nothing written yet: the first call writes
        self._set = L.matmul_desc_set_attribute
        self._bias_attr, self._scale_attrs = problem.bias_attr, problem.scale_attrs
        # The host buffer cuBLASLt copies a pointer from; this thread's alone.
        self._buf = scalar(problem.pointer_dtype)
        self._buf_ptr, self._buf_size = self._buf.ctypes.data, self._buf.itemsize

    def set_bias(self, ptr: int) -> None:
        self._buf[0] = ptr
        self._set(self.desc, self._bias_attr, self._buf_ptr, self._buf_size)
        self.bias_ptr = ptr

    def set_scales(self, w_scale_ptr: int, x_scale_ptr: int) -> None:
        """cuBLAS's A is w and B is x (see the module docstring): A's scales are w's."""
        for attr, ptr in zip(self._scale_attrs, (w_scale_ptr, x_scale_ptr)):
            self._buf[0] = ptr
            self._set(self.desc, attr, self._buf_ptr, self._buf_size)
        self.scale_ptrs = (w_scale_ptr, x_scale_ptr)


def _destroy_descriptors(pref: int, layouts: tuple, desc: int) -> None:
    L = bindings()
    L.matmul_preference_destroy(pref)
    for layout in layouts:
        L.matrix_layout_destroy(layout)
    L.matmul_desc_destroy(desc)


class LtProblem:
    """Descriptors of one (M, N, K, bias, dtypes, scale mode, device): shared by every
    algorithm's plan. ``per_call``: its calls bring pointers of their own (bias, scales), which
    go into ``thread_local.own``, a ``ThreadDesc`` per thread."""

    def __init__(self, m, n, k, has_bias, dtype, out_dtype, scaling: str, device: int):
        L = bindings()
        self.key = (m, n, k, has_bias, dtype, out_dtype, scaling, device)
        self.has_bias, self.scaling = has_bias, scaling
        self.device = device_state(device)
        self.in_type, self.out_type = CUDA_TYPES[dtype], CUDA_TYPES[out_dtype]
        desc_attr = L.MatmulDescAttribute
        self.bias_attr = int(desc_attr.BIAS_POINTER)
        self.scale_attrs = (int(desc_attr.A_SCALE_POINTER), int(desc_attr.B_SCALE_POINTER))
        self.pointer_dtype = L.get_matmul_desc_attribute_dtype(desc_attr.BIAS_POINTER)
        if scaling:
            # The heuristic and algo_check refuse a scaled descriptor without scale pointers
            # (H100, cuBLASLt 13.1: no algorithm at all); calls write their own.
            self._placeholder = torch.ones(max(m, n), dtype=torch.float32,
                                           device=torch.device("cuda", device))
        self.per_call = has_bias or bool(scaling)
        self.thread_local = threading.local()
        self.desc = self.new_desc()
        self.a = L.matrix_layout_create(self.in_type, k, n, k)  # W: K x N column-major, op T
        self.b = L.matrix_layout_create(self.in_type, k, m, k)  # x: K x M column-major
        self.c = L.matrix_layout_create(self.out_type, n, m, n)  # y: N x M column-major
        self.pref = L.matmul_preference_create()
        set_attr(L.matmul_preference_set_attribute, L.get_matmul_preference_attribute_dtype,
                 self.pref, L.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, WORKSPACE_BYTES)
        # The descriptors go when the last holder of this problem does (a plan, an op's bound
        # call), or at ``destroy``; each thread's descriptor has its own finalizer.
        self.destroy = weakref.finalize(self, _destroy_descriptors, self.pref,
                                        (self.a, self.b, self.c), self.desc)
        self.destroy.atexit = False  # at exit the process frees them with the library

    def new_desc(self) -> int:
        """A matmul descriptor with this problem's attributes (scale pointers: placeholders)."""
        L = bindings()
        desc_attr = L.MatmulDescAttribute
        desc = L.matmul_desc_create(COMPUTE_32F, CUDA_R_32F)

        def put(attr, value) -> None:
            set_attr(L.matmul_desc_set_attribute, L.get_matmul_desc_attribute_dtype, desc, attr,
                     value)

        put(desc_attr.TRANSA, OP_T)
        if self.scaling:
            mode = int(L.MatmulMatrixScale.SCALAR_32F if self.scaling == "tensor"
                       else L.MatmulMatrixScale.OUTER_VEC_32F)
            put(desc_attr.A_SCALE_MODE, mode)
            put(desc_attr.B_SCALE_MODE, mode)
            put(desc_attr.A_SCALE_POINTER, self._placeholder.data_ptr())
            put(desc_attr.B_SCALE_POINTER, self._placeholder.data_ptr())
        if self.has_bias:
            put(desc_attr.EPILOGUE, EPILOGUE_BIAS)
            put(desc_attr.BIAS_DATA_TYPE, self.out_type)
        return desc

    def new_thread_desc(self) -> ThreadDesc:
        """The calling thread's descriptor, made on its first call of this problem."""
        with _lock:
            own = getattr(self.thread_local, "own", None)
            if own is None:
                own = self.thread_local.own = ThreadDesc(self)
            return own

    def heuristic(self, count: int = HEURISTIC_REQUEST) -> list:
        """The heuristic's algorithms, best first, as raw ``matmul_algo_dtype`` arrays."""
        L, np = bindings(), numpy()
        results = np.zeros(count, dtype=L.matmul_heuristic_result_dtype)
        returned = np.zeros(1, dtype=np.int32)
        try:
            L.matmul_algo_get_heuristic(self.device.handle, self.desc, self.a, self.b, self.c,
                                        self.c, self.pref, count, results.ctypes.data,
                                        returned.ctypes.data)
        except L.cuBLASLtError:
            return []  # e.g. NOT_SUPPORTED for this type combination
        return [results["algo"][i:i + 1].copy() for i in range(int(returned[0]))
                if results["state"][i] == 0]

    def init_algo(self, algo_id: int):
        L = bindings()
        raw = numpy().zeros(1, dtype=L.matmul_algo_dtype)
        L.matmul_algo_init(self.device.handle, COMPUTE_32F, CUDA_R_32F, self.in_type,
                           self.in_type, self.out_type, self.out_type, algo_id, raw.ctypes.data)
        return raw

    def build(self, algo: LtAlgo):
        """The raw algorithm for ``algo``, or ValueError naming why cuBLASLt refuses it here."""
        L = bindings()
        cfg = L.MatmulAlgoConfigAttribute
        try:
            raw = self.init_algo(algo.algo_id)
            values = (
                (cfg.TILE_ID, enum_value(L.MatmulTile, "TILE_", algo.tile, "tile")),
                (cfg.STAGES_ID, enum_value(L.MatmulStages, "STAGES_", algo.stages, "stages")),
                (cfg.SPLITK_NUM, algo.split_k),
                (cfg.REDUCTION_SCHEME, algo.reduction),
                (cfg.CTA_SWIZZLING, algo.swizzle),
                (cfg.CUSTOM_OPTION, algo.custom),
                (cfg.CLUSTER_SHAPE_ID,
                 enum_value(L.ClusterShape, "SHAPE_", algo.cluster, "cluster shape")),
                (cfg.INNER_SHAPE_ID, algo.inner),
            )
            for attr, value in values:
                set_attr(L.matmul_algo_config_set_attribute,
                         L.get_matmul_algo_config_attribute_dtype, raw.ctypes.data, attr, value)
        except L.cuBLASLtError as e:
            raise ValueError(f"{algo.name}: cuBLASLt cannot build it ({e})") from None
        return raw

    def check(self, raw) -> tuple[int, float]:
        """``matmul_algo_check`` of a raw algorithm: (workspace bytes, waves), or ValueError."""
        L = bindings()
        result = numpy().zeros(1, dtype=L.matmul_heuristic_result_dtype)
        try:
            L.matmul_algo_check(self.device.handle, self.desc, self.a, self.b, self.c, self.c,
                                raw.ctypes.data, result.ctypes.data)
        except L.cuBLASLtError as e:
            raise ValueError(f"cuBLASLt rejects it for this shape ({e})") from None
        workspace = int(result["workspace_size"][0])
        if workspace > WORKSPACE_BYTES:
            raise ValueError(f"needs a {workspace} B workspace, more than the "
                             f"{WORKSPACE_BYTES} B this backend allocates per stream")
        return workspace, float(result["waves_count"][0])


class Plan:
    """Everything one call needs, resolved to plain ints (pointers) for the hot path. ``desc``
    is None where calls write pointers: they take ``thread_local.own`` (``new_thread_desc``)."""

    __slots__ = ("problem", "algo", "raw", "workspace_bytes", "matmul", "handle", "desc",
                 "thread_local", "a", "b", "c", "alpha", "beta", "algo_ptr", "workspaces",
                 "device_state", "align_mask", "device", "_keep")

    def __init__(self, problem: LtProblem, algo: LtAlgo, raw):
        L, np = bindings(), numpy()
        self.problem, self.algo, self.raw = problem, algo, raw
        self.workspace_bytes = problem.check(raw)[0]  # what this algorithm uses of a workspace
        caps = L.MatmulAlgoCapAttribute
        align = max(16, *(cap_attr(raw, c) for c in (caps.MIN_ALIGNMENT_A_BYTES,
                                                       caps.MIN_ALIGNMENT_B_BYTES,
                                                       caps.MIN_ALIGNMENT_C_BYTES,
                                                       caps.MIN_ALIGNMENT_D_BYTES)))
        self.align_mask = (1 << max(0, align - 1).bit_length()) - 1  # power of two >= align
        alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)  # host pointer mode
        self._keep = (alpha, beta, raw)
        self.matmul = L.matmul
        self.handle = problem.device.handle
        self.desc = None if problem.per_call else problem.desc
        self.thread_local = problem.thread_local
        self.a, self.b, self.c = problem.a, problem.b, problem.c
        self.alpha, self.beta = alpha.ctypes.data, beta.ctypes.data
        self.algo_ptr = raw.ctypes.data
        self.workspaces, self.device_state = problem.device.workspaces, problem.device
        self.device = torch.device("cuda", problem.device.index)


_devices: dict[int, _Device] = {}
_problems: dict[tuple, LtProblem] = {}
_plans: dict[tuple, Plan] = {}  # (algo name, M, N, K, bias, dtype, out_dtype, scaling, device)
_owners: weakref.WeakSet = weakref.WeakSet()  # kernels whose ``_plans`` dicts hold plans


def device_state(index: int) -> _Device:
    """The handle and workspaces of GPU ``index``, made on first use."""
    with _lock:
        dev = _devices.get(index)
        if dev is None:
            dev = _devices[index] = _Device(index)
        return dev


def lt_problem(m, n, k, has_bias, dtype, out_dtype, device: int, scaling: str = "") -> LtProblem:
    """The cached descriptors of one problem."""
    key = (m, n, k, has_bias, dtype, out_dtype, scaling, device)
    with _lock:
        prob = _problems.get(key)
        if prob is None:
            prob = _problems[key] = LtProblem(*key)
        return prob


def current_problem(m, n, k, dtype, out_dtype, has_bias, scaling: str = "") -> LtProblem:
    """The current GPU's descriptors of a problem, after checking that its types are taken
    (ImportError without nvmath, ValueError, RuntimeError without a GPU)."""
    bindings()
    why = why_not_types(dtype, out_dtype, scaling)
    if why:
        raise ValueError(why)
    if not torch.cuda.is_available():
        raise RuntimeError("cuBLASLt's algorithms need a CUDA GPU: it decides validity per GPU")
    return lt_problem(m, n, k, has_bias, dtype, out_dtype, torch.cuda.current_device(), scaling)


def get_plan(algo: LtAlgo, m, n, k, has_bias, dtype, out_dtype, device: int,
             scaling: str = "") -> Plan:
    """The cached plan of ``algo`` for this shape; ValueError (with the reason) if cuBLASLt
    refuses it, e.g. after a cuBLASLt upgrade dropped the configuration."""
    why = why_not_types(dtype, out_dtype, scaling)
    if why:
        raise ValueError(why)
    if min(m, n, k) < 1:
        raise ValueError(f"M={m}, N={n}, K={k}: cuBLASLt layouts need every size >= 1")
    key = (algo.name, m, n, k, has_bias, dtype, out_dtype, scaling, device)
    with _lock:
        plan = _plans.get(key)
        if plan is None:
            prob = lt_problem(m, n, k, has_bias, dtype, out_dtype, device, scaling)
            try:
                plan = Plan(prob, algo, prob.build(algo))
            except ValueError as e:
                raise ValueError(f"{algo.name} for M={m} N={n} K={k}: {e}") from None
            _plans[key] = plan
        return plan


def track(owner) -> None:
    """Have ``clear_plans`` empty ``owner._plans`` (a kernel's own plan dict) too."""
    with _lock:
        _owners.add(owner)


def clear_plans() -> None:
    """Forget every plan: a problem's descriptors are destroyed once nothing holds it (a plan
    got before, or an op's bound call, keeps its own alive and valid). Workspaces and handles
    are kept (captured graphs may use the workspaces)."""
    with _lock:
        for owner in list(_owners):
            owner._plans.clear()
        _plans.clear()
        _problems.clear()

"""cuBLASLt backend: ``y = x @ w.T (+ bias)`` with a named cuBLASLt algorithm: bf16/fp16 inputs
(gemm_a16w16), and FP8 e4m3 inputs with fp32 scales per tensor or per row of x and w (gemm_a8w8:
``CublasLtScaledKernel``; cuBLASLt's SCALAR_32F and OUTER_VEC_32F scale modes, both checked on
H100 with cuBLASLt 13.1 by benchmarks/cublaslt_fp8_probe.py).

A cuBLASLt algorithm is fully described by nine attributes (id, tile, stages, split-K, reduction
scheme, CTA swizzle, custom option, cluster shape, inner shape). ``LtAlgo`` holds them and spells
them as a ``kernelName``, e.g.
``cublaslt:id66.tile64x8.stages64xAUTO.sk4.red2.swz0.co1.cl1x2x1.in0``;
``matmul_algo_init`` + the attributes + ``matmul_algo_check`` rebuild the algorithm byte for byte
(shared/notes/cublaslt-from-python.md). ``enumerate_algos`` lists the candidates the tuner times:
the heuristic's own top algorithms, split-K values around theirs, and other tiles/stages of the
heuristic's algorithm id that ``matmul_algo_check`` accepts.

Calls go through nvmath-python's low-level bindings (``pip install gemmtune[cublaslt]``), imported
lazily so this module imports on machines without nvmath or a GPU. Layout for torch's convention
(cuBLAS is column-major, so it computes y.T = W @ x.T): m = N, n = M, k = K; A = W as K x N with
TRANSA = T, B = x as K x M, C = D = y as N x M, all with the leading dimension of the row-major
torch tensor.

Plans (descriptors, layouts, the rebuilt algorithm, pointers) are built once per (shape, dtypes,
bias, device, algorithm); a call then allocates the output and launches. Limits: one 32 MiB
workspace per device is shared by every plan, so two GEMMs must not run concurrently on different
streams of one device; a bias pointer is cached on the shared descriptor, so one shape with bias
should not be called from several threads at once.
"""

from __future__ import annotations

import math
import re
import threading
import weakref
from dataclasses import dataclass, replace

import torch

from gemmtune.kernels._names import Field, NameCodec, NamedConfig

KERNEL_PREFIX = "cublaslt"
INSTALL_HINT = "pip install gemmtune[cublaslt]"

# One workspace per device served every algorithm measured on H100 (largest need seen: 8 MiB).
WORKSPACE_BYTES = 32 * 2**20
DEFAULT_LIMIT = 48  # candidates per shape handed to the tuner: a few dozen timings per shape
_HEURISTIC_REQUEST = 64  # cuBLASLt 13.1 returns at most 8 on H100 however many are asked for

# ABI-stable enum values from library_types.h / cublas_api.h / cublasLt.h.
_CUDA_TYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14,
               torch.float8_e4m3fn: 28}  # cudaDataType_t
_CUDA_R_32F = 0
_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_OP_T = 1  # cublasOperation_t CUBLAS_OP_T
_EPILOGUE_BIAS = 4  # cublasLtEpilogue_t CUBLASLT_EPILOGUE_BIAS
_REDUCTION_SCHEMES = (0, 1, 2, 4)  # NONE, INPLACE, COMPUTE_TYPE, OUTPUT_TYPE

_INPUT_DTYPES = (torch.bfloat16, torch.float16)
# How FP8 inputs are scaled: one fp32 value per operand, or one per row of x and of w.
SCALINGS = ("tensor", "outer")
_SCALED_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SCALE_ALIGN = 16  # bytes; scale vectors at other addresses are copied

# ---------------------------------------------------------------------------------------------
# The name: every attribute of the algorithm, readable.
# ---------------------------------------------------------------------------------------------

_NAME_CODEC = NameCodec("cuBLASLt algorithm", KERNEL_PREFIX, (
    Field("id", "algo_id"),
    Field("tile", "tile", r"[0-9]+x[0-9]+|UNDEFINED", str),
    Field("stages", "stages", r"[0-9]+x(?:[0-9]+|AUTO)|UNDEFINED", str),
    Field("sk", "split_k"),
    Field("red", "reduction"),
    Field("swz", "swizzle"),
    Field("co", "custom"),
    Field("cl", "cluster", r"[0-9]+x[0-9]+x[0-9]+|AUTO", str),
    Field("in", "inner"),
), form=(f"{KERNEL_PREFIX}:id<int>.tile<R>x<C>.stages<D>x<S|AUTO>.sk<int>.red<int>.swz<int>"
         f".co<int>.cl<X>x<Y>x<Z>|AUTO.in<int>, e.g. "
         f"{KERNEL_PREFIX}:id66.tile64x8.stages64xAUTO.sk4.red2.swz0.co1.cl1x2x1.in0"))


@dataclass(frozen=True)
class LtAlgo(NamedConfig):
    """One cuBLASLt algorithm. ``tile``, ``stages`` and ``cluster`` are the labels of cuBLASLt's
    enums without their prefix (``64x8`` for ``CUBLASLT_MATMUL_TILE_64x8``, ``64xAUTO``,
    ``1x2x1`` or ``AUTO``); the other fields are the attribute values as cuBLASLt stores them.
    ``from_name`` needs no nvmath or GPU."""

    NAME_CODEC = _NAME_CODEC

    algo_id: int
    tile: str
    stages: str
    split_k: int
    reduction: int
    swizzle: int
    custom: int
    cluster: str
    inner: int

    def __post_init__(self):
        for field in self.NAME_CODEC.fields:
            value = getattr(self, field.attr)
            if field.parse is str:  # an enum label: tile, stages, cluster
                ok = isinstance(value, str) and re.fullmatch(field.pattern, value)
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if not ok:
                raise ValueError(f"LtAlgo.{field.attr}={value!r} is not a valid value; the name "
                                 f"form is {self.NAME_CODEC.form}")
        if self.reduction not in _REDUCTION_SCHEMES:
            raise ValueError(f"LtAlgo.reduction={self.reduction} must be one of "
                             f"{_REDUCTION_SCHEMES} (none, in-place, compute type, output type)")


# ---------------------------------------------------------------------------------------------
# nvmath bindings, loaded on first use.
# ---------------------------------------------------------------------------------------------

_L = None
_matmul = None  # cublasLt.matmul, bound once for the hot path


def bindings():
    """nvmath-python's ``cublasLt`` bindings; ImportError naming the extra when missing."""
    global _L, _matmul
    if _L is None:
        try:
            from nvmath.bindings import cublasLt
        except ImportError as e:
            raise ImportError(
                f"the cublaslt backend needs nvmath-python's low-level bindings, which did not "
                f"import ({e}); install them with `{INSTALL_HINT}`") from e
        _L, _matmul = cublasLt, cublasLt.matmul
    return _L


def nvmath_missing() -> str | None:
    """Why the bindings cannot be used here, or None."""
    try:
        bindings()
    except ImportError as e:
        return str(e)
    return None


def _np():
    import numpy as np

    return np


def _scalar(dtype, value=0):
    return _np().array([value], dtype=dtype)


def _set_attr(setter, dtype_of, obj: int, attr, value) -> None:
    buf = _scalar(dtype_of(attr), value)
    setter(obj, int(attr), buf.ctypes.data, buf.itemsize)


def _enum_value(enum_cls, prefix: str, label: str, what: str) -> int:
    try:
        return int(enum_cls[prefix + label])
    except KeyError:
        raise ValueError(f"{what} {label!r} is not a {enum_cls.__name__} of the installed "
                         f"nvmath-python/cuBLASLt") from None


def _label(enum_cls, prefix: str, value: int) -> str | None:
    try:
        return enum_cls(value).name[len(prefix):]
    except ValueError:
        return None  # a value newer than nvmath's enum: it cannot be named, so it is skipped


# ---------------------------------------------------------------------------------------------
# Per-device state, problems (descriptors per shape) and plans (problem + algorithm).
# ---------------------------------------------------------------------------------------------

class _Device:
    def __init__(self, index: int):
        L = bindings()
        with torch.cuda.device(index):
            self.handle = L.create()
            self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                         device=f"cuda:{index}")
        self.workspace_ptr = self.workspace.data_ptr()
        self.sm_count = torch.cuda.get_device_properties(index).multi_processor_count


class _Problem:
    """Descriptors of one (M, N, K, bias, dtypes, device): shared by every algorithm's plan."""

    def __init__(self, m, n, k, has_bias, dtype, out_dtype, scaling: str, device: int):
        L = bindings()
        self.key = (m, n, k, has_bias, dtype, out_dtype, scaling, device)
        self.device = _device(device)
        self.in_type, self.out_type = _CUDA_TYPES[dtype], _CUDA_TYPES[out_dtype]
        desc_attr = L.MatmulDescAttribute
        set_desc = (L.matmul_desc_set_attribute, L.get_matmul_desc_attribute_dtype)
        self.desc = L.matmul_desc_create(_COMPUTE_32F, _CUDA_R_32F)
        _set_attr(*set_desc, self.desc, desc_attr.TRANSA, _OP_T)
        self.bias_ptr = 0  # last bias pointer written into the descriptor
        self.scale_ptrs = (0, 0)  # last (A = w, B = x) scale pointers written into it
        if scaling:
            mode = int(L.MatmulMatrixScale.SCALAR_32F if scaling == "tensor"
                       else L.MatmulMatrixScale.OUTER_VEC_32F)
            _set_attr(*set_desc, self.desc, desc_attr.A_SCALE_MODE, mode)
            _set_attr(*set_desc, self.desc, desc_attr.B_SCALE_MODE, mode)
            self._scale_attrs = (int(desc_attr.A_SCALE_POINTER), int(desc_attr.B_SCALE_POINTER))
            self._scale_buf = _scalar(L.get_matmul_desc_attribute_dtype(desc_attr.A_SCALE_POINTER))
            # The heuristic and algo_check refuse a scaled descriptor without scale pointers
            # (H100, cuBLASLt 13.1: no algorithm at all); calls replace these with their own.
            self._placeholder = torch.ones(max(m, n), dtype=torch.float32,
                                           device=torch.device("cuda", device))
            self.set_scales(self._placeholder.data_ptr(), self._placeholder.data_ptr())
        if has_bias:
            _set_attr(*set_desc, self.desc, desc_attr.EPILOGUE, _EPILOGUE_BIAS)
            _set_attr(*set_desc, self.desc, desc_attr.BIAS_DATA_TYPE, self.out_type)
            self._bias_buf = _scalar(L.get_matmul_desc_attribute_dtype(desc_attr.BIAS_POINTER))
            self._bias_attr = int(desc_attr.BIAS_POINTER)
        self.a = L.matrix_layout_create(self.in_type, k, n, k)  # W: K x N column-major, op T
        self.b = L.matrix_layout_create(self.in_type, k, m, k)  # x: K x M column-major
        self.c = L.matrix_layout_create(self.out_type, n, m, n)  # y: N x M column-major
        self.pref = L.matmul_preference_create()
        _set_attr(L.matmul_preference_set_attribute, L.get_matmul_preference_attribute_dtype,
                  self.pref, L.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, WORKSPACE_BYTES)

    def set_bias(self, ptr: int) -> None:
        self._bias_buf[0] = ptr
        _L.matmul_desc_set_attribute(self.desc, self._bias_attr, self._bias_buf.ctypes.data,
                                     self._bias_buf.itemsize)
        self.bias_ptr = ptr

    def set_scales(self, w_scale_ptr: int, x_scale_ptr: int) -> None:
        """cuBLAS's A is w and B is x (see the module docstring): A's scales are w's."""
        for attr, ptr in zip(self._scale_attrs, (w_scale_ptr, x_scale_ptr)):
            self._scale_buf[0] = ptr
            _L.matmul_desc_set_attribute(self.desc, attr, self._scale_buf.ctypes.data,
                                         self._scale_buf.itemsize)
        self.scale_ptrs = (w_scale_ptr, x_scale_ptr)

    def destroy(self) -> None:
        L = bindings()
        L.matmul_preference_destroy(self.pref)
        for layout in (self.a, self.b, self.c):
            L.matrix_layout_destroy(layout)
        L.matmul_desc_destroy(self.desc)

    def heuristic(self, count: int = _HEURISTIC_REQUEST) -> list:
        """The heuristic's algorithms, best first, as raw ``matmul_algo_dtype`` arrays."""
        L, np = bindings(), _np()
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
        raw = _np().zeros(1, dtype=L.matmul_algo_dtype)
        L.matmul_algo_init(self.device.handle, _COMPUTE_32F, _CUDA_R_32F, self.in_type,
                           self.in_type, self.out_type, self.out_type, algo_id, raw.ctypes.data)
        return raw

    def build(self, algo: LtAlgo):
        """The raw algorithm for ``algo``, or ValueError naming why cuBLASLt refuses it here."""
        L = bindings()
        cfg = L.MatmulAlgoConfigAttribute
        try:
            raw = self.init_algo(algo.algo_id)
            values = (
                (cfg.TILE_ID, _enum_value(L.MatmulTile, "TILE_", algo.tile, "tile")),
                (cfg.STAGES_ID, _enum_value(L.MatmulStages, "STAGES_", algo.stages, "stages")),
                (cfg.SPLITK_NUM, algo.split_k),
                (cfg.REDUCTION_SCHEME, algo.reduction),
                (cfg.CTA_SWIZZLING, algo.swizzle),
                (cfg.CUSTOM_OPTION, algo.custom),
                (cfg.CLUSTER_SHAPE_ID,
                 _enum_value(L.ClusterShape, "SHAPE_", algo.cluster, "cluster shape")),
                (cfg.INNER_SHAPE_ID, algo.inner),
            )
            for attr, value in values:
                _set_attr(L.matmul_algo_config_set_attribute,
                          L.get_matmul_algo_config_attribute_dtype, raw.ctypes.data, attr, value)
        except L.cuBLASLtError as e:
            raise ValueError(f"{algo.name}: cuBLASLt cannot build it ({e})") from None
        return raw

    def check(self, raw) -> tuple[int, float]:
        """``matmul_algo_check`` of a raw algorithm: (workspace bytes, waves), or ValueError."""
        L = bindings()
        result = _np().zeros(1, dtype=L.matmul_heuristic_result_dtype)
        try:
            L.matmul_algo_check(self.device.handle, self.desc, self.a, self.b, self.c, self.c,
                                raw.ctypes.data, result.ctypes.data)
        except L.cuBLASLtError as e:
            raise ValueError(f"cuBLASLt rejects it for this shape ({e})") from None
        workspace = int(result["workspace_size"][0])
        if workspace > WORKSPACE_BYTES:
            raise ValueError(f"needs a {workspace} B workspace, more than the "
                             f"{WORKSPACE_BYTES} B this backend allocates")
        return workspace, float(result["waves_count"][0])


def _read_attr(raw, attr, dtype_of, getter) -> int:
    """One scalar attribute of an algorithm, sized by its own dtype query (some are uint16)."""
    value = _scalar(dtype_of(attr))
    written = _np().zeros(1, dtype=_np().uint64)
    getter(raw.ctypes.data, int(attr), value.ctypes.data, value.itemsize, written.ctypes.data)
    return int(value[0])


def _config(raw, attr) -> int:
    L = bindings()
    return _read_attr(raw, attr, L.get_matmul_algo_config_attribute_dtype,
                      L.matmul_algo_config_get_attribute)


def _cap(raw, attr) -> int:
    L = bindings()
    return _read_attr(raw, attr, L.get_matmul_algo_cap_attribute_dtype,
                      L.matmul_algo_cap_get_attribute)


def _cap_list(raw, attr) -> list[int]:
    """A list-valued capability (TILE_IDS, STAGES_IDS): ask for its size, then read it."""
    L, np = bindings(), _np()
    dtype = np.dtype(L.get_matmul_algo_cap_attribute_dtype(attr))
    written = np.zeros(1, dtype=np.uint64)
    L.matmul_algo_cap_get_attribute(raw.ctypes.data, int(attr), 0, 0, written.ctypes.data)
    count = int(written[0]) // dtype.itemsize
    if count == 0:
        return []
    values = np.zeros(count, dtype=dtype)
    L.matmul_algo_cap_get_attribute(raw.ctypes.data, int(attr), values.ctypes.data,
                                    values.nbytes, written.ctypes.data)
    return [int(v) for v in values]


def algo_of(raw) -> LtAlgo | None:
    """The ``LtAlgo`` a raw cuBLASLt algorithm is, or None if nvmath cannot name its labels."""
    L = bindings()
    cfg = L.MatmulAlgoConfigAttribute
    tile = _label(L.MatmulTile, "TILE_", _config(raw, cfg.TILE_ID))
    stages = _label(L.MatmulStages, "STAGES_", _config(raw, cfg.STAGES_ID))
    cluster = _label(L.ClusterShape, "SHAPE_", _config(raw, cfg.CLUSTER_SHAPE_ID))
    if tile is None or stages is None or cluster is None:
        return None
    return LtAlgo(algo_id=_config(raw, cfg.ID), tile=tile, stages=stages,
                  split_k=_config(raw, cfg.SPLITK_NUM),
                  reduction=_config(raw, cfg.REDUCTION_SCHEME),
                  swizzle=_config(raw, cfg.CTA_SWIZZLING), custom=_config(raw, cfg.CUSTOM_OPTION),
                  cluster=cluster, inner=_config(raw, cfg.INNER_SHAPE_ID))


class _Plan:
    """Everything one call needs, resolved to plain ints (pointers) for the hot path."""

    __slots__ = ("problem", "algo", "raw", "handle", "desc", "a", "b", "c", "alpha", "beta",
                 "algo_ptr", "workspace", "workspace_size", "align_mask", "device", "_keep")

    def __init__(self, problem: _Problem, algo: LtAlgo, raw):
        L, np = bindings(), _np()
        self.problem, self.algo, self.raw = problem, algo, raw
        problem.check(raw)
        caps = L.MatmulAlgoCapAttribute
        align = max(16, *(_cap(raw, c) for c in (caps.MIN_ALIGNMENT_A_BYTES,
                                                   caps.MIN_ALIGNMENT_B_BYTES,
                                                   caps.MIN_ALIGNMENT_C_BYTES,
                                                   caps.MIN_ALIGNMENT_D_BYTES)))
        self.align_mask = (1 << max(0, align - 1).bit_length()) - 1  # power of two >= align
        alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)  # host pointer mode
        self._keep = (alpha, beta, raw)
        self.handle, self.desc = problem.device.handle, problem.desc
        self.a, self.b, self.c = problem.a, problem.b, problem.c
        self.alpha, self.beta = alpha.ctypes.data, beta.ctypes.data
        self.algo_ptr = raw.ctypes.data
        self.workspace, self.workspace_size = problem.device.workspace_ptr, WORKSPACE_BYTES
        self.device = torch.device("cuda", problem.key[-1])


_lock = threading.RLock()
_devices: dict[int, _Device] = {}
_problems: dict[tuple, _Problem] = {}
_plans: dict[tuple, _Plan] = {}  # (algo name, M, N, K, bias, dtype, out_dtype, scaling, device)
_kernels: "weakref.WeakSet[CublasLtKernel]" = weakref.WeakSet()


def _device(index: int) -> _Device:
    with _lock:
        dev = _devices.get(index)
        if dev is None:
            dev = _devices[index] = _Device(index)
        return dev


def _problem(m, n, k, has_bias, dtype, out_dtype, device: int, scaling: str = "") -> _Problem:
    key = (m, n, k, has_bias, dtype, out_dtype, scaling, device)
    with _lock:
        prob = _problems.get(key)
        if prob is None:
            prob = _problems[key] = _Problem(*key)
        return prob


def get_plan(algo: LtAlgo, m, n, k, has_bias, dtype, out_dtype, device: int,
             scaling: str = "") -> _Plan:
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
            prob = _problem(m, n, k, has_bias, dtype, out_dtype, device, scaling)
            try:
                plan = _Plan(prob, algo, prob.build(algo))
            except ValueError as e:
                raise ValueError(f"{algo.name} for M={m} N={n} K={k}: {e}") from None
            _plans[key] = plan
        return plan


def clear_plans() -> None:
    """Destroy every descriptor and forget every plan (workspaces and handles are kept)."""
    with _lock:
        for kernel in list(_kernels):
            kernel._plans.clear()
        _plans.clear()
        for prob in _problems.values():
            prob.destroy()
        _problems.clear()


def why_not_types(dtype: torch.dtype, out_dtype: torch.dtype, scaling: str = "") -> str | None:
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


def _as_dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    from gemmtune.tables.values import to_torch_dtype

    return to_torch_dtype(d)


# ---------------------------------------------------------------------------------------------
# Enumeration: the candidates the tuner times.
# ---------------------------------------------------------------------------------------------

_SPLIT_K_MAX = 32
_MIN_K_PER_SPLIT = 128  # below this a split's partial product is too short to pay for reducing


def _split_k_values(s: int, k: int) -> list[int]:
    """Split-K values around the heuristic's ``s``, nearest first (``s`` itself excluded)."""
    near = {1, s - 2, s - 1, s + 1, s + 2, s // 2, (3 * s) // 2, 2 * s}
    ok = [v for v in near if 1 <= v <= _SPLIT_K_MAX and v != s
          and (v == 1 or k // v >= _MIN_K_PER_SPLIT)]
    return sorted(ok, key=lambda v: (abs(v - s), v))


def _tile_dims(label: str) -> tuple[int, int] | None:
    match = re.fullmatch(r"([0-9]+)x([0-9]+)", label)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _wanted_tiles(m: int, heuristic_tiles: set[str], labels: list[str]) -> list[str]:
    """Tiles worth trying beside the heuristic's: the tile's first dimension runs along N (cuBLAS
    rows), its second along M; keep M-widths near M and the usual N-widths."""
    c0 = min(256, max(8, 1 << max(0, m - 1).bit_length()))
    widths = {max(8, c0 // 2), c0, min(256, 2 * c0)}
    out = []
    for label in labels:
        dims = _tile_dims(label)
        if label in heuristic_tiles or (dims and dims[0] in (64, 128, 256) and dims[1] in widths):
            out.append(label)
    return out


def enumerate_algos(M: int, N: int, K: int, dtype, out_dtype, has_bias: bool,
                    limit: int = DEFAULT_LIMIT, scaling: str = "") -> list[LtAlgo]:
    """Valid algorithms for ``(M, N, K)`` on the current GPU, at most ``limit``: the heuristic's
    list first (its order), then split-K values around those of its top four (at most half of
    ``limit``), then tiles/stages of its first algorithm's id with that algorithm's other
    attributes (or a 1x1x1 cluster where its own is taken or refused), best wave fill first.
    Every one was rebuilt from its name and passed ``matmul_algo_check`` here.

    Measured on H200 (cuBLASLt 13.1, bf16): 17-39 candidates per shape; the fastest beat
    heuristic #0 by 1-13% under CUDA-graph replay (split-K 2 -> 1 at 16x4096x4096, cluster
    2x1x1 -> 1x1x1 at 128x4096x4096). ``scaling``: the FP8 scale mode (one of SCALINGS), or ""."""
    bindings()
    dtype, out_dtype = _as_dtype(dtype), _as_dtype(out_dtype)
    why = why_not_types(dtype, out_dtype, scaling)
    if why:
        raise ValueError(why)
    if not torch.cuda.is_available():
        raise RuntimeError("enumerate_algos needs a CUDA GPU: cuBLASLt decides validity per GPU")
    device = torch.cuda.current_device()
    prob = _problem(M, N, K, has_bias, dtype, out_dtype, device, scaling)
    seen: set[str] = set()

    def valid(algo: LtAlgo) -> float | None:
        """Waves of a new candidate rebuilt from its name; None if seen already or refused."""
        if algo.name in seen:
            return None
        seen.add(algo.name)
        try:
            return prob.check(prob.build(algo))[1]
        except ValueError:
            return None

    # The heuristic's own, kept only if its name rebuilds it (what a table row will do).
    heuristic = [a for a in map(algo_of, prob.heuristic())
                 if a is not None and valid(a) is not None]
    if not heuristic:
        return []

    out = list(heuristic[:limit])
    split_budget = max(0, min(limit - len(out), limit // 2))
    split_variants: list[LtAlgo] = []
    for h in heuristic[:4]:
        for sk in _split_k_values(h.split_k, K):
            schemes = [0] if sk == 1 else ([h.reduction] if h.reduction else [2, 1, 4])
            for red in schemes:
                cand = replace(h, split_k=sk, reduction=red)
                if valid(cand) is not None:
                    split_variants.append(cand)
                    break
    # Nearest split-K values of the best-ranked heuristic algorithms first.
    out += split_variants[:split_budget]

    h0 = heuristic[0]
    init = prob.init_algo(h0.algo_id)
    caps = bindings().MatmulAlgoCapAttribute
    L = bindings()
    tiles = [t for t in (_label(L.MatmulTile, "TILE_", v) for v in _cap_list(init, caps.TILE_IDS))
             if t is not None]
    stages = [s for s in (_label(L.MatmulStages, "STAGES_", v)
                          for v in _cap_list(init, caps.STAGES_IDS)) if s is not None]
    stages = [s for s in stages if s.endswith("xAUTO") or s == h0.stages]
    tile_variants: list[tuple[float, int, LtAlgo]] = []
    for tile in _wanted_tiles(M, {h.tile for h in heuristic}, tiles):
        for st in stages or [h0.stages]:
            for cluster in dict.fromkeys((h0.cluster, "1x1x1")):
                cand = replace(h0, tile=tile, stages=st, cluster=cluster)
                waves = valid(cand)
                if waves is not None:
                    fill = waves / math.ceil(waves) if waves > 0 else 0.0
                    tile_variants.append((-fill, len(tile_variants), cand))
                    break
    tile_variants.sort()
    out += [cand for _, _, cand in tile_variants[:max(0, limit - len(out))]]
    return out


def heuristic_algos(M: int, N: int, K: int, dtype, out_dtype, has_bias: bool) -> list[LtAlgo]:
    """The heuristic's own list for this shape on the current GPU, best first (#0 is what
    cuBLASLt would pick)."""
    bindings()
    dtype, out_dtype = _as_dtype(dtype), _as_dtype(out_dtype)
    prob = _problem(M, N, K, has_bias, dtype, out_dtype, torch.cuda.current_device())
    return [a for a in map(algo_of, prob.heuristic()) if a is not None]


# ---------------------------------------------------------------------------------------------
# The kernel the gemm_a16w16 registry resolves a ``cublaslt:...`` name to.
# ---------------------------------------------------------------------------------------------

class CublasLtKernel:
    """A ``cublaslt:...`` row's kernel: ``check(key)`` builds and validates the plan once per
    shape; each call then allocates the output and launches the planned algorithm."""

    def __init__(self, name: str):
        self.algo = LtAlgo.from_name(name)
        self.name = self.algo.name
        self._plans: dict[tuple, _Plan] = {}  # (M, N, K, bias, dtype, out_dtype, scaling, device)
        _kernels.add(self)

    def __repr__(self) -> str:
        return f"CublasLtKernel({self.name!r})"

    def check(self, key: tuple) -> str | None:
        """Why this algorithm cannot run the table key ``(M, N, K, bias, dtype, outdtype,
        scaleAB, bpreshuffle)`` on the current GPU, or None (the plan is then built)."""
        m, n, k, has_bias, dtype_name, out_name, scaled, preshuffled = key
        if scaled:
            return ("per-tensor scale_a/scale_b are not supported by the cublaslt backend; use "
                    "torch.linear or triton.tile for scaled GEMMs")
        if preshuffled:
            return "pre-shuffled weights are not supported by the cublaslt backend"
        try:
            dtype, out_dtype = _as_dtype(dtype_name), _as_dtype(out_name)
        except ValueError as e:
            return str(e)
        why = why_not_types(dtype, out_dtype) or nvmath_missing()
        if why:
            return why
        if not torch.cuda.is_available():
            return "no CUDA GPU: the cublaslt backend runs on NVIDIA GPUs only"
        try:
            self._plan(m, n, k, bool(has_bias), dtype, out_dtype, torch.cuda.current_device())
        except ValueError as e:
            return str(e)
        return None

    def _plan(self, m, n, k, has_bias, dtype, out_dtype, device, scaling: str = "") -> _Plan:
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
        n, k = w.shape
        m = x.numel() // k if k else 0
        dev = x.get_device()
        plan = self._plans.get((m, n, k, bias is not None, x.dtype, out_dtype, "", dev))
        if plan is None:
            if min(m, n, k) < 1 or dev < 0:
                return _degenerate(x, w, bias, out_dtype, out)
            plan = self._plan(m, n, k, bias is not None, x.dtype, out_dtype, dev)
        return self._run_plan(plan, x, w, bias, out_dtype, out, m, n, dev)

    @staticmethod
    def _run_plan(plan: _Plan, x, w, bias, out_dtype, out, m: int, n: int, dev: int):
        xp, wp = x.data_ptr(), w.data_ptr()
        if bias is not None:
            if bias.dtype != out_dtype or not bias.is_contiguous():
                bias = bias.to(out_dtype).contiguous()
            bp = bias.data_ptr()
            if bp & plan.align_mask:
                bias = bias.clone()
                bp = bias.data_ptr()
            if bp != plan.problem.bias_ptr:
                plan.problem.set_bias(bp)
        if (xp | wp) & plan.align_mask or not (x.is_contiguous() and w.is_contiguous()):
            # Views with offsets or strides: copies are aligned and dense (torch allocations are
            # 512-byte aligned). Rare in models; the layouts in the plan assume dense rows.
            x, w = x.clone(memory_format=torch.contiguous_format), w.contiguous()
            if w.data_ptr() & plan.align_mask:
                w = w.clone()
            xp, wp = x.data_ptr(), w.data_ptr()
        if out is None:
            out = torch.empty((m, n) if x.dim() == 2 else x.shape[:-1] + (n,), dtype=out_dtype,
                              device=plan.device)
        op = out.data_ptr()
        if dev != torch._C._cuda_getDevice():
            with torch.cuda.device(dev):
                _launch(plan, xp, wp, op, torch._C._cuda_getCurrentRawStream(dev))
            return out
        # The stream is read on every call, never cached: a cached handle makes CUDA-graph capture
        # record nothing (silently) while the GEMM runs eagerly.
        _matmul(plan.handle, plan.desc, plan.alpha, wp, plan.a, xp, plan.b, plan.beta, op,
                plan.c, op, plan.c, plan.algo_ptr, plan.workspace, plan.workspace_size,
                torch._C._cuda_getCurrentRawStream(dev))
        return out


class CublasLtScaledKernel(CublasLtKernel):
    """A ``cublaslt:...`` row of the a8w8 table: FP8 x and w with fp32 scales, one per tensor or
    one per row of x / of w (a single value beside a vector is broadcast to a vector, since
    cuBLASLt takes one scale mode per call). The descriptor of a shape holds the last scale
    pointers, as it holds the bias pointer: one shape should not be called from several
    threads at once."""

    def __init__(self, name: str):
        super().__init__(name)
        self._refused: set[tuple] = set()  # call keys cuBLASLt refused: they run torch

    def check(self, key: tuple) -> str | None:
        """Why this algorithm cannot run the a8w8 key ``(M, N, K, q_dtype_w)`` here, or None;
        both scale modes are planned, since the table key does not say which a call brings."""
        m, n, k, q_name = key
        try:
            dtype = _as_dtype(q_name)
        except ValueError as e:
            return str(e)
        if dtype != torch.float8_e4m3fn:
            return f"{dtype} weights: the cublaslt backend of gemm_a8w8 takes FP8 (e4m3) only"
        why = nvmath_missing()
        if why:
            return why
        if not torch.cuda.is_available():
            return "no CUDA GPU: the cublaslt backend runs on NVIDIA GPUs only"
        try:
            for scaling in SCALINGS:
                self._plan(m, n, k, False, dtype, torch.bfloat16, torch.cuda.current_device(),
                           scaling)
        except ValueError as e:
            return str(e)
        return None

    def __call__(self, x, w, bias, out_dtype, scale_a, scale_b, out=None):
        if scale_a is None or scale_b is None:
            raise ValueError("cublaslt backend of gemm_a8w8: FP8 needs both scales")
        n, k = w.shape
        m = x.numel() // k if k else 0
        dev = x.get_device()
        per_tensor = scale_a.numel() == 1 and scale_b.numel() == 1
        scaling = "tensor" if per_tensor else "outer"
        key = (m, n, k, bias is not None, x.dtype, out_dtype, scaling, dev)
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
        if not per_tensor:
            scale_a, scale_b = scale_a.reshape(-1), scale_b.reshape(-1)
            if scale_a.numel() != m:
                scale_a = scale_a.expand(m)
            if scale_b.numel() != n:
                scale_b = scale_b.expand(n)
        scale_a, scale_b = (_aligned_dense(s) for s in (scale_a, scale_b))
        ptrs = (scale_b.data_ptr(), scale_a.data_ptr())
        if ptrs != plan.problem.scale_ptrs:
            plan.problem.set_scales(*ptrs)
        return self._run_plan(plan, x, w, bias, out_dtype, out, m, n, dev)


    @staticmethod
    def _fallback(x, w, bias, out_dtype, scale_a, scale_b, out):
        if x.is_cuda and min(x.numel(), w.numel()):
            from gemmtune.ops.gemm_a8w8 import scaled_mm_torch

            return scaled_mm_torch(x, w, bias, out_dtype, scale_a, scale_b, out=out)
        return _degenerate_scaled(x, w, bias, out_dtype, scale_a, scale_b, out)


def _aligned_dense(scale: torch.Tensor) -> torch.Tensor:
    if scale.is_contiguous() and scale.data_ptr() % _SCALE_ALIGN == 0:
        return scale
    return scale.clone(memory_format=torch.contiguous_format)  # dense, freshly aligned


def heuristic_kernels(M: int, N: int, K: int, dtype, out_dtype, has_bias: bool
                      ) -> list[CublasLtKernel]:
    """Kernels that run the heuristic's algorithms exactly as cuBLASLt returned them (not rebuilt
    from their names), best first: what checks that a name is the whole truth compare against."""
    bindings()
    dtype, out_dtype = _as_dtype(dtype), _as_dtype(out_dtype)
    device = torch.cuda.current_device()
    prob = _problem(M, N, K, has_bias, dtype, out_dtype, device)
    kernels = []
    for raw in prob.heuristic():
        algo = algo_of(raw)
        if algo is None:
            continue
        kernel = CublasLtKernel(algo.name)
        kernel._plans[(M, N, K, has_bias, dtype, out_dtype, "", device)] = _Plan(prob, algo, raw)
        kernels.append(kernel)
    return kernels


def algo_bytes(kernel: CublasLtKernel, M: int, N: int, K: int, dtype, out_dtype,
               has_bias: bool) -> bytes:
    """The raw ``cublasLtMatmulAlgo_t`` a kernel runs for this shape on the current GPU."""
    dtype, out_dtype, device = _as_dtype(dtype), _as_dtype(out_dtype), torch.cuda.current_device()
    plan = kernel._plans.get((M, N, K, has_bias, dtype, out_dtype, "", device)) \
        or kernel._plan(M, N, K, has_bias, dtype, out_dtype, device)
    return plan.raw.tobytes()


def _launch(plan: _Plan, xp: int, wp: int, op: int, stream: int) -> None:
    _matmul(plan.handle, plan.desc, plan.alpha, wp, plan.a, xp, plan.b, plan.beta, op, plan.c,
            op, plan.c, plan.algo_ptr, plan.workspace, plan.workspace_size, stream)


def _degenerate_scaled(x, w, bias, out_dtype, scale_a, scale_b, out):
    """Empty sizes or tensors off the GPU, FP8: the dequantised product in fp32."""
    y = (x.reshape(-1, w.shape[1]).float() @ w.float().t()) * scale_a.reshape(-1, 1).float() \
        * scale_b.reshape(1, -1).float()
    y = (y if bias is None else y + bias.float()).to(out_dtype).view(*x.shape[:-1], w.shape[0])
    return y if out is None else out.copy_(y.reshape(out.shape))


def _degenerate(x, w, bias, out_dtype, out):
    """Empty M, N or K (cuBLASLt layouts need sizes >= 1), or a tensor off the GPU: torch."""
    y = torch.matmul(x.float(), w.float().t())
    if bias is not None:
        y = y + bias.float()
    y = y.to(out_dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def parse_cublaslt_kernel(name: str) -> CublasLtKernel:
    """Registry parser: ``cublaslt:...`` name -> kernel (ValueError on a malformed name)."""
    return CublasLtKernel(name)

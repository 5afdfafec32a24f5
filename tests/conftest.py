"""Test setup: run Triton kernels in the CPU interpreter when there is no GPU, and correct the
interpreter's known wrong results so bf16 and fp8 kernels can be checked against torch on CPU.

The interpreter must be chosen before any ``@triton.jit`` decorator runs (otherwise
``RuntimeError: 0 active drivers``), hence the environment variable first. On a GPU machine the
tests must run the real kernels, so it is only defaulted when CUDA is absent.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def interpreter_active() -> bool:
    """Whether ``@triton.jit`` kernels run in Triton's CPU interpreter in this process."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "yes", "on"}


# ---------------------------------------------------------------------------------------------
# Interpreter shim (test-only; never in the library).
#
# Wrong results of triton 3.7.1-3.9.0's interpreter (see shared/notes/ci-and-triton-interpreter.md):
#  * tl.dot on bf16 operands multiplies the raw uint16 bit patterns (triton-lang/triton#11584);
#  * fp32 -> bf16 truncates instead of rounding to nearest even (and bf16 <-> int casts convert
#    the raw bits);
#  * fp32/fp16/bf16 -> fp8 drops the mantissa carry and does not saturate (1.9375 -> 1.0,
#    31 -> 16, 500 -> 256 where e4m3fn saturates at 448).
# The interpreter keeps bf16 as uint16 and fp8 as uint8 numpy arrays inside TensorHandle; the shim
# reinterprets those bits as torch tensors and lets torch do the arithmetic, which rounds to
# nearest even like the GPU. It wraps three methods of InterpreterBuilder: cast_impl (behind
# create_fp_trunc / create_fp_ext / create_fp_to_si / ...), create_fp_to_fp (fp8 and custom
# rounding casts) and create_dot.
# ---------------------------------------------------------------------------------------------

_SHIMMED_METHODS = {
    "cast_impl": ("self", "src", "dst_type"),
    "create_fp_to_fp": ("self", "src", "dst_type", "rounding_mode"),
    "create_dot": ("self", "a", "b", "d", "input_precision", "max_num_imprecise_acc"),
}


def _shim_failure(what: str) -> RuntimeError:
    return RuntimeError(
        f"interpreter shim in tests/conftest.py: {what} (triton {triton.__version__}). The shim "
        f"was written against triton 3.7.1-3.9.0's triton/runtime/interpreter.py; update it to the "
        f"installed triton's InterpreterBuilder, or drop the patch that upstream has fixed.")


def _install_interpreter_shim() -> None:
    import inspect

    try:
        from triton.runtime import interpreter as interp
        builder_cls = interp.InterpreterBuilder
        TensorHandle = interp.TensorHandle
        rounding = interp._ir.ROUNDING_MODE
    except (ImportError, AttributeError) as exc:
        raise _shim_failure(f"interpreter internals missing: {exc}") from exc
    if getattr(builder_cls, "_gemmtune_shim", False):
        return
    originals = {}
    for name, params in _SHIMMED_METHODS.items():
        method = getattr(builder_cls, name, None)
        if not callable(method):
            raise _shim_failure(f"InterpreterBuilder.{name} is missing")
        got = tuple(inspect.signature(method).parameters)
        if got != params:
            raise _shim_failure(f"InterpreterBuilder.{name}{got} no longer has parameters {params}")
        originals[name] = method

    # tl dtype -> (torch dtype, torch dtype of the interpreter's numpy storage).
    to_torch = {
        tl.float16: (torch.float16, torch.float16),
        tl.bfloat16: (torch.bfloat16, torch.int16),  # stored as uint16 bits
        tl.float32: (torch.float32, torch.float32),
        tl.float64: (torch.float64, torch.float64),
        tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8),  # stored as uint8 bits
        tl.float8e5: (torch.float8_e5m2, torch.uint8),
        tl.int1: (torch.bool, torch.bool),
        tl.int8: (torch.int8, torch.int8),
        tl.uint8: (torch.uint8, torch.uint8),
        tl.int16: (torch.int16, torch.int16),
        tl.int32: (torch.int32, torch.int32),
        tl.int64: (torch.int64, torch.int64),
    }
    fp8 = (tl.float8e4nv, tl.float8e5)

    def as_torch(handle_data: np.ndarray, tl_dtype) -> torch.Tensor:
        value_dtype, storage_dtype = to_torch[tl_dtype]
        data = np.ascontiguousarray(handle_data)
        if storage_dtype == torch.int16:
            data = data.view(np.int16)
        return torch.from_numpy(data).view(value_dtype)

    def as_numpy(t: torch.Tensor, tl_dtype, np_dtype: np.dtype) -> np.ndarray:
        _, storage_dtype = to_torch[tl_dtype]
        return t.contiguous().view(storage_dtype).numpy().view(np_dtype)

    def torch_cast(src, dst_type):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        np_dtype = interp._get_np_dtype(dst_type)
        t = as_torch(src.data, src_ty)
        if dst_ty in fp8 and src_ty not in fp8:
            # The GPU converts with cvt.rn.satfinite: out-of-range values saturate to the largest
            # finite fp8 (±448 for e4m3fn), NaN stays NaN. torch alone would give NaN or inf.
            big = torch.finfo(to_torch[dst_ty][0]).max
            t = t.to(torch.float32).clamp(-big, big)
        out = t.to(to_torch[dst_ty][0])
        return TensorHandle(as_numpy(out, dst_ty, np_dtype).reshape(src.data.shape), dst_ty)

    def cast_impl(self, src, dst_type):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if tl.bfloat16 not in (src_ty, dst_ty) or src_ty == dst_ty:
            return originals["cast_impl"](self, src, dst_type)
        if src_ty not in to_torch or dst_ty not in to_torch:
            raise _shim_failure(f"cast {src_ty} -> {dst_ty} involves bf16 but is not shimmed")
        return torch_cast(src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if src_ty not in fp8 and dst_ty not in fp8:
            return originals["create_fp_to_fp"](self, src, dst_type, rounding_mode)
        if rounding_mode not in (None, rounding.RTNE):
            # torch only rounds to nearest even; other modes would silently differ from the GPU.
            raise _shim_failure(f"fp8 cast {src_ty} -> {dst_ty} with rounding {rounding_mode} "
                                f"is not shimmed")
        if src_ty not in to_torch or dst_ty not in to_torch:
            raise _shim_failure(f"fp8 cast {src_ty} -> {dst_ty} is not shimmed")
        return torch_cast(src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # bf16 -> fp32 is exact, so an fp32 matmul of the upcast operands is the bf16 dot the GPU
        # computes (fp32 products, fp32 accumulation).
        if a.dtype.scalar == tl.bfloat16:
            a = torch_cast(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = torch_cast(b, tl.float32)
        return originals["create_dot"](self, a, b, d, input_precision, max_num_imprecise_acc)

    builder_cls.cast_impl = cast_impl
    builder_cls.create_fp_to_fp = create_fp_to_fp
    builder_cls.create_dot = create_dot
    builder_cls._gemmtune_shim = True
    _check_interpreter_shim(interp)


def _check_interpreter_shim(interp) -> None:
    """Fail the session at once if the patched builder still gives the known wrong answers, e.g.
    because the interpreter stopped routing its casts through the wrapped methods."""
    b = interp.interpreter_builder
    H = interp.TensorHandle
    f32 = np.array([1.005859375, -3.0, 1e-40], dtype=np.float32)  # RNE -> 1.0078125; trunc -> 1.0
    bits = b.create_fp_trunc(H(f32, tl.float32), tl.bfloat16).data
    want = torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    if not np.array_equal(bits, want):
        raise _shim_failure(f"fp32 -> bf16 still wrong: bits {bits} != {want}")
    vals = np.array([1.9375, 31.0, 500.0, -500.0], dtype=np.float32)
    got = b.create_fp_to_fp(H(vals, tl.float32), tl.float8e4nv, interp._ir.ROUNDING_MODE.RTNE)
    back = torch.from_numpy(got.data).view(torch.float8_e4m3fn).float().numpy()
    if not np.array_equal(back, [2.0, 32.0, 448.0, -448.0]):
        raise _shim_failure(f"fp32 -> fp8e4nv still wrong: {vals} -> {back}")
    a = b.create_fp_trunc(H(np.full((2, 2), 1.5, np.float32), tl.float32), tl.bfloat16)
    acc = H(np.zeros((2, 2), np.float32), tl.float32)
    prod = b.create_dot(a, a, acc, None, None).data
    if not np.array_equal(prod, np.full((2, 2), 4.5, np.float32)):
        raise _shim_failure(f"bf16 tl.dot still wrong: 1.5-filled 2x2 squared gave {prod}")


if interpreter_active():
    _install_interpreter_shim()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Every test runs with a fresh cache folder, no GEMMTUNE_*/AITER_* variables and empty dispatch
# caches, so the user's own tables and captures can never leak into a result.
from _isolation import isolated_gemmtune, without_shipped_json  # noqa: E402,F401

"""The conftest shim corrects the Triton interpreter's wrong bf16 dot, bf16 rounding and fp8 casts.

Each test runs a tiny kernel that hits one known interpreter bug (triton 3.7.1-3.9.0) and compares
with torch bit for bit, or with an fp32 reference for the dot. Only meaningful in the interpreter.
"""

import pytest
import torch
import triton
import triton.language as tl

@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    idx = offs[:, None] * BLOCK + offs[None, :]
    c = tl.dot(tl.load(a_ptr + idx), tl.load(b_ptr + idx))
    tl.store(c_ptr + idx, c)


@triton.jit
def _cast_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(src_ptr + offs, mask=mask)
    tl.store(dst_ptr + offs, v.to(dst_ptr.dtype.element_ty), mask=mask)


# Under TRITON_INTERPRET=1 triton.jit gives an InterpretedFunction instead of a JITFunction.
pytestmark = pytest.mark.skipif(isinstance(_cast_kernel, triton.runtime.JITFunction),
                                reason="checks the CPU interpreter shim; real kernels run on CUDA")


def test_bf16_dot_matches_fp32_reference():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    b = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    c = torch.full((16, 16), float("nan"))
    _dot_kernel[(1,)](a, b, c, BLOCK=16)
    # bf16 products are exact in fp32; only the 16-term fp32 summation order differs.
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


def test_fp32_to_bf16_rounds_to_nearest_even():
    src = torch.tensor([
        1.005859375,  # 1 + 0.75 ulp: rounds up to 1.0078125, truncation gives 1.0
        1.00390625,  # exact tie 1 + 0.5 ulp: to even, 1.0
        1.01171875,  # exact tie 1 + 1.5 ulp: to even, 1.015625
        -2.9921875,  # negative, rounds away from zero in magnitude
        3.0e38,  # near the top of the range
        1e-40,  # fp32 subnormal
    ])
    dst = torch.zeros(src.numel(), dtype=torch.bfloat16)
    _cast_kernel[(1,)](src, dst, src.numel(), BLOCK=8)
    want = src.to(torch.bfloat16)
    assert torch.equal(dst.view(torch.int16), want.view(torch.int16)), (dst, want)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_to_fp8_e4m3fn_rounds_and_saturates(src_dtype):
    # 1.9375 -> 2 and 31 -> 32 need the mantissa carry; 500 saturates to 448 like cvt.satfinite.
    src = torch.tensor([1.9375, 31.0, 500.0, -500.0, 0.1, -0.0], dtype=src_dtype)
    dst = torch.zeros(src.numel(), dtype=torch.float8_e4m3fn)
    _cast_kernel[(1,)](src, dst, src.numel(), BLOCK=8)
    want = torch.tensor([2.0, 32.0, 448.0, -448.0, float(torch.tensor(0.1, dtype=src_dtype)
                                                        .to(torch.float8_e4m3fn)), -0.0])
    assert torch.equal(dst.float(), want), (dst.float(), want)
    assert torch.equal(dst.view(torch.uint8), want.to(torch.float8_e4m3fn).view(torch.uint8))


def test_fp8_to_fp32_is_exact():
    bits = torch.arange(0, 256, dtype=torch.uint8)
    bits = bits[(bits & 0x7F) != 0x7F]  # drop the two NaN encodings
    src = bits.view(torch.float8_e4m3fn)
    dst = torch.full((src.numel(),), float("nan"))
    _cast_kernel[(1,)](src, dst, src.numel(), BLOCK=256)
    assert torch.equal(dst, src.float())

"""gemm_a16w4: bf16 / fp16 activations times MXFP4 weights, dispatched through
a16w4_tuned_gemm.csv; every backend against the fp32 product with the dequantised weight."""

from __future__ import annotations

import pytest
import torch

import gemmtune
from gemm_checks import DEVICE, generator, install_user_table, randn
from gemmtune import quant
from gemmtune.dispatch import KernelNameError
from gemmtune.families.a16w4.op import DISPATCH, A16w4Key
from gemmtune.kernels.torch_ref import TORCH_DEQUANT_LINEAR, gemm_a16w4_ref
from gemmtune.tables.lookup import Rule

HEADER = "arch,cu_num,M,N,K,dtype,libtype,solidx,splitK,us,kernelName,err_ratio,tflops,bw\n"
W4 = "triton.w4:BM16.BN32.BK64.W4.S1"


@pytest.fixture
def a16w4_table(tmp_path, monkeypatch):
    def install(*rows: tuple) -> None:  # (M, N, K, dtype, kernelName)
        install_user_table(monkeypatch, tmp_path / "a16w4_user.csv", "GEMMTUNE_CONFIG_A16W4",
                           HEADER, rows)

    return install


def operands(M, N, K, dtype=torch.bfloat16, seed=0, with_bias=True):
    """x, and a weight whose blocks' scales differ along N and K, in MXFP4."""
    gen = generator(seed)
    x = randn(M, K, gen=gen).to(dtype)
    w = randn(N, K, gen=gen) * torch.logspace(-2, 1, K // 32, device=DEVICE).repeat_interleave(32)
    wq, ws = quant.mxfp4(w)
    bias = randn(N, gen=gen).to(dtype) if with_bias else None
    return x, wq, ws, bias


def assert_close_to_reference(y, x, wq, ws, bias):
    ref = gemm_a16w4_ref(x.reshape(-1, x.shape[-1]), wq, ws, bias).reshape(y.shape)
    assert not torch.isnan(y).any()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel  # the output's rounding: ~2e-3 in norm for bf16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_default_is_torch_and_matches_reference(dtype):
    x, wq, ws, bias = operands(7, 40, 96, dtype)
    y = gemmtune.gemm_a16w4(x.reshape(7, 1, 96), wq, ws, bias)
    assert y.dtype == dtype and y.shape == (7, 1, 40)
    assert_close_to_reference(y, x, wq, ws, bias)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.default
    assert plan.decision.kernel_name == TORCH_DEQUANT_LINEAR


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_table_row_picks_the_triton_kernel(a16w4_table, dtype):
    M, N, K = 5, 70, 160
    a16w4_table((M, N, K, str(dtype), W4))
    x, wq, ws, bias = operands(M, N, K, dtype, seed=1)
    for _ in range(2):  # the planned call, then the bound one
        y = gemmtune.gemm_a16w4(x, wq, ws, bias)
        assert y.dtype == dtype
        assert_close_to_reference(y, x, wq, ws, bias)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact and plan.decision.kernel_name == W4
    assert plan.decision.key == A16w4Key(M, N, K, str(dtype))


def test_named_kernel_without_bias_and_other_families_refuse_it():
    x, wq, ws, _ = operands(3, 40, 64, with_bias=False)
    y = gemmtune.gemm_a16w4(x, wq, ws, kernel=W4)
    assert_close_to_reference(y, x, wq, ws, None)
    with pytest.raises(KernelNameError, match="no backend"):
        gemmtune.gemm_a16w4(x, wq, ws, kernel="triton.splitk:BM16.BN32.BK64.SK1.W4.S2")
    with pytest.raises(KernelNameError, match="no backend"):
        gemmtune.gemm_a16w16(x, torch.randn(40, 64, dtype=torch.bfloat16, device=DEVICE),
                             kernel=W4)


def test_the_w4_kernel_refuses_problems_without_mxfp4_weights():
    from gemmtune.kernels.problem import GemmProblem, Scaling
    from gemmtune.kernels.triton.dispatchable import TritonKernel

    kernel = TritonKernel(W4)
    bf16 = torch.bfloat16
    assert kernel.check(GemmProblem(3, 40, 64, bf16, bf16, scaling=Scaling.mxfp4)) is None
    assert "MXFP4 weights only" in kernel.check(GemmProblem(3, 40, 64, bf16, bf16))
    assert "x's dtype" in kernel.check(GemmProblem(3, 40, 64, bf16, torch.float32,
                                                   scaling=Scaling.mxfp4))
    splitk = TritonKernel("triton.splitk:BM16.BN32.BK64.SK1.W4.S2")
    assert "does not take MXFP4" in splitk.check(GemmProblem(3, 40, 64, bf16, bf16,
                                                             scaling=Scaling.mxfp4))


@pytest.mark.parametrize("bad, says", [
    (lambda x, wq, ws, b: (x.float(), wq, ws, b), "bf16 or fp16"),
    (lambda x, wq, ws, b: (x, wq.to(torch.int8), ws, b), "must be uint8"),
    (lambda x, wq, ws, b: (x, wq[:, :-1], ws, b), "needs wq"),
    (lambda x, wq, ws, b: (x, wq, ws[:, :-1], b), "needs wq"),
    (lambda x, wq, ws, b: (x[:, :-32], wq, ws, b), "needs wq"),
    (lambda x, wq, ws, b: (x, wq, ws, b[:-1]), "bias has shape"),
])
def test_bad_operands_say_what_is_wrong(bad, says):
    with pytest.raises((TypeError, ValueError), match=says):
        gemmtune.gemm_a16w4(*bad(*operands(3, 40, 64)))


def test_under_torch_compile_it_is_one_custom_op():
    x, wq, ws, bias = operands(4, 40, 64)

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return gemmtune.gemm_a16w4(x, wq, ws, bias) * 2

    assert_close_to_reference(f(x) / 2, x, wq, ws, bias)
    fake = torch.ops.gemmtune.gemm_a16w4.default(x, wq, ws, bias)
    assert fake.shape == (4, 40) and fake.dtype == x.dtype


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 100])
def test_gpu_real_sizes_through_a_row(a16w4_table, M):
    N, K = 2880, 2880
    a16w4_table((M, N, K, "torch.bfloat16", "triton.w4:BM16.BN64.BK128.W4.S3"))
    x, wq, ws, bias = operands(M, N, K, seed=M)
    for _ in range(3):  # planned, bound, replayed
        y = gemmtune.gemm_a16w4(x, wq, ws, bias)
        assert_close_to_reference(y, x, wq, ws, bias)

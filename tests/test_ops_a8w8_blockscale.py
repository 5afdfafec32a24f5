"""gemm_a8w8_blockscale: FP8 with 1x128 / 128x128 block scales, dispatched through
a8w8_blockscale_tuned_gemm.csv; every backend against the dequantised fp32 reference."""

from __future__ import annotations

import pytest
import torch

import gemmtune
from gemm_checks import block_scaled_operands, install_user_table
from gemmtune.families.a8w8_blockscale.op import DISPATCH
from gemmtune.kernels.torch_ref import TORCH_BLOCKSCALE, gemm_a8w8_blockscale_ref
from gemmtune.tables.lookup import Rule

# A shape without a row runs torch here, even where shipped Triton JSON defaults would name
# a Triton kernel for it on a GPU (tests/test_triton_json.py tests those).
pytestmark = pytest.mark.usefixtures("without_shipped_json")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADER = "arch,cu_num,M,N,K,libtype,solidx,splitK,us,kernelName,err_ratio,tflops,bw\n"


@pytest.fixture
def blockscale_table(tmp_path, monkeypatch):
    def install(*rows: tuple) -> None:  # (M, N, K, kernelName)
        install_user_table(monkeypatch, tmp_path / "bs_user.csv",
                           "GEMMTUNE_CONFIG_A8W8_BLOCKSCALE", HEADER, rows)

    return install


def operands(M, N, K, seed=0):
    return block_scaled_operands(M, N, K, torch.Generator(device=DEVICE).manual_seed(seed))


def assert_close_to_reference(y, xq, wq, xs, ws):
    ref = gemm_a8w8_blockscale_ref(xq, wq, xs, ws, torch.float32)
    assert not torch.isnan(y).any()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel  # bf16 output rounding: ~2e-3 in norm


def test_default_is_torch_and_matches_reference():
    xq, wq, xs, ws = operands(33, 200, 300)
    y = gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws)
    assert y.dtype == torch.bfloat16 and y.shape == (33, 200)
    assert_close_to_reference(y, xq, wq, xs, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.default and plan.decision.kernel_name == TORCH_BLOCKSCALE


@pytest.mark.parametrize("kernel", ["triton.splitk:BM16.BN32.BK64.SK3.W4.S2",
                                    "triton.tile:BM16.BN32.BK128.G2.W4.S2"])
def test_table_row_picks_the_triton_kernel(blockscale_table, kernel):
    M, N, K = 13, 130, 384
    blockscale_table((M, N, K, kernel))
    xq, wq, xs, ws = operands(M, N, K, seed=1)
    y = gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws, dtype=torch.float32)
    assert_close_to_reference(y, xq, wq, xs, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact and plan.decision.kernel_name == kernel


def test_row_whose_block_k_spans_two_scale_blocks_falls_back(blockscale_table):
    blockscale_table((16, 64, 512, "triton.splitk:BM16.BN32.BK256.SK1.W4.S2"))
    xq, wq, xs, ws = operands(16, 64, 512)
    with pytest.warns(UserWarning, match="block_k=256 must divide 128"):
        y = gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws)
    assert_close_to_reference(y, xq, wq, xs, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.kernel_name == TORCH_BLOCKSCALE


def test_leading_dims():
    xq, wq, xs, ws = operands(6, 64, 256)
    y = gemmtune.gemm_a8w8_blockscale(xq.view(2, 3, 256), wq, xs.view(2, 3, 2), ws)
    assert y.shape == (2, 3, 64)
    assert_close_to_reference(y.view(6, 64), xq, wq, xs, ws)


def test_bad_arguments_say_what_to_do():
    xq, wq, xs, ws = operands(4, 64, 256)
    with pytest.raises(TypeError, match="per_block_fp8"):
        gemmtune.gemm_a8w8_blockscale(xq.float(), wq.float(), xs, ws)
    with pytest.raises(ValueError, match=r"x_scale must be a contiguous float32 \(4, 2\)"):
        gemmtune.gemm_a8w8_blockscale(xq, wq, xs[:, :1], ws)
    with pytest.raises(ValueError, match=r"w_scale must be a contiguous float32 \(1, 2\)"):
        gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws.t())
    with pytest.raises(ValueError, match="do not multiply"):
        gemmtune.gemm_a8w8_blockscale(xq, wq[:, :128], xs, ws)
    with pytest.raises(TypeError, match="not an output dtype"):
        gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws, dtype=torch.int8)


def test_custom_op_fake():
    # Only the fake check: opcheck's schema check multiplies the fp8 inputs themselves, which
    # torch's CPU kernels do not implement for float8 ("mul_cpu_reduced_float").
    xq, wq, xs, ws = operands(8, 128, 256)
    torch.library.opcheck(torch.ops.gemmtune.gemm_a8w8_blockscale.default,
                          (xq, wq, xs, ws, torch.bfloat16), test_utils=("test_faketensor",))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 64, 200, 1024])
@pytest.mark.parametrize("kernel", [None, "triton.splitk:BM16.BN32.BK128.SK4.W2.S4.P1",
                                    "triton.tile:BM64.BN128.BK128.G8.W4.S3"])
def test_gpu_real_sizes(blockscale_table, M, kernel):
    N, K = 1536, 7168
    # No row: an empty table replaces the shipped one (which has rows for this shape).
    blockscale_table(*([(M, N, K, kernel)] if kernel else []))
    xq, wq, xs, ws = operands(M, N, K, seed=M)
    y = gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws)
    assert_close_to_reference(y, xq, wq, xs, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.kernel_name == (kernel or TORCH_BLOCKSCALE)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(7168, 256), (7168, 2304), (576, 7168), (1536, 7168)])
def test_gpu_torch_backend_is_right_for_every_shape(blockscale_table, N, K):
    # cuBLAS block-wise where it takes the shape; K/128 = 2 and 18 (wrong numbers from cuBLAS,
    # no error) and N = 576 take the reference.
    from gemmtune.kernels.torch_ref import cublas_block_wise

    blockscale_table()
    for M in (1, 13, 64):
        xq, wq, xs, ws = operands(M, N, K, seed=M)
        assert_close_to_reference(gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws), xq, wq, xs, ws)
    assert cublas_block_wise(N, K) == ((N, K) == (1536, 7168))


@pytest.mark.gpu
def test_gpu_torch_rows_bound_call_serves_fresh_operands(blockscale_table):
    # From a key's second call on, 2-D x with M a multiple of 4 runs the torch row's bound
    # torch._scaled_mm; M = 13 (padded) and 3-D x go the plain way. Fresh operands every call.
    N, K = 1536, 7168
    blockscale_table((64, N, K, TORCH_BLOCKSCALE))  # an exact row: its bound call is kept bare
    for M, lead in ((64, None), (13, None), (8, 2)):
        for seed in range(3):
            xq, wq, xs, ws = operands(M * (lead or 1), N, K, seed=100 * M + seed)
            if lead:
                xq, xs = xq.view(lead, M, K), xs.view(lead, M, xs.shape[-1])
            y = gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws)
            assert y.shape == (*xq.shape[:-1], N)
            assert_close_to_reference(y, xq, wq, xs, ws)
    bound = [getattr(run, "__qualname__", "") for run in DISPATCH.calls.values()]
    assert sum("bind_blockscale" in name for name in bound) == 1, bound


def test_cublas_block_wise_rule():
    from gemmtune.kernels.torch_ref import cublas_block_wise

    assert cublas_block_wise(7168, 2048) and cublas_block_wise(1536, 7168)
    assert not cublas_block_wise(7168, 256) and not cublas_block_wise(7168, 2304)
    assert not cublas_block_wise(576, 7168)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(blockscale_table):
    M, N, K = 16, 576, 7168
    blockscale_table((M, N, K, "triton.splitk:BM16.BN32.BK128.SK4.W2.S4.P1"))
    xq, wq, xs, ws = operands(M, N, K)
    gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws)
    new_xq, _, new_xs, _ = operands(M, N, K, seed=5)
    xq.copy_(new_xq)
    xs.copy_(new_xs)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(y, xq, wq, xs, ws)


def test_a_cached_plan_still_refuses_column_major_scales():
    xq, wq, xs, ws = operands(13, 130, 384)
    gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws)
    with pytest.raises(ValueError, match="x_scale must be a contiguous float32"):
        gemmtune.gemm_a8w8_blockscale(xq, wq, xs.t().contiguous().t(), ws)


def test_a_kernel_forced_by_name():
    xq, wq, xs, ws = operands(13, 200, 300)
    kernel = "triton.splitk:BM16.BN32.BK64.SK2.W4.S2"
    y = gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws, kernel=kernel)
    assert_close_to_reference(y, xq, wq, xs, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.forced and plan.run.config.name == kernel
    # block_k must divide 128 with block scales; and this family has no persistent kernel.
    with pytest.raises(ValueError, match="cannot run this shape: block_k=256 must divide 128"):
        gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws,
                                      kernel="triton.splitk:BM16.BN32.BK256.SK1.W4.S2")
    with pytest.raises(ValueError, match="no backend for kernelName 'triton.persistent"):
        gemmtune.gemm_a8w8_blockscale(xq, wq, xs, ws,
                                      kernel="triton.persistent:BM64.BN64.BK64.G8.W4.S3")

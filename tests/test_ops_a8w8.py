"""gemm_a8w8: FP8/INT8 with per-tensor, per-token and per-channel scales, dispatched through
a8w8_tuned_gemm.csv; every backend against the dequantised fp32 reference."""

from __future__ import annotations

import pytest
import torch

import gemmtune
from gemm_checks import SCALE_LAYOUTS, install_user_table, quantised_operands
from gemmtune import quant
from gemmtune.families.a8w8.op import DISPATCH
from gemmtune.kernels.torch_ref import TORCH_SCALED_MM, gemm_a8w8_ref
from gemmtune.tables.lookup import Rule

# A shape without a row runs torch here, even where shipped Triton JSON defaults would name
# a Triton kernel for it on a GPU (tests/test_triton_json.py tests those).
pytestmark = pytest.mark.usefixtures("without_shipped_json")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADER = "arch,cu_num,M,N,K,q_dtype_w,libtype,solidx,splitK,us,kernelName,err_ratio,tflops,bw\n"
Q_DTYPES = [torch.float8_e4m3fn, torch.int8]
SPLITK = "triton.splitk:BM16.BN32.BK32.SK3.W4.S2"
TILE = "triton.tile:BM16.BN32.BK32.G2.W4.S2"
PERSISTENT = "triton.persistent:BM16.BN32.BK32.G2.W4.S2"


@pytest.fixture
def a8w8_table(tmp_path, monkeypatch):
    """Install a user a8w8 table (replacing the shipped one) with the given rows."""
    def install(*rows: tuple) -> None:  # (M, N, K, q_dtype_w, kernelName)
        install_user_table(monkeypatch, tmp_path / "a8w8_user.csv", "GEMMTUNE_CONFIG_A8W8",
                           HEADER, rows)

    return install


def operands(M, N, K, q_dtype, layout, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return quantised_operands(M, N, K, q_dtype, layout, gen)


def assert_close_to_reference(y, xq, wq, x_scale, w_scale, bias=None):
    ref = gemm_a8w8_ref(xq, wq, x_scale, w_scale, bias, torch.float32)
    assert not torch.isnan(y).any()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    # bf16 output rounding: 2^-9 relative per element, ~2e-3 in norm.
    assert rel < 1e-2, rel


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("layout", list(SCALE_LAYOUTS))
def test_default_is_torch_and_matches_reference(q_dtype, layout):
    M, N, K = 33, 48, 64
    xq, wq, xs, ws = operands(M, N, K, q_dtype, layout)
    bias = torch.randn(N, device=DEVICE)
    y = gemmtune.gemm_a8w8(xq, wq, xs, ws, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N)
    assert_close_to_reference(y, xq, wq, xs, ws, bias)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.default and plan.decision.kernel_name == TORCH_SCALED_MM


@pytest.mark.parametrize("kernel", [SPLITK, TILE, PERSISTENT])
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
def test_table_row_picks_the_triton_kernel(a8w8_table, kernel, q_dtype):
    M, N, K = 13, 40, 96
    q_name = "torch.float8_e4m3fn" if q_dtype == torch.float8_e4m3fn else "torch.int8"
    a8w8_table((M, N, K, q_name, kernel))
    xq, wq, xs, ws = operands(M, N, K, q_dtype, "token_channel", seed=1)
    y = gemmtune.gemm_a8w8(xq, wq, xs, ws, dtype=torch.float32)
    assert_close_to_reference(y, xq, wq, xs, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact and plan.decision.kernel_name == kernel


def test_leading_dims_and_scale_shapes():
    # x (B, S, K) with per-token scales (B, S, 1): the op flattens both alike.
    x = torch.randn(2, 3, 64, device=DEVICE)
    w = torch.randn(32, 64, device=DEVICE)
    xq, xs = quant.per_token_fp8(x)
    wq, ws = quant.per_channel_fp8(w)
    y = gemmtune.gemm_a8w8(xq, wq, xs, ws)
    assert y.shape == (2, 3, 32)
    assert_close_to_reference(y.reshape(6, 32), xq.reshape(6, 64), wq, xs, ws)


def test_row_for_a_too_large_config_falls_back(a8w8_table):
    # BK 256 with 8 stages needs more shared memory than a GPU has: the row is refused at plan
    # time with one warning, and torch runs the shape.
    a8w8_table((16, 32, 512, "torch.float8_e4m3fn", "triton.tile:BM128.BN256.BK256.G8.W4.S8"))
    xq, wq, xs, ws = operands(16, 32, 512, torch.float8_e4m3fn, "tensor")
    with pytest.warns(UserWarning, match="cannot run this shape"):
        y = gemmtune.gemm_a8w8(xq, wq, xs, ws)
    assert_close_to_reference(y, xq, wq, xs, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.kernel_name == TORCH_SCALED_MM


def test_bad_arguments_say_what_to_do():
    xq, wq, xs, ws = operands(4, 16, 32, torch.float8_e4m3fn, "token_channel")
    with pytest.raises(TypeError, match="quantise with gemmtune.quant"):
        gemmtune.gemm_a8w8(xq.float(), wq.float(), xs, ws)
    with pytest.raises(TypeError, match="quantise with gemmtune.quant"):
        gemmtune.gemm_a8w8(xq, wq.view(torch.int8), xs, ws)
    with pytest.raises(ValueError, match=r"x_scale must be .* 1 value \(per tensor\) or 4"):
        gemmtune.gemm_a8w8(xq, wq, torch.ones(3, device=DEVICE), ws)
    with pytest.raises(ValueError, match="w_scale must be contiguous float32"):
        gemmtune.gemm_a8w8(xq, wq, xs, ws.half())
    with pytest.raises(ValueError, match="do not multiply"):
        gemmtune.gemm_a8w8(xq, wq.t().contiguous(), xs, ws)
    with pytest.raises(TypeError, match="not an output dtype"):
        gemmtune.gemm_a8w8(xq, wq, xs, ws, dtype=torch.int8)
    with pytest.raises(ValueError, match="bias must be"):
        gemmtune.gemm_a8w8(xq, wq, xs, ws, bias=torch.ones(3, device=DEVICE))


def test_custom_op_fake_and_schema():
    xq, wq, xs, ws = operands(8, 16, 32, torch.int8, "token_channel")
    torch.library.opcheck(torch.ops.gemmtune.gemm_a8w8.default,
                          (xq, wq, xs, ws, None, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor"))


# --- GPU: real sizes, CUDA graphs --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", Q_DTYPES)
@pytest.mark.parametrize("M", [1, 16, 64, 200])
@pytest.mark.parametrize("kernel", [None, "triton.splitk:BM16.BN32.BK256.SK4.W2.S4.P1",
                                    "triton.tile:BM64.BN128.BK128.G8.W4.S3"])
def test_gpu_real_sizes(a8w8_table, q_dtype, M, kernel):
    N, K = 1536, 7168
    # No row: an empty table replaces the shipped one (which has rows for this shape).
    q_name = "torch.float8_e4m3fn" if q_dtype == torch.float8_e4m3fn else "torch.int8"
    a8w8_table(*([(M, N, K, q_name, kernel)] if kernel else []))
    for layout in SCALE_LAYOUTS:
        xq, wq, xs, ws = operands(M, N, K, q_dtype, layout, seed=M)
        bias = torch.randn(N, device=DEVICE, dtype=torch.bfloat16)
        y = gemmtune.gemm_a8w8(xq, wq, xs, ws, bias)
        assert_close_to_reference(y, xq, wq, xs, ws, bias)
    (plan, *_) = DISPATCH.plans.values()
    assert plan.decision.kernel_name == (kernel or TORCH_SCALED_MM)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", [None, "triton.splitk:BM16.BN32.BK256.SK4.W2.S4.P1"])
def test_gpu_cuda_graph_replay(a8w8_table, kernel):
    M, N, K = 16, 576, 7168
    a8w8_table(*([(M, N, K, "torch.float8_e4m3fn", kernel)] if kernel else []))
    xq, wq, xs, ws = operands(M, N, K, torch.float8_e4m3fn, "token_channel")
    gemmtune.gemm_a8w8(xq, wq, xs, ws)  # plan and compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemmtune.gemm_a8w8(xq, wq, xs, ws)
    new_xq, _, new_xs, _ = operands(M, N, K, torch.float8_e4m3fn, "token_channel", seed=5)
    xq.copy_(new_xq)
    xs.copy_(new_xs)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(y, xq, wq, xs, ws)


def test_a_cached_plan_still_refuses_what_the_checks_refuse():
    xq, wq, xs, ws = operands(4, 16, 32, torch.int8, "token_channel")
    gemmtune.gemm_a8w8(xq, wq, xs, ws, bias=torch.ones(16, device=DEVICE))
    with pytest.raises(ValueError, match="do not multiply"):
        gemmtune.gemm_a8w8(xq, wq.view(16, 1, 32), xs, ws)
    with pytest.raises(ValueError, match="bias must be"):
        gemmtune.gemm_a8w8(xq, wq, xs, ws, bias=torch.ones(16, 3, device=DEVICE))


@pytest.mark.parametrize("kernel", [TILE, TORCH_SCALED_MM])
def test_a_strided_scale_after_a_contiguous_one_is_refused_as_the_first_would_be(kernel):
    # A scale's contiguity is part of the call key: the same shapes with a strided scale are
    # checked, not served by the call bound for the contiguous one.
    xq, wq, xs, ws = operands(13, 40, 64, torch.float8_e4m3fn, "token_channel")
    xs = xs.reshape(13, 1)
    gemmtune.gemm_a8w8(xq, wq, xs, ws, kernel=kernel)
    wide = torch.full((13, 2), float("nan"), device=DEVICE)
    wide[:, :1] = xs
    with pytest.raises(ValueError, match="x_scale must be contiguous"):
        gemmtune.gemm_a8w8(xq, wq, wide[:, :1], ws, kernel=kernel)


@pytest.mark.parametrize("kernel", [TILE, "triton.splitk:BM16.BN32.BK32.SK2.W4.S2",
                                    TORCH_SCALED_MM])
def test_a_kernel_forced_by_name(kernel):
    xq, wq, xs, ws = operands(13, 40, 64, torch.float8_e4m3fn, "token_channel")
    y = gemmtune.gemm_a8w8(xq, wq, xs, ws, kernel=kernel)
    assert_close_to_reference(y, xq, wq, xs, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.forced and plan.decision.kernel_name == kernel
    with pytest.raises(ValueError, match="cannot run this shape: block_k=16"):
        gemmtune.gemm_a8w8(xq, wq, xs, ws, kernel="triton.tile:BM16.BN32.BK16.G2.W4.S2")

"""gemm_tile against an fp32 reference: ragged shapes, dtypes, bias, strides, configs, fp8 scales.

On CPU the kernel runs in Triton's interpreter (~0.1-1 s per launch), so grids stay small; the
``gpu``-marked tests run real sizes and CUDA-graph capture on the GPU machine.
"""

import pytest
import torch

from gemmtune.kernels.triton.gemm_tile import (
    KERNEL_PREFIX,
    TileConfig,
    default_config,
    fits,
    gemm_tile,
    why_not_fits,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Error bound: |y - ref| <= TOLERANCES[out_dtype] * |ref| + ACC_EPS * (K + 2) * mag, where
# mag = |x| @ |w|.T (times |scales|) + |bias|. Bounding by mag and not just |ref| is what makes it
# hold where cancellation makes |ref| small.
# fp32 accumulation: each of the K adds (plus the scale multiply and bias add) rounds by at most
# 2^-24 of the running magnitude, in the kernel and in the torch reference alike: 2 * 2^-24.
# Inputs need no term: the reference uses the very same rounded inputs, upcast exactly.
ACC_EPS = 2 * 2**-24
TOLERANCES = {
    # Round-to-nearest of the output: half an ulp = 2^-p relative for p significand bits.
    torch.float32: 2**-24,  # p = 24; the fp32 output is the accumulator itself
    torch.float16: 2**-11,  # p = 11
    torch.bfloat16: 2**-8,  # p = 8
}

RAGGED_SHAPES = [(1, 17, 33), (13, 65, 70), (67, 40, 129), (33, 96, 64)]  # (M, N, K)


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)


def _generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _poisoned(M, N, dtype):
    return torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)


def _check(y, x, w, bias=None, scale=1.0):
    """Every element written, and within the TOLERANCES bound of the fp32 reference."""
    assert not torch.isnan(y).any(), f"{int(torch.isnan(y).sum())} of {y.numel()} outputs unwritten"
    xf, wf = x.float(), w.float()
    ref = (xf @ wf.T) * scale
    mag = (xf.abs() @ wf.abs().T) * abs(scale)
    if bias is not None:
        ref = ref + bias.float()
        mag = mag + bias.float().abs()
    bound = TOLERANCES[y.dtype] * ref.abs() + ACC_EPS * (x.shape[1] + 2) * mag
    err = (y.float() - ref).abs()
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), (
        f"max excess at flat index {worst}: |y - ref| = {err.flatten()[worst]:.3g} > bound "
        f"{bound.flatten()[worst]:.3g} (ref {ref.flatten()[worst]:.4g}, y {y.flatten()[worst]:.4g})")


DTYPE_PAIRS = [  # (input dtype, output dtype)
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
]


@pytest.mark.parametrize("M,N,K", RAGGED_SHAPES)
@pytest.mark.parametrize("dtype,out_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_ragged_shapes_match_reference(M, N, K, dtype, out_dtype, with_bias):
    gen = _generator(M * 1000 + N + K)
    x, w = _randn(M, K, gen=gen, dtype=dtype), _randn(N, K, gen=gen, dtype=dtype)
    bias = _randn(N, gen=gen, dtype=dtype) if with_bias else None
    # A config smaller than the problem so that every shape has ragged edge tiles in M, N and K.
    config = TileConfig(16, 32, 32, 2, 4, 2)
    y = gemm_tile(x, w, bias=bias, out_dtype=out_dtype, config=config,
                  out=_poisoned(M, N, out_dtype))
    _check(y, x, w, bias)


def test_default_out_dtype_and_config():
    gen = _generator(1)
    x, w = _randn(13, 70, gen=gen, dtype=torch.bfloat16), _randn(65, 70, gen=gen,
                                                                 dtype=torch.bfloat16)
    y = gemm_tile(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (13, 65)
    _check(y, x, w)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])
def test_bias_of_another_dtype(bias_dtype):
    gen = _generator(2)
    x, w = _randn(33, 64, gen=gen, dtype=torch.bfloat16), _randn(96, 64, gen=gen,
                                                                 dtype=torch.bfloat16)
    bias = _randn(96, gen=gen, dtype=bias_dtype)
    y = gemm_tile(x, w, bias=bias, out=_poisoned(33, 96, torch.bfloat16))
    _check(y, x, w, bias)


def _layouts(M, N, K, dtype, gen):
    """x and w as transposed views and strided slices of larger tensors: no contiguous copies."""
    x_t = _randn(K, M, gen=gen, dtype=dtype).T  # strides (1, M)
    x_s = _randn(M, 2 * K + 3, gen=gen, dtype=dtype)[:, 1:2 * K + 1:2]  # strides (2K+3, 2)
    w_t = _randn(K, N, gen=gen, dtype=dtype).T  # strides (1, N)
    w_s = _randn(2 * N, K + 5, gen=gen, dtype=dtype)[::2, 3:K + 3]  # strides (2(K+5), 1)
    return {"x_t": x_t, "x_s": x_s}, {"w_t": w_t, "w_s": w_s}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("x_kind,w_kind", [("x_t", "w_s"), ("x_s", "w_t"), ("x_t", "w_t")])
def test_non_contiguous_inputs(dtype, x_kind, w_kind):
    M, N, K = 67, 40, 129
    xs, ws = _layouts(M, N, K, dtype, _generator(3))
    x, w = xs[x_kind], ws[w_kind]
    assert not x.is_contiguous() and not w.is_contiguous()
    y = gemm_tile(x, w, config=TileConfig(32, 32, 64, 2, 4, 2), out=_poisoned(M, N, dtype))
    _check(y, x, w)


def test_non_contiguous_output():
    gen = _generator(4)
    x, w = _randn(13, 70, gen=gen, dtype=torch.float16), _randn(65, 70, gen=gen,
                                                                dtype=torch.float16)
    out = torch.full((65, 13), float("nan"), dtype=torch.float16, device=DEVICE).T
    y = gemm_tile(x, w, config=TileConfig(16, 16, 32, 1, 1, 1), out=out)
    assert y.data_ptr() == out.data_ptr()
    _check(y, x, w)


@pytest.mark.parametrize("config", [
    TileConfig(16, 16, 16, 1, 1, 1),  # smallest tiles, no grouping: K in 9 steps, ragged 1
    TileConfig(16, 16, 16, 3, 2, 2),  # the last M group is short (5 M tiles = 3 + 2)
    TileConfig(32, 16, 128, 2, 4, 3),  # one full K tile and a ragged one
    TileConfig(128, 64, 256, 8, 8, 2),  # blocks larger than the whole problem
], ids=lambda c: c.name)
def test_configs_cover_ragged_edges(config):
    M, N, K = 67, 40, 129
    gen = _generator(5)
    x, w = _randn(M, K, gen=gen, dtype=torch.bfloat16), _randn(N, K, gen=gen,
                                                               dtype=torch.bfloat16)
    bias = _randn(N, gen=gen)
    y = gemm_tile(x, w, bias=bias, config=config, out=_poisoned(M, N, torch.bfloat16))
    _check(y, x, w, bias)


@pytest.mark.parametrize("M,N,K", [(13, 65, 70), (33, 96, 64)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_per_tensor_scaled(M, N, K, out_dtype):
    gen = _generator(6)
    x8 = (_randn(M, K, gen=gen) * 40).to(torch.float8_e4m3fn)
    w8 = (_randn(N, K, gen=gen) * 3).to(torch.float8_e4m3fn)
    scale_a = torch.tensor([0.37], device=DEVICE)
    scale_b = torch.tensor([1.9], device=DEVICE)
    bias = _randn(N, gen=gen, dtype=torch.bfloat16)
    y = gemm_tile(x8, w8, bias=bias, out_dtype=out_dtype, scale_a=scale_a, scale_b=scale_b,
                  config=TileConfig(16, 32, 32, 2, 4, 2), out=_poisoned(M, N, out_dtype))
    _check(y, x8, w8, bias, scale=0.37 * 1.9)


def test_fp8_defaults_to_bf16_output():
    gen = _generator(7)
    x8 = _randn(1, 33, gen=gen).to(torch.float8_e4m3fn)
    w8 = _randn(17, 33, gen=gen).to(torch.float8_e4m3fn)
    one = torch.ones(1, device=DEVICE)
    y = gemm_tile(x8, w8, scale_a=one, scale_b=one)
    assert y.dtype == torch.bfloat16
    _check(y, x8, w8)


def test_empty_k_gives_bias():
    gen = _generator(8)
    x = torch.empty(13, 0, dtype=torch.float16, device=DEVICE)
    w = torch.empty(17, 0, dtype=torch.float16, device=DEVICE)
    bias = _randn(17, gen=gen)
    y = gemm_tile(x, w, bias=bias, out=_poisoned(13, 17, torch.float16))
    assert torch.equal(y, bias.to(torch.float16).expand(13, 17))


def test_empty_m_returns_empty():
    x = torch.empty(0, 32, dtype=torch.bfloat16, device=DEVICE)
    w = torch.ones(16, 32, dtype=torch.bfloat16, device=DEVICE)
    assert gemm_tile(x, w).shape == (0, 16)


def test_deterministic():
    gen = _generator(9)
    x, w = _randn(67, 129, gen=gen, dtype=torch.bfloat16), _randn(40, 129, gen=gen,
                                                                  dtype=torch.bfloat16)
    config = TileConfig(32, 32, 32, 2, 4, 2)
    assert torch.equal(gemm_tile(x, w, config=config), gemm_tile(x, w, config=config))


# --- config space --------------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    TileConfig(64, 64, 32, 8, 4, 3),
    TileConfig(16, 256, 256, 1, 8, 1),
    default_config(4096, 4096, 4096, torch.bfloat16),
])
def test_name_round_trip(config):
    assert config.name.startswith(KERNEL_PREFIX + ":")
    assert TileConfig.from_name(config.name) == config


def test_name_format():
    assert TileConfig(64, 64, 32, 8, 4, 3).name == "triton.tile:BM64.BN64.BK32.G8.W4.S3"


@pytest.mark.parametrize("name,bad_part", [
    ("triton.tile:BM64.BN64.BK32.G8.W4", "5 dot-separated fields"),
    ("triton.persistent:BM64.BN64.BK32.G8.W4.S3", "'triton.persistent'"),
    ("BM64.BN64.BK32.G8.W4.S3", "prefix"),
    ("triton.tile:BM64.BNx.BK32.G8.W4.S3", "'BNx'"),
    ("triton.tile:BM64.BK32.BN64.G8.W4.S3", "'BK32'"),
    ("triton.tile:BM64.BN64.BK32.G8.W4.S-3", "'S-3'"),
])
def test_from_name_rejects_bad_names(name, bad_part):
    with pytest.raises(ValueError) as info:
        TileConfig.from_name(name)
    message = str(info.value)
    assert bad_part in message
    assert "triton.tile:BM<int>.BN<int>.BK<int>.G<int>.W<int>.S<int>" in message


@pytest.mark.parametrize("config,reason", [
    (TileConfig(48, 64, 32, 8, 4, 3), "block_m=48"),
    (TileConfig(64, 8, 32, 8, 4, 3), "block_n=8"),
    (TileConfig(64, 64, 512, 8, 4, 1), "block_k=512"),
    (TileConfig(64, 64, 32, 0, 4, 3), "group_m=0"),
    (TileConfig(64, 64, 32, 8, 3, 3), "num_warps=3"),
    (TileConfig(64, 64, 32, 8, 16, 3), "num_warps=16"),
    (TileConfig(64, 64, 32, 8, 4, 0), "num_stages=0"),
    (TileConfig(256, 256, 32, 8, 4, 2), "registers"),  # 512 accumulator registers per thread
    (TileConfig(128, 256, 128, 8, 8, 4), "shared memory"),  # 384 KiB of bf16 stages
])
def test_fits_rejects(config, reason):
    assert not fits(config, 4096, 4096, 4096, torch.bfloat16)
    assert reason in why_not_fits(config, 4096, 4096, 4096, torch.bfloat16)


def test_fits_depends_on_element_size():
    config = TileConfig(128, 128, 64, 8, 8, 4)  # 256 KiB in fp32, 128 KiB in bf16, 64 KiB in fp8
    assert not fits(config, 4096, 4096, 4096, torch.float32)
    assert fits(config, 4096, 4096, 4096, torch.bfloat16)
    assert fits(config, 4096, 4096, 4096, torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16,
                                   torch.float8_e4m3fn])
@pytest.mark.parametrize("M", [1, 13, 16, 32, 64, 65, 1000, 4096, 65536])
def test_default_config_fits(dtype, M):
    for N, K in [(4096, 4096), (576, 7168), (17, 33)]:
        assert fits(default_config(M, N, K, dtype), M, N, K, dtype)


def test_launcher_rejects_a_config_that_does_not_fit():
    x = torch.ones(16, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="num_warps=3"):
        gemm_tile(x, x, config=TileConfig(16, 16, 16, 1, 3, 1))


# --- argument validation -------------------------------------------------------------------


def test_rejects_bad_arguments():
    bf = dict(dtype=torch.bfloat16, device=DEVICE)
    x, w = torch.ones(4, 32, **bf), torch.ones(8, 32, **bf)
    with pytest.raises(ValueError, match="pass w, not w.T"):
        gemm_tile(x, torch.ones(32, 8, **bf))
    with pytest.raises(ValueError, match=r"expected x \(M, K\)"):
        gemm_tile(x[None], w)
    with pytest.raises(TypeError, match="share one dtype"):
        gemm_tile(x, w.half())
    with pytest.raises(TypeError, match="share one dtype"):
        gemm_tile(x.double(), w.double())
    with pytest.raises(TypeError, match="out_dtype"):
        gemm_tile(x, w, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="bias must be"):
        gemm_tile(x, w, bias=torch.ones(4, **bf))
    with pytest.raises(ValueError, match="out must be"):
        gemm_tile(x, w, out=torch.empty(8, 4, **bf))
    with pytest.raises(ValueError, match="both scale_a and scale_b"):
        gemm_tile(x, w, scale_a=torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match="one-element float32"):
        gemm_tile(x, w, scale_a=torch.ones(2, device=DEVICE), scale_b=torch.ones(1, device=DEVICE))
    x8 = x.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="need per-tensor scale_a and scale_b"):
        gemm_tile(x8, w.to(torch.float8_e4m3fn))


# --- GPU: real sizes and CUDA graphs -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 4096), (576, 7168)])
@pytest.mark.parametrize("M", [1, 16, 128, 1000, 4096])
def test_gpu_bf16_real_sizes(M, N, K):
    gen = _generator(M + N + K)
    x, w = _randn(M, K, gen=gen, dtype=torch.bfloat16), _randn(N, K, gen=gen,
                                                               dtype=torch.bfloat16)
    y = gemm_tile(x, w, out=_poisoned(M, N, torch.bfloat16))
    _check(y, x, w)
    # Also within twice torch's own bf16 error: both round one fp32 accumulator to bf16.
    ref = x.float() @ w.float().T
    torch_err = (torch.mm(x, w.T).float() - ref).abs().max()
    assert (y.float() - ref).abs().max() <= 2 * torch_err


@pytest.mark.gpu
@pytest.mark.parametrize("M", [16, 1000])
def test_gpu_fp8_real_size(M):
    N, K = 576, 7168
    gen = _generator(M)
    x8 = (_randn(M, K, gen=gen) * 40).to(torch.float8_e4m3fn)
    w8 = (_randn(N, K, gen=gen) * 3).to(torch.float8_e4m3fn)
    scale_a = torch.tensor([0.37], device=DEVICE)
    scale_b = torch.tensor([1.9], device=DEVICE)
    y = gemm_tile(x8, w8, scale_a=scale_a, scale_b=scale_b, out=_poisoned(M, N, torch.bfloat16))
    _check(y, x8, w8, scale=0.37 * 1.9)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_on_new_data():
    M, N, K = 64, 4096, 4096
    gen = _generator(10)
    static_x = _randn(M, K, gen=gen, dtype=torch.bfloat16)
    w = _randn(N, K, gen=gen, dtype=torch.bfloat16)
    bias = _randn(N, gen=gen, dtype=torch.bfloat16)
    # Compile and autotune-free warm-up outside the capture: capture must see only launches.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemm_tile(static_x, w, bias=bias)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = gemm_tile(static_x, w, bias=bias)
    for seed in (11, 12):
        new_x = _randn(M, K, gen=_generator(seed), dtype=torch.bfloat16)
        static_x.copy_(new_x)
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(static_y, new_x, w, bias)

"""gemm_splitk against an fp32 reference: ragged shapes, dtypes, bias, split counts, fp8 scales.

On CPU the kernel runs in Triton's interpreter, where every program is a Python call: grids stay
at a few dozen programs (tiles x splits). The ``gpu``-marked tests run decode sizes, many splits
racing for the same tile counter, and CUDA-graph capture on the GPU machine.
"""

import pytest
import torch

from gemmtune.kernels.triton.gemm_splitk import (
    KERNEL_PREFIX,
    SplitKConfig,
    candidates,
    default_config,
    fits,
    gemm_splitk,
    launch_gemm_splitk,
    num_tiles,
    why_not_fits,
    why_not_supported,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Error bound: |y - ref| <= TOLERANCES[out_dtype] * |ref| + ACC_EPS * (K + 2) * mag, where
# mag = |x| @ |w|.T (times |scales|) + |bias|. Bounding by mag and not just |ref| is what makes it
# hold where cancellation makes |ref| small.
# fp32 accumulation: a dot of length K takes K - 1 additions in any order, split or not (the split
# regroups them into per-split sums and a sum of partials; adding a zero partial is exact); each
# rounds by at most 2^-24 of the running magnitude, in the kernel and in the torch reference
# alike, plus the scale multiply and bias add: 2 * 2^-24 * (K + 2) * mag.
# Inputs need no term: the reference uses the very same rounded inputs, upcast exactly.
ACC_EPS = 2 * 2**-24
TOLERANCES = {
    # Round-to-nearest of the output: half an ulp = 2^-p relative for p significand bits.
    torch.float32: 2**-24,  # p = 24; the fp32 output is the accumulator itself
    torch.float16: 2**-11,  # p = 11
    torch.bfloat16: 2**-8,  # p = 8
}

# (M, N, K): M 1, 13 and 33 (one ragged M tile, two), N ragged against every BN, and K a multiple
# of neither BK nor BK * split_k, so the last K step of the last split is partial.
RAGGED_SHAPES = [(1, 17, 161), (13, 65, 200), (33, 40, 129)]
# Small tiles so that the ragged shapes have several tiles and splits: 3-9 programs.
SMALL = SplitKConfig(16, 32, 32, 3, 4, 2)


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
        f"{bound.flatten()[worst]:.3g} (ref {ref.flatten()[worst]:.4g}, "
        f"y {y.flatten()[worst]:.4g})")


DTYPE_PAIRS = [  # (input dtype, output dtype)
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
]


@pytest.mark.parametrize("M,N,K", RAGGED_SHAPES)
@pytest.mark.parametrize("dtype,out_dtype", DTYPE_PAIRS)
def test_ragged_shapes_match_reference(M, N, K, dtype, out_dtype):
    gen = _generator(M * 1000 + N + K)
    x, w = _randn(M, K, gen=gen, dtype=dtype), _randn(N, K, gen=gen, dtype=dtype)
    bias = _randn(N, gen=gen, dtype=dtype) if M != 1 else None  # M = 1 runs without bias
    y = gemm_splitk(x, w, bias=bias, out_dtype=out_dtype, config=SMALL,
                    out=_poisoned(M, N, out_dtype))
    _check(y, x, w, bias)


@pytest.mark.parametrize("split_k", [1, 2, 4, 7, 9])
def test_split_counts(split_k):
    # K = 129 in BK = 16 steps is 9 steps, the last of 1 element: splits of 4+5, 2+2+2+3, ...,
    # one step each at 9.
    M, N, K = 33, 40, 129
    gen = _generator(20 + split_k)
    x, w = _randn(M, K, gen=gen, dtype=torch.bfloat16), _randn(N, K, gen=gen,
                                                               dtype=torch.bfloat16)
    bias = _randn(N, gen=gen)
    config = SplitKConfig(32, 32, 16, split_k, 4, 2)
    y = gemm_splitk(x, w, bias=bias, config=config, out=_poisoned(M, N, torch.bfloat16))
    _check(y, x, w, bias)


def test_empty_splits_add_nothing():
    # fits() rejects split_k above the number of K steps, but the kernel stays right without it:
    # 12 splits of 5 steps leave 7 splits empty, whose zero partials must still count in.
    M, N, K = 13, 40, 70
    config = SplitKConfig(16, 32, 16, 12, 4, 2)
    assert "split_k=12" in why_not_fits(config, M, N, K, torch.float32)
    gen = _generator(21)
    x, w = _randn(M, K, gen=gen), _randn(N, K, gen=gen)
    out = _poisoned(M, N, torch.float32)
    launch_gemm_splitk(x, w, None, out, None, None, config)
    _check(out, x, w)


def test_default_out_dtype_and_config():
    gen = _generator(1)
    x, w = _randn(13, 70, gen=gen, dtype=torch.bfloat16), _randn(65, 70, gen=gen,
                                                                 dtype=torch.bfloat16)
    y = gemm_splitk(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (13, 65)
    _check(y, x, w)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.float16])
def test_bias_of_another_dtype(bias_dtype):
    gen = _generator(2)
    x, w = _randn(13, 100, gen=gen, dtype=torch.bfloat16), _randn(40, 100, gen=gen,
                                                                  dtype=torch.bfloat16)
    bias = _randn(40, gen=gen, dtype=bias_dtype)
    y = gemm_splitk(x, w, bias=bias, config=SMALL, out=_poisoned(13, 40, torch.bfloat16))
    _check(y, x, w, bias)


@pytest.mark.parametrize("x_kind,w_kind", [("x_t", "w_s"), ("x_s", "w_t")])
def test_non_contiguous_inputs(x_kind, w_kind):
    M, N, K = 13, 40, 129
    gen = _generator(3)
    xs = {"x_t": _randn(K, M, gen=gen, dtype=torch.bfloat16).T,  # strides (1, M)
          "x_s": _randn(M, 2 * K + 3, gen=gen, dtype=torch.bfloat16)[:, 1:2 * K + 1:2]}
    ws = {"w_t": _randn(K, N, gen=gen, dtype=torch.bfloat16).T,  # strides (1, N)
          "w_s": _randn(2 * N, K + 5, gen=gen, dtype=torch.bfloat16)[::2, 3:K + 3]}
    x, w = xs[x_kind], ws[w_kind]
    assert not x.is_contiguous() and not w.is_contiguous()
    y = gemm_splitk(x, w, config=SplitKConfig(16, 32, 32, 2, 4, 2),
                    out=_poisoned(M, N, torch.bfloat16))
    _check(y, x, w)


def test_non_contiguous_output():
    gen = _generator(4)
    x, w = _randn(13, 70, gen=gen, dtype=torch.float16), _randn(65, 70, gen=gen,
                                                                dtype=torch.float16)
    out = torch.full((65, 13), float("nan"), dtype=torch.float16, device=DEVICE).T
    y = gemm_splitk(x, w, config=SplitKConfig(16, 32, 32, 2, 2, 2), out=out)
    assert y.data_ptr() == out.data_ptr()
    _check(y, x, w)


@pytest.mark.parametrize("M,N,K,split_k", [(13, 65, 200, 3), (1, 40, 129, 2)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_per_tensor_scaled(M, N, K, split_k, out_dtype):
    gen = _generator(6)
    x8 = (_randn(M, K, gen=gen) * 40).to(torch.float8_e4m3fn)
    w8 = (_randn(N, K, gen=gen) * 3).to(torch.float8_e4m3fn)
    scale_a = torch.tensor([0.37], device=DEVICE)
    scale_b = torch.tensor([1.9], device=DEVICE)
    bias = _randn(N, gen=gen, dtype=torch.bfloat16)
    y = gemm_splitk(x8, w8, bias=bias, out_dtype=out_dtype, scale_a=scale_a, scale_b=scale_b,
                    config=SplitKConfig(16, 32, 32, split_k, 4, 2), out=_poisoned(M, N, out_dtype))
    _check(y, x8, w8, bias, scale=0.37 * 1.9)


def test_fp8_defaults_to_bf16_output():
    gen = _generator(7)
    x8 = _randn(1, 33, gen=gen).to(torch.float8_e4m3fn)
    w8 = _randn(17, 33, gen=gen).to(torch.float8_e4m3fn)
    one = torch.ones(1, device=DEVICE)
    y = gemm_splitk(x8, w8, scale_a=one, scale_b=one)
    assert y.dtype == torch.bfloat16
    _check(y, x8, w8)


def test_empty_k_gives_bias():
    gen = _generator(8)
    x = torch.empty(13, 0, dtype=torch.float16, device=DEVICE)
    w = torch.empty(17, 0, dtype=torch.float16, device=DEVICE)
    bias = _randn(17, gen=gen)
    y = gemm_splitk(x, w, bias=bias, out=_poisoned(13, 17, torch.float16))
    assert torch.equal(y, bias.to(torch.float16).expand(13, 17))


def test_empty_m_returns_empty():
    x = torch.empty(0, 32, dtype=torch.bfloat16, device=DEVICE)
    w = torch.ones(16, 32, dtype=torch.bfloat16, device=DEVICE)
    assert gemm_splitk(x, w).shape == (0, 16)


def test_deterministic():
    gen = _generator(9)
    x, w = _randn(33, 129, gen=gen, dtype=torch.bfloat16), _randn(40, 129, gen=gen,
                                                                  dtype=torch.bfloat16)
    config = SplitKConfig(32, 32, 16, 4, 4, 2)
    assert torch.equal(gemm_splitk(x, w, config=config), gemm_splitk(x, w, config=config))


def test_caller_owned_counters_are_left_zero():
    M, N, K = 13, 65, 200
    config = SMALL
    counters = torch.zeros(num_tiles(config, M, N), dtype=torch.int32, device=DEVICE)
    for seed in (10, 11):  # the second launch relies on the first leaving the counters zero
        gen = _generator(seed)
        x, w = _randn(M, K, gen=gen), _randn(N, K, gen=gen)
        out = _poisoned(M, N, torch.float32)
        launch_gemm_splitk(x, w, None, out, None, None, config, counters=counters)
        _check(out, x, w)
        assert not counters.any()


# --- config space --------------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    SplitKConfig(16, 64, 256, 8, 4, 3),
    SplitKConfig(64, 128, 64, 16, 8, 5),
    default_config(1, 576, 7168, torch.bfloat16),
])
def test_name_round_trip(config):
    assert config.name.startswith(KERNEL_PREFIX + ":")
    assert SplitKConfig.from_name(config.name) == config


def test_name_format():
    assert SplitKConfig(16, 64, 256, 8, 4, 3).name == "triton.splitk:BM16.BN64.BK256.SK8.W4.S3"


@pytest.mark.parametrize("name,bad_part", [
    ("triton.splitk:BM16.BN64.BK256.SK8.W4", "5 dot-separated fields"),
    ("triton.tile:BM16.BN64.BK256.SK8.W4.S3", "'triton.tile'"),
    ("BM16.BN64.BK256.SK8.W4.S3", "prefix"),
    ("triton.splitk:BM16.BN64.BK256.G8.W4.S3", "'G8'"),
    ("triton.splitk:BM16.BN64.BK256.SKx.W4.S3", "'SKx'"),
    ("triton.splitk:BM16.BN64.BK256.SK-2.W4.S3", "'SK-2'"),
])
def test_from_name_rejects_bad_names(name, bad_part):
    with pytest.raises(ValueError) as info:
        SplitKConfig.from_name(name)
    message = str(info.value)
    assert bad_part in message
    assert "triton.splitk:BM<int>.BN<int>.BK<int>.SK<int>.W<int>.S<int>" in message


@pytest.mark.parametrize("config,reason", [
    (SplitKConfig(48, 64, 64, 2, 4, 3), "block_m=48"),
    (SplitKConfig(16, 8, 64, 2, 4, 3), "block_n=8"),
    (SplitKConfig(16, 64, 512, 2, 4, 3), "block_k=512"),
    (SplitKConfig(16, 64, 64, 0, 4, 3), "split_k=0"),
    (SplitKConfig(16, 64, 64, 65, 4, 3), "split_k=65"),
    (SplitKConfig(16, 64, 256, 17, 4, 3), "split_k <= 16"),  # 4096 / 256 = 16 steps
    (SplitKConfig(16, 64, 64, 2, 3, 3), "num_warps=3"),
    (SplitKConfig(16, 64, 64, 2, 4, 0), "num_stages=0"),
    (SplitKConfig(256, 256, 64, 2, 4, 2), "registers"),  # 512 accumulator registers per thread
    (SplitKConfig(64, 256, 256, 2, 8, 4), "shared memory"),  # 640 KiB of bf16 stages
])
def test_fits_rejects(config, reason):
    assert not fits(config, 64, 4096, 4096, torch.bfloat16)
    assert reason in why_not_fits(config, 64, 4096, 4096, torch.bfloat16)


def test_fits_split_bound_is_k_rounded_up():
    # K = 1000 is 4 steps of 256 (the last partial): 4 splits fit, 5 do not.
    assert fits(SplitKConfig(16, 64, 256, 4, 4, 2), 1, 576, 1000, torch.bfloat16)
    assert not fits(SplitKConfig(16, 64, 256, 5, 4, 2), 1, 576, 1000, torch.bfloat16)
    # K = 0 still takes one (empty) split.
    assert fits(SplitKConfig(16, 64, 256, 1, 4, 2), 1, 576, 0, torch.bfloat16)


def test_why_not_supported_rejects_dtypes():
    config = SplitKConfig(16, 64, 64, 2, 4, 3)
    assert "input dtype" in why_not_supported(config, 1, 64, 128, torch.float64, torch.bfloat16)
    assert "output dtype" in why_not_supported(config, 1, 64, 128, torch.bfloat16, torch.int8)
    assert why_not_supported(config, 1, 64, 128, torch.float8_e4m3fn, torch.bfloat16) is None


DECODE_SHAPES = [(576, 7168), (1536, 7168), (4096, 4096), (6144, 4096), (28672, 4096),
                 (4096, 14336), (1280, 8192), (8192, 1024), (7168, 2048)]  # (N, K)
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_candidates_fit_and_stay_few(dtype):
    for N, K in DECODE_SHAPES + [(17, 33), (65, 4096)]:
        for M in (1, 13, 16, 32, 33, 64, 200, 4096):
            found = candidates(M, N, K, dtype)
            assert 0 < len(found) <= 150, (M, N, K, dtype, len(found))
            assert len(set(found)) == len(found)
            bad = [(c.name, why_not_fits(c, M, N, K, dtype)) for c in found
                   if not fits(c, M, N, K, dtype)]
            assert not bad, bad


def test_candidates_split_where_tiles_are_few():
    # 576 columns are 9-18 tiles: every candidate must split K to reach the SMs.
    assert all(c.split_k > 1 for c in candidates(1, 576, 7168, torch.bfloat16))
    # 28672 columns are 224-896 tiles: no split is needed and none is left out.
    assert any(c.split_k == 1 for c in candidates(16, 28672, 4096, torch.bfloat16))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("M", [1, 13, 16, 32, 64, 65, 1000, 65536])
def test_default_config_fits(dtype, M):
    for N, K in DECODE_SHAPES + [(17, 33), (33, 0), (65, 16)]:
        assert fits(default_config(M, N, K, dtype), M, N, K, dtype)


def test_launcher_rejects_a_config_that_does_not_fit():
    x = torch.ones(16, 32, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="num_warps=3"):
        gemm_splitk(x, x, config=SplitKConfig(16, 16, 16, 1, 3, 1))
    with pytest.raises(ValueError, match="split_k=4 leaves splits"):
        gemm_splitk(x, x, config=SplitKConfig(16, 16, 16, 4, 4, 1))  # K = 32 is 2 steps


# --- argument validation -------------------------------------------------------------------


def test_rejects_bad_arguments():
    bf = dict(dtype=torch.bfloat16, device=DEVICE)
    x, w = torch.ones(4, 32, **bf), torch.ones(8, 32, **bf)
    with pytest.raises(ValueError, match="pass w, not w.T"):
        gemm_splitk(x, torch.ones(32, 8, **bf))
    with pytest.raises(ValueError, match=r"expected x \(M, K\)"):
        gemm_splitk(x[None], w)
    with pytest.raises(TypeError, match="share one dtype"):
        gemm_splitk(x, w.half())
    with pytest.raises(TypeError, match="share one dtype"):
        gemm_splitk(x.double(), w.double())
    with pytest.raises(TypeError, match="out_dtype"):
        gemm_splitk(x, w, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="bias must be"):
        gemm_splitk(x, w, bias=torch.ones(4, **bf))
    with pytest.raises(ValueError, match="out must be"):
        gemm_splitk(x, w, out=torch.empty(8, 4, **bf))
    with pytest.raises(ValueError, match="both scale_a and scale_b"):
        gemm_splitk(x, w, scale_a=torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match="one-element float32"):
        gemm_splitk(x, w, scale_a=torch.ones(2, device=DEVICE),
                    scale_b=torch.ones(1, device=DEVICE))
    x8 = x.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="need per-tensor scale_a and scale_b"):
        gemm_splitk(x8, w.to(torch.float8_e4m3fn))


# --- GPU: decode sizes, racing splits and CUDA graphs ----------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(576, 7168), (4096, 4096), (8192, 1024), (28672, 4096)])
@pytest.mark.parametrize("M", [1, 16, 33, 64])
def test_gpu_bf16_decode_sizes(M, N, K):
    gen = _generator(M + N + K)
    x, w = _randn(M, K, gen=gen, dtype=torch.bfloat16), _randn(N, K, gen=gen,
                                                               dtype=torch.bfloat16)
    ref = x.float() @ w.float().T
    # Also within twice torch's own bf16 error: both round one fp32 accumulator to bf16.
    torch_err = (torch.mm(x, w.T).float() - ref).abs().max()
    config = default_config(M, N, K, torch.bfloat16)
    for cfg in {config, SplitKConfig(config.block_m, 64, 128, 1, 4, 3),
                SplitKConfig(config.block_m, 32, 64, 16, 4, 4)}:
        y = gemm_splitk(x, w, config=cfg, out=_poisoned(M, N, torch.bfloat16))
        _check(y, x, w)
        assert (y.float() - ref).abs().max() <= 2 * torch_err, cfg.name


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64])
def test_gpu_fp8_decode_size(M):
    N, K = 576, 7168
    gen = _generator(M)
    x8 = (_randn(M, K, gen=gen) * 40).to(torch.float8_e4m3fn)
    w8 = (_randn(N, K, gen=gen) * 3).to(torch.float8_e4m3fn)
    scale_a = torch.tensor([0.37], device=DEVICE)
    scale_b = torch.tensor([1.9], device=DEVICE)
    bias = _randn(N, gen=gen, dtype=torch.bfloat16)
    y = gemm_splitk(x8, w8, bias=bias, scale_a=scale_a, scale_b=scale_b,
                    out=_poisoned(M, N, torch.bfloat16))
    _check(y, x8, w8, bias, scale=0.37 * 1.9)


@pytest.mark.gpu
def test_gpu_splits_race_deterministically():
    # 16 splits of 18 tiles finish in whatever order the SMs give; the last of each tile must
    # still see every partial (a missing barrier or acquire shows up as a changing result), and
    # sums them in split order, so every run is bitwise the same.
    M, N, K = 16, 576, 7168
    gen = _generator(30)
    x, w = _randn(M, K, gen=gen, dtype=torch.bfloat16), _randn(N, K, gen=gen,
                                                               dtype=torch.bfloat16)
    config = SplitKConfig(16, 32, 256, 16, 4, 3)
    counters = torch.zeros(num_tiles(config, M, N), dtype=torch.int32, device=DEVICE)
    first = gemm_splitk(x, w, config=config)
    _check(first, x, w)
    for _ in range(50):
        out = _poisoned(M, N, torch.bfloat16)
        launch_gemm_splitk(x, w, None, out, None, None, config, counters=counters)
        assert torch.equal(out, first)
    assert not counters.any()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 64])
def test_gpu_cuda_graph_replay_on_new_data(M):
    N, K = 1536, 7168
    gen = _generator(10)
    static_x = _randn(M, K, gen=gen, dtype=torch.bfloat16)
    w = _randn(N, K, gen=gen, dtype=torch.bfloat16)
    bias = _randn(N, gen=gen, dtype=torch.bfloat16)
    assert default_config(M, N, K, torch.bfloat16).split_k > 1  # the workspace path is captured
    # Compile outside the capture: capture must see only allocations and launches.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemm_splitk(static_x, w, bias=bias)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = gemm_splitk(static_x, w, bias=bias)
    for seed in (11, 12):
        new_x = _randn(M, K, gen=_generator(seed), dtype=torch.bfloat16)
        static_x.copy_(new_x)
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(static_y, new_x, w, bias)

"""What the GEMM kernel tests share: the fp32 reference check with its tolerance table, seeded
input makers, NaN-poisoned outputs, and the checks every validating launcher (``gemm_tile``,
``gemm_splitk``) must pass the same way. Imported by the test files as ``from gemm_checks import``.

The checks below the primitives take the launcher, ``launch(x, w, bias=, out_dtype=, scale_a=,
scale_b=, config=, out=)``, and assert; ``LAUNCHER_CHECKS`` are those that need nothing else, which
each launcher's test file runs as one parametrized test.
"""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from gemmtune import quant
from gemmtune.kernels.torch_ref import scaled_mm_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Error bound: |y - ref| <= TOLERANCES[out_dtype] * |ref| + ACC_EPS * (K + 2) * mag, where
# mag = |x| @ |w|.T (times |scales|) + |bias|. Bounding by mag and not just |ref| is what makes it
# hold where cancellation makes |ref| small.
# fp32 accumulation: a dot of length K takes K - 1 additions in any order, split over K or not
# (split-K regroups them into per-split sums and a sum of partials; adding a zero partial is
# exact); each rounds by at most 2^-24 of the running magnitude, in the kernel and in the torch
# reference alike, plus the scale multiply and bias add: 2 * 2^-24 * (K + 2) * mag.
# Inputs need no term: the reference uses the very same rounded inputs, upcast exactly.
ACC_EPS = 2 * 2**-24
TOLERANCES = {
    # Round-to-nearest of the output: half an ulp = 2^-p relative for p significand bits.
    torch.float32: 2**-24,  # p = 24; the fp32 output is the accumulator itself
    torch.float16: 2**-11,  # p = 11
    torch.bfloat16: 2**-8,  # p = 8
}

DTYPE_PAIRS = [  # (input dtype, output dtype)
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
]

# Per-tensor scales of the fp8 tests, and their product, which the reference multiplies by.
SCALE_A, SCALE_B = 0.37, 1.9
FP8_SCALE = SCALE_A * SCALE_B


# Gluon kernels run on a Hopper only
on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="Gluon kernel for Hopper (sm_90)")


def mxfp4_default_kernel(M, N, K, x_dtype, packed, torch_name):
    """The kernelName an MXFP4 family runs a shape without a row with: on a Hopper, for bf16 or
    MXFP4 (uint8) x, triton.w4frag's default config up to M = 128, above it triton.w4deq's PTX
    one (BN8.BK512.W4), in the weight's layout; else ``torch_name``, the family's torch
    backend for the layout."""
    from gemmtune.kernels.triton._checks import interpreted
    from gemmtune.kernels.triton.gemm_w4frag import MAX_M, W4FragConfig, default_config

    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    if not hopper or interpreted() or x_dtype not in (torch.bfloat16, torch.uint8):
        return torch_name
    if M > MAX_M:
        return f"triton.w4deq:BN8.BK512.W4.L{int(packed)}.A1"
    c = default_config(M, N, K, x_dtype)
    return W4FragConfig(c.block_m, c.block_k, c.split_k, packed=int(packed)).name


def mxfp4_weight_operands(M, N, K, gen, with_bias, dtype=torch.bfloat16):
    """x (M, K) and a bias (N,) or None in ``dtype``, and an MXFP4 weight (codes, scales) whose
    rows' blocks differ in magnitude along K, so the blocks' scales differ along N and K."""
    x = randn(M, K, gen=gen).to(dtype)
    w = randn(N, K, gen=gen) * torch.logspace(-3, 1, K // 32, device=DEVICE).repeat_interleave(32)
    wq, w_scale = quant.mxfp4(w)
    bias = randn(N, gen=gen).to(dtype) if with_bias else None
    return x, wq, w_scale, bias


def with_nan_scales(w_scale, nan_rows, large_byte):
    """A copy of ``w_scale`` whose rows ``nan_rows`` ({row: block}) have the NaN byte 255 in
    that block, row 40 the smallest byte (0) and row 41 ``large_byte`` on every block."""
    w_scale = w_scale.clone()
    w_scale[40:42, :] = large_byte
    w_scale[40, :] = 0
    for row, block in nan_rows.items():
        w_scale[row, block] = 255
    return w_scale


def assert_only_nan_rows_are_nan(y, nan_rows, x, wq, w_scale):
    """Outputs of w's rows ``nan_rows`` all NaN, every other one right."""
    nan = torch.zeros(y.shape[1], dtype=torch.bool, device=DEVICE)
    nan[list(nan_rows)] = True
    assert y[:, nan].isnan().all()
    assert_matches_reference(y[:, ~nan], x, quant.dequant_mxfp4(wq, w_scale)[~nan])


def mxfp4_weight_kernel_matches_reference(gemm, M, N, K, config, with_bias, packed):
    """GPU: ``gemm(x, stored_w, w_scale, bias, config, out=)`` (an MXFP4-weight kernel's
    validating launcher, w stored as quantised or ``packed``) into a NaN-poisoned output,
    twice (a split's sums and counters are left as they were found), against the fp32
    product with the dequantised weight."""
    x, wq, w_scale, bias = mxfp4_weight_operands(M, N, K, generator(M * 1000 + N + K),
                                                 with_bias)
    stored = quant.prepack_mxfp4(wq, w_scale)[0] if packed else wq
    out = poisoned(M, N, torch.bfloat16)
    for _ in range(2):
        y = gemm(x, stored, w_scale, bias, config, out=out)
        assert y.data_ptr() == out.data_ptr()
        assert_matches_reference(y, x, quant.dequant_mxfp4(wq, w_scale), bias)


def mxfp4_x_kernel_matches_reference(launch_only, M, N, K, config, out_dtype, packed):
    """GPU: ``launch_only(xq, stored_w, None, out, x_scale, w_scale, config)`` with x MXFP4
    too (gemm_a4w4_blockscale's; its blocks' scales spread over 4 decades) into a
    NaN-poisoned output of ``out_dtype``, twice, against the fp32 product of the two
    dequantised operands."""
    x, wq, w_scale, _ = mxfp4_weight_operands(M, N, K, generator(M * 7 + N + K), False)
    xq, x_scale = quant.mxfp4(x.float() * torch.logspace(
        -2, 2, K // 32, device=DEVICE).repeat_interleave(32))
    stored = quant.prepack_mxfp4(wq, w_scale)[0] if packed else wq
    out = poisoned(M, N, out_dtype)
    for _ in range(2):
        launch_only(xq, stored, None, out, x_scale, w_scale, config)
        assert_matches_reference(out, quant.dequant_mxfp4(xq, x_scale),
                                 quant.dequant_mxfp4(wq, w_scale))


def mxfp4_x_at_large_scales(launch_only, config, packed, x_byte=240, w_byte=90):
    """GPU: MXFP4 x at scale byte ``x_byte`` (|x| to 6 x 2^113 at 240) times w at a small one
    (``w_byte``): the outputs finite and right against the dequantised reference, also where
    x's values are scaled before the MMA and a block's sums meet w's scale only after it."""
    M, N, K = 5, 70, 256
    gen = generator(11)
    xq, _ = quant.mxfp4(randn(M, K, gen=gen))
    wq, _ = quant.mxfp4(randn(N, K, gen=gen))
    x_scale = torch.full((M, K // 32), x_byte, dtype=torch.uint8, device=DEVICE)
    w_scale = torch.full((N, K // 32), w_byte, dtype=torch.uint8, device=DEVICE)
    stored = quant.prepack_mxfp4(wq, w_scale)[0] if packed else wq
    out = poisoned(M, N, torch.float32)
    launch_only(xq, stored, None, out, x_scale, w_scale, config)
    assert_matches_reference(out, quant.dequant_mxfp4(xq, x_scale),
                             quant.dequant_mxfp4(wq, w_scale))


def mxfp4_every_code_at_every_scale_byte(gemm, config, K, packed, scaled_before_mma):
    """GPU: row n of w has scale byte n (0-255) on all its blocks and the 16 codes over and
    over, each block's codes shifted by its index; x is the identity, so y is w dequantised,
    rounded once to bf16: equal to the reference bit for bit, 2^-127's multiples and the NaN
    row (byte 255) included. ``scaled_before_mma``: a kernel that scales w's values in bf16
    before the MMA makes a value past bf16's range (bytes 253-254) infinite there, and its sums
    with x's zeros make the row NaN (as in the fp32 reference's matmul); else they stay
    infinite."""
    codes = (torch.arange(K, device=DEVICE) + torch.arange(K, device=DEVICE) // 32) % 16
    wq = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).repeat(256, 1)
    w_scale = torch.arange(256, device=DEVICE).to(torch.uint8)[:, None].repeat(1, K // 32)
    x = torch.eye(K, dtype=torch.bfloat16, device=DEVICE)
    stored = quant.prepack_mxfp4(wq, w_scale)[0] if packed else wq
    y = gemm(x, stored, w_scale, None, config)
    want = quant.dequant_mxfp4(wq, w_scale).T.to(torch.bfloat16)
    if scaled_before_mma:
        want[:, want.isinf().any(0)] = torch.nan
    torch.testing.assert_close(y, want, rtol=0, atol=0, equal_nan=True)


def mxfp4_every_x_code_at_every_x_scale_byte(launch_only, config, packed, scaled_before_mma):
    """GPU: w the identity (code 1.0, scale 2^0): y is x dequantised, bit for bit, for every
    code of x at every scale byte of x (a launch per 32 rows of bytes; the NaN row, byte 255,
    included). ``scaled_before_mma``: x past bf16's range (bytes 253-254) is infinite before
    the MMA, whose sums with w's zeros make its row NaN (as in the fp32 reference's matmul)."""
    K = 128
    eye = torch.eye(K, device=DEVICE, dtype=torch.uint8) * 2  # code 2 is 1.0
    wq = (eye[:, 0::2] | (eye[:, 1::2] << 4)).contiguous()
    w_scale = torch.full((K, K // 32), 127, dtype=torch.uint8, device=DEVICE)
    if packed:
        wq = quant.prepack_mxfp4(wq, w_scale)[0]
    codes = (torch.arange(K, device=DEVICE) + torch.arange(K, device=DEVICE) // 32) % 16
    for first in range(0, 256, 32):
        xq = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).repeat(32, 1)
        x_scale = torch.arange(first, first + 32, device=DEVICE).to(torch.uint8)[:, None] \
            .repeat(1, K // 32)
        out = torch.empty(32, K, dtype=torch.float32, device=DEVICE)
        launch_only(xq, wq, None, out, x_scale, w_scale, config)
        expected = quant.dequant_mxfp4(xq, x_scale)
        if scaled_before_mma:
            expected[expected.isinf().any(1)] = torch.nan
        torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


def generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)


def poisoned(M, N, dtype):
    """An (M, N) output full of NaN: any element the kernel does not write shows up."""
    return torch.full((M, N), float("nan"), dtype=dtype, device=DEVICE)


def fp8_operands(M, N, K, gen):
    """e4m3fn x and w spread over the format's range (|x| up to ~160, |w| up to ~12) and the
    one-element fp32 scales ``SCALE_A``, ``SCALE_B``: ``(x8, w8, scale_a, scale_b)``."""
    x8 = (randn(M, K, gen=gen) * 40).to(torch.float8_e4m3fn)
    w8 = (randn(N, K, gen=gen) * 3).to(torch.float8_e4m3fn)
    scale_a = torch.tensor([SCALE_A], device=DEVICE)
    scale_b = torch.tensor([SCALE_B], device=DEVICE)
    return x8, w8, scale_a, scale_b


def layouts(M, N, K, dtype, gen):
    """x and w as transposed views and strided slices of larger tensors: no contiguous copies."""
    x_t = randn(K, M, gen=gen, dtype=dtype).T  # strides (1, M)
    x_s = randn(M, 2 * K + 3, gen=gen, dtype=dtype)[:, 1:2 * K + 1:2]  # strides (2K+3, 2)
    w_t = randn(K, N, gen=gen, dtype=dtype).T  # strides (1, N)
    w_s = randn(2 * N, K + 5, gen=gen, dtype=dtype)[::2, 3:K + 3]  # strides (2(K+5), 1)
    return {"x_t": x_t, "x_s": x_s}, {"w_t": w_t, "w_s": w_s}


def assert_matches_reference(y, x, w, bias=None, scale=1.0, allowance=0.0):
    """Every element written, and within the TOLERANCES bound of the fp32 reference. ``scale``
    multiplies x @ w.T: a number, or a tensor that broadcasts to (M, N) (row and column scales
    of quantised operands). ``allowance``: more error allowed, a number or a tensor that
    broadcasts to (M, N) (a sum less precise than fp32's)."""
    assert not torch.isnan(y).any(), f"{int(torch.isnan(y).sum())} of {y.numel()} outputs unwritten"
    xf, wf = x.float(), w.float()
    ref = (xf @ wf.T) * scale
    mag = (xf.abs() @ wf.abs().T) * (scale.abs() if torch.is_tensor(scale) else abs(scale))
    if bias is not None:
        ref = ref + bias.float()
        mag = mag + bias.float().abs()
    bound = TOLERANCES[y.dtype] * ref.abs() + ACC_EPS * (x.shape[1] + 2) * mag + allowance
    err = (y.float() - ref).abs()
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), (
        f"max excess at flat index {worst}: |y - ref| = {err.flatten()[worst]:.3g} > bound "
        f"{bound.flatten()[worst]:.3g} (ref {ref.flatten()[worst]:.4g}, "
        f"y {y.flatten()[worst]:.4g})")


def assert_within_torch_error(y, x, w, what=""):
    """Also within twice torch's own bf16 error: both round one fp32 accumulator to bf16."""
    ref = x.float() @ w.float().T
    torch_err = (torch.mm(x, w.T).float() - ref).abs().max()
    assert (y.float() - ref).abs().max() <= 2 * torch_err, what


def name_round_trip(config, prefix):
    assert config.name.startswith(prefix + ":")
    assert type(config).from_name(config.name) == config


def assert_bad_name(parse, name, says, form):
    """``parse(name)`` raises ValueError saying what is wrong (``says``) and the accepted form."""
    with pytest.raises(ValueError) as info:
        parse(name)
    message = str(info.value)
    assert says in message
    assert form in message


# --- checks every validating launcher passes ------------------------------------------------


def default_out_dtype_and_config(launch, K=70):
    gen = generator(1)
    x, w = randn(13, K, gen=gen, dtype=torch.bfloat16), randn(65, K, gen=gen,
                                                              dtype=torch.bfloat16)
    y = launch(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (13, 65)
    assert_matches_reference(y, x, w)


def ragged_shape(launch, M, N, K, dtype, out_dtype, with_bias, config):
    gen = generator(M * 1000 + N + K)
    x, w = randn(M, K, gen=gen, dtype=dtype), randn(N, K, gen=gen, dtype=dtype)
    bias = randn(N, gen=gen, dtype=dtype) if with_bias else None
    y = launch(x, w, bias=bias, out_dtype=out_dtype, config=config,
               out=poisoned(M, N, out_dtype))
    assert_matches_reference(y, x, w, bias)


def non_contiguous_inputs(launch, M, N, K, dtype, x_kind, w_kind, config):
    xs, ws = layouts(M, N, K, dtype, generator(3))
    x, w = xs[x_kind], ws[w_kind]
    assert not x.is_contiguous() and not w.is_contiguous()
    y = launch(x, w, config=config, out=poisoned(M, N, dtype))
    assert_matches_reference(y, x, w)


def configs_cover_ragged_edges(launch, config, K=129):
    M, N = 67, 40
    gen = generator(5)
    x, w = randn(M, K, gen=gen, dtype=torch.bfloat16), randn(N, K, gen=gen,
                                                             dtype=torch.bfloat16)
    bias = randn(N, gen=gen)
    y = launch(x, w, bias=bias, config=config, out=poisoned(M, N, torch.bfloat16))
    assert_matches_reference(y, x, w, bias)


def non_contiguous_output(launch, config, K=70):
    gen = generator(4)
    x, w = randn(13, K, gen=gen, dtype=torch.float16), randn(65, K, gen=gen,
                                                             dtype=torch.float16)
    out = torch.full((65, 13), float("nan"), dtype=torch.float16, device=DEVICE).T
    y = launch(x, w, config=config, out=out)
    assert y.data_ptr() == out.data_ptr()
    assert_matches_reference(y, x, w)


def fp8_per_tensor_scaled(launch, M, N, K, out_dtype, config):
    gen = generator(6)
    x8, w8, scale_a, scale_b = fp8_operands(M, N, K, gen)
    bias = randn(N, gen=gen, dtype=torch.bfloat16)
    y = launch(x8, w8, bias=bias, out_dtype=out_dtype, scale_a=scale_a, scale_b=scale_b,
               config=config, out=poisoned(M, N, out_dtype))
    assert_matches_reference(y, x8, w8, bias, scale=FP8_SCALE)


# How the activation and weight scales of a quantised GEMM are laid out: per tensor, per token
# (a value per row of x) and per channel (a value per row of w).
SCALE_LAYOUTS = {
    "tensor": (quant.per_tensor_fp8, quant.per_tensor_fp8, quant.per_tensor_int8,
               quant.per_tensor_int8),
    "token_channel": (quant.per_token_fp8, quant.per_channel_fp8, quant.per_token_int8,
                      quant.per_channel_int8),
    "token_tensor": (quant.per_token_fp8, quant.per_tensor_fp8, quant.per_token_int8,
                     quant.per_tensor_int8),
}


def quantised_operands(M, N, K, q_dtype, layout, gen):
    """x and w drawn in fp32, quantised with ``gemmtune.quant`` as ``layout`` says:
    ``(xq, wq, x_scale, w_scale)`` with the scales flattened as the kernels take them."""
    qx_fp8, qw_fp8, qx_int8, qw_int8 = SCALE_LAYOUTS[layout]
    qx, qw = (qx_fp8, qw_fp8) if q_dtype == torch.float8_e4m3fn else (qx_int8, qw_int8)
    xq, x_scale = qx(randn(M, K, gen=gen) * 3)
    wq, w_scale = qw(randn(N, K, gen=gen) / K ** 0.5)
    return xq, wq, x_scale.reshape(-1), w_scale.reshape(-1)


def quantised_scaled(launch, M, N, K, q_dtype, layout, out_dtype, config, with_bias=True):
    gen = generator(M * 7 + N)
    xq, wq, x_scale, w_scale = quantised_operands(M, N, K, q_dtype, layout, gen)
    bias = randn(N, gen=gen, dtype=torch.bfloat16) if with_bias else None
    y = launch(xq, wq, bias=bias, out_dtype=out_dtype, scale_a=x_scale, scale_b=w_scale,
               config=config, out=poisoned(M, N, out_dtype))
    scale = x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    assert_matches_reference(y, xq, wq, bias, scale=scale)


def fast_accumulated_scaled(launch, M, N, K, layout, out_dtype, config):
    """GPU: FP8 products summed in the tensor cores (Hopper keeps ~13 bits of the running sum,
    truncated), so the fp32 bound of ``assert_matches_reference`` does not hold. cuBLAS with fast
    accumulation on the same operands (unit scales, fp32 out, scaled exactly afterwards) shows
    what that sum costs here. Every element within the reference's bound plus twice cuBLAS's
    worst error in its row, and the error's norm within 1.5x cuBLAS's plus the output's
    rounding: a dropped or doubled K step is ~100x cuBLAS's error."""
    gen = generator(M * 7 + N)
    xq, wq, x_scale, w_scale = quantised_operands(M, N, K, torch.float8_e4m3fn, layout, gen)
    bias = randn(N, gen=gen, dtype=torch.bfloat16)
    y = launch(xq, wq, bias=bias, out_dtype=out_dtype, scale_a=x_scale, scale_b=w_scale,
               config=config, out=poisoned(M, N, out_dtype))
    scale = x_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)
    exact = xq.double() @ wq.double().T
    one = torch.tensor(1.0, device=DEVICE)
    unit = torch._scaled_mm(xq, wq.T, scale_a=one, scale_b=one, out_dtype=torch.float32,
                            use_fast_accum=True)
    theirs = (unit.double() - exact) * scale
    assert_matches_reference(y, xq, wq, bias, scale=scale.float(),
                             allowance=2 * theirs.abs().amax(dim=1, keepdim=True).float())
    ref = exact * scale + bias.double()
    ours, cublas = float((y.double() - ref).norm()), float(theirs.norm())
    assert ours <= 1.5 * cublas + TOLERANCES[out_dtype] * float(ref.norm()), (
        f"error norm {ours:.3g} vs cuBLAS fast accumulation's {cublas:.3g}")


def block_scaled_operands(M, N, K, gen):
    """FP8 x and w with DeepSeek-style block scales: ``(xq, wq, x_scale (M, ceil(K/128)),
    w_scale (ceil(N/128), ceil(K/128)))``; magnitudes vary by token and along K, so every block
    has its own scale."""
    x = randn(M, K, gen=gen) * (1 + 4 * torch.rand(M, 1, generator=gen, device=DEVICE)) \
        * (1 + torch.rand(1, K, generator=gen, device=DEVICE))
    xq, x_scale = quant.per_block_fp8(x, quant.ACT_BLOCK)
    wq, w_scale = quant.per_block_fp8(randn(N, K, gen=gen) / K ** 0.5, quant.WEIGHT_BLOCK)
    return xq, wq, x_scale, w_scale


def block_scaled(launch, M, N, K, config):
    gen = generator(M + 3 * N + K)
    xq, wq, x_scale, w_scale = block_scaled_operands(M, N, K, gen)
    y = launch(xq, wq, scale_a=x_scale, scale_b=w_scale, config=config, block_scales=True,
               out=poisoned(M, N, torch.bfloat16))
    x_deq = quant.dequant_per_block(xq, x_scale, quant.ACT_BLOCK)
    w_deq = quant.dequant_per_block(wq, w_scale, quant.WEIGHT_BLOCK)
    assert_matches_reference(y, x_deq, w_deq)


def promoted_fp8(launch, config, M=13, N=65, K=300):
    """An FP8 config with ``promote_k`` > 0 matches the reference at ragged sizes, per-token x
    and per-channel w with bias (the interpreter computes every dot in fp32, so there this checks
    the plumbing; ``promoted_accumulation_is_precise`` checks the precision on the GPU)."""
    assert config.promote_k > 0
    quantised_scaled(launch, M, N, K, torch.float8_e4m3fn, "token_channel", torch.bfloat16,
                     config)


def promote_k_refusals(launch, config, block_scales=True):
    """``promote_k`` needs FP8 inputs, a multiple of 32 that divides block_k, and no block
    scales (``block_scales``: the launcher takes them): each launch that breaks one says which,
    and what to use."""
    assert config.promote_k > 0 and config.block_k % 64 == 0
    gen = generator(4)
    x, w = randn(16, 256, gen=gen, dtype=torch.bfloat16), randn(64, 256, gen=gen,
                                                                dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="applies to float8_e4m3fn inputs only"):
        launch(x, w, config=config)
    xq, wq, x_scale, w_scale = quantised_operands(16, 64, 256, torch.int8, "token_channel", gen)
    with pytest.raises(ValueError, match="applies to float8_e4m3fn inputs only"):
        launch(xq, wq, scale_a=x_scale, scale_b=w_scale, config=config)
    xq, wq, x_scale, w_scale = quantised_operands(16, 64, 256, torch.float8_e4m3fn,
                                                  "token_channel", gen)
    for bad in (48, -32, 2 * config.block_k):
        with pytest.raises(ValueError, match=f"promote_k={bad} must be a multiple of 32 that "
                                             f"divides block_k={config.block_k}"):
            launch(xq, wq, scale_a=x_scale, scale_b=w_scale,
                   config=dataclasses.replace(config, promote_k=bad))
    small = dataclasses.replace(config, block_m=32)
    with pytest.raises(ValueError, match="applies to wgmma dots only"):
        launch(xq, wq, scale_a=x_scale, scale_b=w_scale, config=small)
    if not block_scales:
        return
    xq, wq, x_scale, w_scale = block_scaled_operands(16, 64, 256, gen)
    blocked = dataclasses.replace(config, block_k=64, promote_k=64)
    with pytest.raises(ValueError, match="promote_k must be 0 with block scales"):
        launch(xq, wq, scale_a=x_scale, scale_b=w_scale, config=blocked, block_scales=True)


def promote_k_reaches_the_dot(launch_only, config):
    """The launch-only function (no config checks) hands ``promote_k`` to tl.dot as
    ``max_num_imprecise_acc``: Triton itself refuses a value above the dot's K, which is how this
    shows on the CPU too, where the interpreter computes every dot exactly."""
    assert config.promote_k > config.block_k
    gen = generator(5)
    xq, wq, x_scale, w_scale = quantised_operands(64, 64, 256, torch.float8_e4m3fn,
                                                  "token_channel", gen)
    out = poisoned(64, 64, torch.bfloat16)
    with pytest.raises(Exception, match=rf"max_num_imprecise_acc \({config.promote_k}\) must "
                                        rf"be <= K \({config.block_k}\)"):
        launch_only(xq, wq, None, out, x_scale, w_scale, config)


def promoted_accumulation_is_precise(launch, config, M, N, K):
    """GPU: Hopper's FP8 tensor cores accumulate with reduced precision. Over a long K that error
    shows next to cuBLAS without fast accumulation (torch._scaled_mm's default); promoting every
    ``promote_k`` removes it. fp32 outputs, so no output rounding hides the accumulation."""
    assert config.promote_k == 0
    gen = generator(K)
    xq, wq, x_scale, w_scale = quantised_operands(M, N, K, torch.float8_e4m3fn,
                                                  "token_channel", gen)
    scale = x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    ref = (xq.double() @ wq.double().T) * scale.double()

    def rel_err(y):
        return float((y.double() - ref).norm() / ref.norm())

    cublas = rel_err(scaled_mm_torch(xq, wq, None, torch.float32, x_scale, w_scale))
    errors = {}
    for promote_k in (0, min(config.block_k, 128)):
        y = launch(xq, wq, scale_a=x_scale, scale_b=w_scale, out_dtype=torch.float32,
                   config=dataclasses.replace(config, promote_k=promote_k),
                   out=poisoned(M, N, torch.float32))
        errors[promote_k] = rel_err(y)
    fast, promoted = errors.values()
    assert promoted <= 1.5 * cublas + 1e-7, f"promoted {promoted:.2e} vs cuBLAS {cublas:.2e}"
    assert promoted < fast, f"promoted {promoted:.2e} vs fast {fast:.2e} (cuBLAS {cublas:.2e})"


def block_scales_refusals(launch, config_with_block_k_256):
    """A block-scaled launch refuses block_k not dividing 128, a transposed w_scale and non-FP8
    inputs, each with what to do; without a config the default takes a block_k that divides 128."""
    gen = generator(2)
    xq, wq, x_scale, w_scale = block_scaled_operands(16, 64, 512, gen)
    with pytest.raises(ValueError, match="block_k=256 must divide 128"):
        launch(xq, wq, scale_a=x_scale, scale_b=w_scale, config=config_with_block_k_256,
               block_scales=True)
    with pytest.raises(ValueError, match=r"w_scale must be a contiguous float32 \(1, 4\)"):
        launch(xq, wq, scale_a=x_scale, scale_b=w_scale.t(), block_scales=True)
    with pytest.raises(TypeError, match="block scales need float8_e4m3fn"):
        launch(xq.float(), wq.float(), scale_a=x_scale, scale_b=w_scale, block_scales=True)
    y = launch(xq, wq, scale_a=x_scale, scale_b=w_scale, block_scales=True)
    assert y.shape == (16, 64) and not torch.isnan(y).any()


def install_user_table(monkeypatch, path, env_var: str, header: str, rows) -> None:
    """Write ``rows`` (key columns..., kernelName) for the current GPU under ``header`` and make
    that file replace the family's shipped table (``env_var``)."""
    import gemmtune

    dev = gemmtune.current_device()
    path.write_text(header + "".join(
        ",".join([dev.arch, str(dev.cu_num), *map(str, row[:-1])]) + f",x,0,0,1.0,{row[-1]},0,0,0\n"
        for row in rows))
    monkeypatch.setenv(env_var, f"replace:{path}")
    gemmtune.reset()


def fp8_defaults_to_bf16_output(launch, K=33):
    gen = generator(7)
    x8 = randn(1, K, gen=gen).to(torch.float8_e4m3fn)
    w8 = randn(17, K, gen=gen).to(torch.float8_e4m3fn)
    one = torch.ones(1, device=DEVICE)
    y = launch(x8, w8, scale_a=one, scale_b=one)
    assert y.dtype == torch.bfloat16
    assert_matches_reference(y, x8, w8)


def empty_k_gives_bias(launch):
    gen = generator(8)
    x = torch.empty(13, 0, dtype=torch.float16, device=DEVICE)
    w = torch.empty(17, 0, dtype=torch.float16, device=DEVICE)
    bias = randn(17, gen=gen)
    y = launch(x, w, bias=bias, out=poisoned(13, 17, torch.float16))
    assert torch.equal(y, bias.to(torch.float16).expand(13, 17))


def empty_m_returns_empty(launch):
    x = torch.empty(0, 32, dtype=torch.bfloat16, device=DEVICE)
    w = torch.ones(16, 32, dtype=torch.bfloat16, device=DEVICE)
    assert launch(x, w).shape == (0, 16)


def deterministic(launch, M, N, K, config):
    gen = generator(9)
    x, w = randn(M, K, gen=gen, dtype=torch.bfloat16), randn(N, K, gen=gen, dtype=torch.bfloat16)
    assert torch.equal(launch(x, w, config=config), launch(x, w, config=config))


def rejects_bad_arguments(launch):
    bf = dict(dtype=torch.bfloat16, device=DEVICE)
    x, w = torch.ones(4, 32, **bf), torch.ones(8, 32, **bf)
    with pytest.raises(ValueError, match="pass w, not w.T"):
        launch(x, torch.ones(32, 8, **bf))
    with pytest.raises(ValueError, match=r"expected x \(M, K\)"):
        launch(x[None], w)
    with pytest.raises(TypeError, match="share one dtype"):
        launch(x, w.half())
    with pytest.raises(TypeError, match="share one dtype"):
        launch(x.double(), w.double())
    with pytest.raises(TypeError, match="out_dtype"):
        launch(x, w, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="bias must be"):
        launch(x, w, bias=torch.ones(4, **bf))
    with pytest.raises(ValueError, match="out must be"):
        launch(x, w, out=torch.empty(8, 4, **bf))
    with pytest.raises(ValueError, match="both scale_a and scale_b"):
        launch(x, w, scale_a=torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match=r"one float32 value \(per tensor\) or 4 contiguous"):
        launch(x, w, scale_a=torch.ones(2, device=DEVICE), scale_b=torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match="or 8 contiguous ones \\(one per row of w\\)"):
        launch(x, w, scale_a=torch.ones(1, device=DEVICE),
               scale_b=torch.ones(16, device=DEVICE)[::2])
    x8 = x.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="need scale_a and scale_b"):
        launch(x8, w.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="need scale_a and scale_b"):
        launch(x.to(torch.int8), w.to(torch.int8))


def cuda_graph_replay_on_new_data(launch, M, N, K):
    """Capture one call with bias, then replay it on new x: the output must follow (GPU only)."""
    gen = generator(10)
    static_x = randn(M, K, gen=gen, dtype=torch.bfloat16)
    w = randn(N, K, gen=gen, dtype=torch.bfloat16)
    bias = randn(N, gen=gen, dtype=torch.bfloat16)
    # Compile outside the capture: capture must see only allocations and launches.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(static_x, w, bias=bias)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = launch(static_x, w, bias=bias)
    for seed in (11, 12):
        new_x = randn(M, K, gen=generator(seed), dtype=torch.bfloat16)
        static_x.copy_(new_x)
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(static_y, new_x, w, bias)


def splits_race_deterministically(launch, launch_only, config, tiles, M, N, K, runs=50):
    """GPU: the splits of each tile finish in whatever order the SMs give; the last of each must
    still see every partial (a missing barrier or acquire shows up as a changing result), and
    sums them in split order, so every run is bitwise the same and leaves its ``tiles``
    counters zero."""
    gen = generator(30)
    x, w = randn(M, K, gen=gen, dtype=torch.bfloat16), randn(N, K, gen=gen,
                                                             dtype=torch.bfloat16)
    counters = torch.zeros(tiles, dtype=torch.int32, device=DEVICE)
    first = launch(x, w, config=config)
    assert_matches_reference(first, x, w)
    for _ in range(runs):
        out = poisoned(M, N, torch.bfloat16)
        launch_only(x, w, None, out, None, None, config, counters=counters)
        assert torch.equal(out, first)
    assert not counters.any()


def bf16_weight(K, gen):
    """A bf16 (K, K) weight for ``pdl_chain_reads_its_input_after_the_producer``: (what the
    kernel takes, its scale (None), ``check(y, x, scale_a)`` of an output against it)."""
    w = randn(K, K, gen=gen, dtype=torch.bfloat16)
    return w, None, lambda y, x, scale_a: assert_matches_reference(y, x, w)


def pdl_chain_reads_its_input_after_the_producer(launch_only, config, M, K, graph, seed,
                                                links=12, weight=bf16_weight, between=None):
    """GPU: each GEMM's x (and x's scales) is made by the kernel launched just before it,
    poisoned (NaN) until that kernel writes it: a launch that read x before its
    griddepcontrol.wait would see NaN.
    The producer lets the GEMM start before it is done: the previous GEMM itself (it releases
    the next kernel at its start), or ``between(y)``, which gives (x, scale_a) from an output
    into buffers of its own, the same each call (e.g. a quantisation, then ``written_late``).
    ``launch_only(x, w, bias, out, scale_a, scale_b, config)``; ``weight(K, gen)``: a (K, K)
    weight as ``bf16_weight`` makes one."""
    gen = generator(seed)
    ws = [weight(K, gen) for _ in range(links)]
    x0 = randn(M, K, gen=gen, dtype=torch.bfloat16)
    ys = [poisoned(M, K, torch.bfloat16) for _ in range(links)]
    inputs = []  # what each GEMM took: (x, its scale), as the reference reads it

    def chain():
        inputs.clear()
        x, scale_a = between(x0) if between else (x0, None)
        for (w, scale_b, _), y in zip(ws, ys):
            inputs.append((x, scale_a))
            launch_only(x, w, None, y, scale_a, scale_b, config)
            x, scale_a = between(y) if between else (y, None)

    def poison():  # every GEMM's input but the first's x0, and x's scales
        for y in ys:
            y.fill_(float("nan"))
        for x, scale_a in inputs if between else ():
            x.fill_(float("nan"))
            if scale_a is not None:
                scale_a.fill_(float("nan"))

    chain()  # compiles, and allocates this stream's tile counters
    poison()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain()
        poison()
        g.replay()
    else:
        # The GPU first spins for ~2 ms, long enough for every launch to be queued behind it:
        # otherwise each kernel could end before the host launched the next, and no two overlap.
        torch.cuda._sleep(4_000_000)
        chain()
    torch.cuda.synchronize()
    for (_, _, check), y, (x, scale_a) in zip(ws, ys, inputs):
        check(y, x, scale_a)


# Spins until 20 µs have passed on the global timer; $0 is 0 (the elapsed time's top bit),
# which the assembler cannot know.
_SPIN_20US = ("{ .reg .u64 t0, t; .reg .pred more; mov.u64 t0, %globaltimer; "
              "spin_20us: mov.u64 t, %globaltimer; sub.u64 t, t, t0; "
              "setp.lt.u64 more, t, 20000; @more bra spin_20us; "
              "shr.u64 t, t, 63; cvt.u32.u64 $0, t; }")


@triton.jit
def _late_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, SPIN: tl.constexpr):
    """Lets the next kernel start at once (PDL), spins ~20 µs, then copies ``n`` bytes from
    ``src`` to ``dst``."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    zero = tl.inline_asm_elementwise(SPIN, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    # The loads depend on the spin's result: neither they nor the stores come before it.
    v = tl.load(src_ptr + offs + zero, mask=inside)
    tl.store(dst_ptr + offs, v, mask=inside)


def fp8_chain_weight(block_scales: bool, what: str):
    """``pdl_chain_reads_its_input_after_the_producer``'s ``weight`` for FP8 GEMMs: a (K, K)
    FP8 weight with per-channel scales (``block_scales``: per 128 x 128), and its check."""
    def weight(K, gen):
        w = randn(K, K, gen=gen) / K ** 0.5
        if block_scales:
            wq, w_scale = quant.per_block_fp8(w, quant.WEIGHT_BLOCK)
            return wq, w_scale, lambda y, xq, x_scale: check_block_scaled_decode(
                y, xq, wq, x_scale, w_scale, None, what)
        wq, w_scale = quant.per_channel_fp8(w)
        return wq, w_scale.reshape(-1), lambda y, xq, x_scale: check_fp8_decode(
            y, xq, wq, x_scale, w_scale.reshape(-1), None, what)
    return weight


def fp8_quantised_late(block_scales: bool, scales_late: bool):
    """``pdl_chain_reads_its_input_after_the_producer``'s ``between`` for FP8 GEMMs: an output
    quantised per token (``block_scales``: per 1 x 128) and x written into a buffer of its own
    (the same each call) by ``written_late``. ``scales_late``: x's scales too, by two late
    writers in turn, the second letting the GEMM start before it writes (it waits for the
    first): x last on every other link, its scales last on the others."""
    late = {}  # an output's data pointer -> (x's buffer, its scales', whether x is written last)

    def between(y):
        xq, x_scale = (quant.per_block_fp8(y, quant.ACT_BLOCK) if block_scales
                       else quant.per_token_fp8(y))
        x_scale = x_scale.reshape(y.shape[0], -1).contiguous()
        x_buf, scale_buf, x_last = late.setdefault(y.data_ptr(), (
            torch.empty_like(xq), torch.empty_like(x_scale), len(late) % 2 == 0))
        copies = [(x_scale, scale_buf), (xq, x_buf)] if scales_late else [(xq, x_buf)]
        for src, dst in copies if x_last else copies[::-1]:
            written_late(src, dst)
        scales = scale_buf if scales_late else x_scale
        return x_buf, scales if block_scales else scales.reshape(-1)
    return between


def written_late(src, dst):
    """``dst`` (contiguous, as ``src``) written from ``src`` by a kernel that lets the next one
    start first and writes ~20 µs later: a kernel launched with PDL after it that read ``dst``
    before its griddepcontrol.wait would read dst's old bytes."""
    n = src.numel() * src.element_size()
    _late_copy_kernel[(triton.cdiv(n, 1024),)](src.contiguous().view(torch.uint8),
                                               dst.view(torch.uint8), n, BLOCK=1024,
                                               SPIN=_SPIN_20US, launch_pdl=True)


LAUNCHER_CHECKS = (default_out_dtype_and_config, fp8_defaults_to_bf16_output, empty_k_gives_bias,
                   empty_m_returns_empty, rejects_bad_arguments)


def check_fp8_decode(y, xq, wq, x_scale, w_scale, bias, what):
    """An FP8 decode GEMM's ``y`` (the swapped Gluon kernels'): every element written; in norm no further from the fp32 reference than 3x torch's own
    FP8 GEMM (cuBLAS, promoted accumulation) plus the output's rounding; per element within
    the output's rounding plus 2^-10 of |x| @ |w| (the FP8 MMA truncates its sums within a
    step: errors of ~1e-3 of the magnitude, above fp32's bound but far below a wrong
    element's)."""
    assert not torch.isnan(y).any(), f"{what}: {int(torch.isnan(y).sum())} outputs unwritten"
    scale = x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    ref = (xq.float() @ wq.float().T) * scale
    mag = (xq.float().abs() @ wq.float().abs().T) * scale
    n = wq.shape[0]
    padded = torch.zeros(-(-n // 16) * 16, wq.shape[1], device=DEVICE).to(wq.dtype)
    padded[:n] = wq  # _scaled_mm takes N a multiple of 16
    ref_torch = torch._scaled_mm(xq, padded.T, scale_a=torch.ones((), device=DEVICE),
                                 scale_b=torch.ones((), device=DEVICE),
                                 out_dtype=torch.float32)[:, :n] * scale
    if bias is not None:
        ref = ref + bias.float()
        ref_torch = ref_torch + bias.float()
        mag = mag + bias.float().abs()
    rounding = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}[y.dtype]
    err = (y.float() - ref).abs()
    assert err.norm() <= 3 * (ref_torch - ref).norm() + rounding * ref.norm(), \
        (what, float(err.norm() / ref.norm()), float((ref_torch - ref).norm() / ref.norm()))
    bound = rounding * ref.abs() + 2**-10 * mag
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), (
        f"{what}: |y - ref| = {err.flatten()[worst]:.3g} > {bound.flatten()[worst]:.3g} at "
        f"{worst} (ref {ref.flatten()[worst]:.4g})")


def assert_long_k_as_precise_as_cublas(gemm):
    """``gemm(xq, wq, x_scale, w_scale)`` -> fp32 y over K = 25600 in one split: no further from
    the fp32 reference than 3x cuBLAS's FP8 GEMM (which promotes its sums), as a kernel that adds
    each step's MMA into fp32 stays; unpromoted FP8 wgmma sums were 10-30x it
    (docs/benchmarks.md, session 18)."""
    M, N, K = 16, 512, 25600
    xq, wq, x_scale, w_scale = quantised_operands(M, N, K, torch.float8_e4m3fn, "token_channel",
                                                  generator(9))
    y = gemm(xq, wq, x_scale, w_scale)
    ref = (xq.float() @ wq.float().T) * x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    cublas = torch._scaled_mm(xq, wq.T, scale_a=x_scale.reshape(-1, 1).contiguous(),
                              scale_b=w_scale.reshape(1, -1).contiguous(),
                              out_dtype=torch.float32)
    ours, theirs = (y - ref).norm() / ref.norm(), (cublas - ref).norm() / ref.norm()
    assert ours <= 3 * theirs + 1e-7, (float(ours), float(theirs))


def assert_fp8_decode_launches(gemm, M, N, K, layout, what, reproducible=True):
    """``gemm(xq, wq, bias, out_dtype, x_scale, w_scale, out)`` on FP8 operands of (M, N, K) with
    ``layout``'s scales, bf16 out without bias and fp16 / fp32 out with it, into poisoned outputs:
    each within ``check_fp8_decode``'s bounds, and a second launch bitwise equal to the first
    (it finds the split counters left zero, and the partials summed in split order give it the
    same bits) or, not ``reproducible`` (splits added in arrival order), within the bounds too
    (it finds the tile sums left zero)."""
    gen = generator(M + N + K)
    operands = quantised_operands(M, N, K, torch.float8_e4m3fn, layout, gen)
    _assert_decode_launches(gemm, operands, check_fp8_decode, gen, what, reproducible)


def _assert_decode_launches(gemm, operands, check, gen, what, reproducible):
    """``assert_fp8_decode_launches``'s launches and checks, on ``operands`` (xq, wq, x_scale,
    w_scale) with ``check`` (``check_fp8_decode`` or ``check_block_scaled_decode``)."""
    xq, wq, x_scale, w_scale = operands
    M, N = xq.shape[0], wq.shape[0]
    for out_dtype, with_bias in ((torch.bfloat16, False), (torch.float16, True),
                                 (torch.float32, True)):
        bias = randn(N, gen=gen, dtype=torch.bfloat16) if with_bias else None
        first, again = (gemm(xq, wq, bias, out_dtype, x_scale, w_scale, poisoned(M, N, out_dtype))
                        for _ in range(2))
        check(first, xq, wq, x_scale, w_scale, bias, f"{what} {out_dtype}")
        if reproducible:
            assert torch.equal(first, again), what
        else:
            check(again, xq, wq, x_scale, w_scale, bias, f"{what} {out_dtype} again")


def check_block_scaled_decode(y, xq, wq, x_scale, w_scale, bias, what):
    """A block-scaled FP8 decode GEMM's ``y``: every element written, and each within the
    output's rounding plus 2^-10 of |x| @ |w| of the dequantised operands' fp32 product (the FP8
    MMA truncates its sums within a step of 128, as ``check_fp8_decode`` says)."""
    assert not torch.isnan(y).any(), f"{what}: {int(torch.isnan(y).sum())} outputs unwritten"
    x_deq = quant.dequant_per_block(xq, x_scale, quant.ACT_BLOCK)
    w_deq = quant.dequant_per_block(wq, w_scale, quant.WEIGHT_BLOCK)
    ref, mag = x_deq @ w_deq.T, x_deq.abs() @ w_deq.abs().T
    if bias is not None:
        ref, mag = ref + bias.float(), mag + bias.float().abs()
    rounding = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}[y.dtype]
    err = (y.float() - ref).abs()
    bound = rounding * ref.abs() + 2**-10 * mag
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), (
        f"{what}: |y - ref| = {err.flatten()[worst]:.3g} > {bound.flatten()[worst]:.3g} at "
        f"{worst} (ref {ref.flatten()[worst]:.4g})")


def assert_block_scaled_decode_launches(gemm, M, N, K, what, reproducible=True):
    """``gemm(xq, wq, bias, out_dtype, x_scale, w_scale, out)`` on FP8 operands of (M, N, K) with
    block scales (every block its own), bf16 out without bias and fp16 / fp32 out with it, into
    poisoned outputs: each within ``check_block_scaled_decode``'s bound, and a second launch
    bitwise equal to the first or, not ``reproducible``, within the bound too."""
    gen = generator(M + N + K)
    _assert_decode_launches(gemm, block_scaled_operands(M, N, K, gen), check_block_scaled_decode,
                            gen, what, reproducible)


def assert_mxfp4_launcher_says_what_is_wrong(gemm):
    """An MXFP4-weight kernel's validating launcher (``_mxfp4_calls.validated_launch``): codes
    of the wrong width and an output of the wrong shape refused, saying so."""
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEVICE)
    wq, w_scale = quant.mxfp4(torch.ones(8, 64, device=DEVICE))
    with pytest.raises(ValueError, match=r"needs wq \(N, 32\)"):
        gemm(x, wq[:, :16], w_scale)
    with pytest.raises(ValueError, match="out must be"):
        gemm(x, wq, w_scale, out=torch.empty(4, 8, device=DEVICE))


def older_packed_layout(codes: torch.Tensor, layout: int) -> torch.Tensor:
    """MXFP4 codes as quantised (N, K // 2), K a multiple of 128, in an earlier version of the
    packed layout, made here independently of ``mxfp4.prepack``: 1 each 64-byte group's words
    transposed (word t of block j at 4 t + j), 2 also each word's code i with its magnitude bits
    at ``mxfp4.PLACES[i][0]`` on and its sign at ``PLACES[i][1]``. What state_dicts saved by
    earlier gemmtunes hold."""
    from gemmtune.kernels import mxfp4

    n, half_k = codes.shape
    moved = codes.reshape(n, half_k // 64, 4, 4, 4).transpose(2, 3).reshape(n, half_k)
    if layout == 1:
        return moved.contiguous()
    words = moved.contiguous().view(torch.int32).to(torch.int64)
    placed = torch.zeros_like(words)
    for i, (magnitude, sign) in enumerate(mxfp4.PLACES):
        code = words >> (4 * i) & 15
        placed |= (code & 7) << magnitude | (code >> 3) << sign
    signed = torch.where(placed >= 2 ** 31, placed - 2 ** 32, placed).to(torch.int32)
    return signed.view(torch.uint8).reshape(n, half_k)

"""gemmtune.quant against an independent model of the two formats.

Quantised values are checked bit for bit against a NumPy encoder written from the e4m3fn
definition (every finite code's value, nearest wins, ties to the even code, saturate at 448) and
against ``np.rint`` for int8, never against torch's own cast; scales against NumPy's float32
``amax / qmax``. Round trips are bounded by what the format allows, derived in ``_fp8_bound`` and
``_int8_bound``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gemmtune import quant
from gemmtune.quant import ACT_BLOCK, FP8_DTYPE, WEIGHT_BLOCK
from gemmtune.tables.values import BadValue, QuantType

# --------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------


def _e4m3_values() -> np.ndarray:
    """Value of each positive finite e4m3fn code 0x00..0x7E (0x7F is NaN), exponent bias 7."""
    code = np.arange(127)
    e, m = code >> 3, code & 7
    return np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))


E4M3 = _e4m3_values()
assert E4M3[-1] == 448.0 and np.all(np.diff(E4M3) > 0)


def e4m3_encode(v: np.ndarray) -> np.ndarray:
    """Bits of ``v`` in e4m3fn: nearest code, ties to the even code, |v| > 448 and Inf saturate
    to 448 (cvt.rn.satfinite), the sign kept (so -0.0 and negative underflow give 0x80)."""
    v = np.asarray(v, dtype=np.float64)
    sign = np.signbit(v).astype(np.int64) << 7
    a = np.minimum(np.abs(v), 448.0)
    hi = np.clip(np.searchsorted(E4M3, a, side="left"), 0, 126)  # first code >= a
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = a - E4M3[lo], E4M3[hi] - a
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    code = np.where(np.isnan(a), 0x7F, code)
    return (code | sign).astype(np.uint8)


def int8_encode(v: np.ndarray) -> np.ndarray:
    """np.rint rounds half to even, like cvt.rni; then the symmetric saturation."""
    return np.clip(np.rint(v), -127, 127).astype(np.int8)


def bits(q: torch.Tensor) -> np.ndarray:
    return q.view(torch.uint8).numpy() if q.dtype == FP8_DTYPE else q.numpy()


def np_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    amax = np.maximum(np.asarray(amax, np.float32), np.float32(quant.AMAX_FLOOR))
    return (amax / np.float32(qmax)).astype(np.float32)


def np_block_amax(x: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """amax of each block by slicing, so a partial block holds only real elements."""
    bm, bk = block
    m, k = x.shape[-2:]
    out = np.empty((*x.shape[:-2], math.ceil(m / bm), math.ceil(k / bk)), np.float32)
    for i in range(out.shape[-2]):
        for j in range(out.shape[-1]):
            tile = np.abs(x[..., i * bm:(i + 1) * bm, j * bk:(j + 1) * bk])
            out[..., i, j] = tile.max(axis=(-2, -1))
    return out


def np_expand(scale: np.ndarray, shape, block: tuple[int, int]) -> np.ndarray:
    bm, bk = block
    e = np.repeat(np.repeat(scale, bm, axis=-2), bk, axis=-1)
    return e[..., :shape[-2], :shape[-1]]


def rand(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Fresh data, never zeros: rows of different magnitude (2^-6..2^6), and within a row values
    spread over 16 binades so the FP8 subnormal range (< 2^-14.8 of amax) is reached."""
    g = torch.Generator().manual_seed(seed)
    row_mag = torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1), generator=g).float())
    spread = torch.exp2(-16 * torch.rand(shape, generator=g))
    return (torch.randn(shape, generator=g) * row_mag * spread).to(dtype)


# Scheme name -> (function, q dtype, qmax, how the reference groups elements).
SCHEMES = {
    "tensor_fp8": (quant.per_tensor_fp8, FP8_DTYPE, 448.0, "tensor"),
    "token_fp8": (quant.per_token_fp8, FP8_DTYPE, 448.0, "row"),
    "channel_fp8": (quant.per_channel_fp8, FP8_DTYPE, 448.0, "row"),
    "tensor_int8": (quant.per_tensor_int8, torch.int8, 127.0, "tensor"),
    "token_int8": (quant.per_token_int8, torch.int8, 127.0, "row"),
    "channel_int8": (quant.per_channel_int8, torch.int8, 127.0, "row"),
    "block1x128_fp8": (lambda t: quant.per_block_fp8(t, ACT_BLOCK), FP8_DTYPE, 448.0, ACT_BLOCK),
    "block128x128_fp8": (lambda t: quant.per_block_fp8(t, WEIGHT_BLOCK), FP8_DTYPE, 448.0,
                         WEIGHT_BLOCK),
}

# Ragged K (200, 129, 1) and N (130, 129, 1) on purpose; 1x128 and per-row schemes also get
# leading dims, 128x128 and per-channel get expert dims.
SHAPES = [(1, 200), (13, 129), (67, 1), (130, 257), (256, 128), (2, 3, 200), (2, 130, 129)]


def reference(x: torch.Tensor, scheme: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(expected q bits, expected scale, scale expanded to x's shape), all from NumPy."""
    _, q_dtype, qmax, group = SCHEMES[scheme]
    xn = x.float().numpy()
    if group == "tensor":
        scale = np_scale(np.abs(xn).max(), qmax).reshape(())
        full = np.broadcast_to(scale, xn.shape)
    elif group == "row":
        scale = np_scale(np.abs(xn).max(axis=-1, keepdims=True), qmax)
        full = np.broadcast_to(scale, xn.shape)
    else:
        scale = np_scale(np_block_amax(xn, group), qmax)
        full = np_expand(scale, xn.shape, group)
    v = (xn / full).astype(np.float32)  # fp32 division, correctly rounded as torch's
    q = e4m3_encode(v) if q_dtype == FP8_DTYPE else int8_encode(v)
    return q, scale, full


def dequant_any(q, scale, scheme):
    group = SCHEMES[scheme][3]
    return quant.dequant_per_block(q, scale, group) if isinstance(group, tuple) \
        else quant.dequant(q, scale)


# --------------------------------------------------------------------------------------------
# Bit-exactness and round trips on random data
# --------------------------------------------------------------------------------------------


def test_encoder_matches_hand_computed_codes():
    """The NumPy encoder itself, against codes worked out by hand (sign.eeee.mmm, bias 7)."""
    # (value, code) pairs, not a dict: 0.0 and -0.0 would be one key.
    table = [
        (0.0, 0x00), (-0.0, 0x80), (1.0, 0x38), (-1.1875, 0xBA), (448.0, 0x7E), (416.0, 0x7D),
        (2.0**-6, 0x08), (2.0**-9, 0x01), (7 * 2.0**-9, 0x07),
        (1.0625, 0x38),  # tie between 1.0 (m=0) and 1.125 (m=1): even -> 1.0
        (1.1875, 0x3A),  # tie between 1.125 (m=1) and 1.25 (m=2): even -> 1.25
        (1.3125, 0x3A),  # tie between 1.25 (m=2) and 1.375 (m=3): even -> 1.25
        (248.0, 0x78),  # tie between 240 (0x77) and 256 (0x78): the mantissa carries into e
        (432.0, 0x7E),  # tie between 416 (m=5) and 448 (m=6): even -> 448
        (2.0**-10, 0x00),  # half the smallest subnormal: tie with 0, even -> 0
        (1.0001 * 2.0**-10, 0x01),
        (3 * 2.0**-10, 0x02),  # 1.5 subnormal steps: even -> 2 steps
        (5 * 2.0**-10, 0x02),  # 2.5 steps: even -> 2 steps
        (15 * 2.0**-10, 0x08),  # 7.5 steps: even code 0x08 is the smallest normal, 2^-6
        (449.0, 0x7E), (464.0, 0x7E), (1e6, 0x7E), (-1e6, 0xFE),  # saturate, not NaN
        (math.inf, 0x7E), (-math.inf, 0xFE),
        (-1e-9, 0x80),  # negative underflow keeps its sign
    ]
    values = np.array([v for v, _ in table], np.float32)
    codes = [c for _, c in table]
    assert e4m3_encode(values).tolist() == codes
    # and the library's conversion with scale 1 (exact in fp32) gives the same bits
    q = quant.quantize_fp8(torch.from_numpy(values), torch.tensor(1.0))
    assert bits(q).tolist() == codes


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bit_exact_against_independent_reference(scheme, shape):
    fn, q_dtype, _, _ = SCHEMES[scheme]
    x = rand(shape, seed=100 * list(SCHEMES).index(scheme) + SHAPES.index(shape))
    q, scale = fn(x)
    want_q, want_scale, _ = reference(x, scheme)
    assert q.dtype == q_dtype and q.shape == x.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == want_scale.shape
    np.testing.assert_array_equal(scale.numpy(), want_scale)  # exactly amax / qmax
    np.testing.assert_array_equal(bits(q), want_q)


def _fp8_bound(x: np.ndarray, s: np.ndarray, deq: np.ndarray) -> np.ndarray:
    # v = fl(x/s) has relative error <= 2^-24. Rounding v to e4m3 (3 mantissa bits) moves a normal
    # value by at most half an ulp = 2^-4 * 2^floor(log2|v|) <= 2^-4 |v|, a subnormal by at most
    # half the subnormal spacing 2^-9 / 2 = 2^-10; times s. fl(q*s) adds 2^-24 relative. The last
    # term, 4 * 2^-24 * (|x| + |deq|), covers both fp32 roundings with room to spare.
    return 2.0**-4 * np.abs(x) + 2.0**-10 * s + 4 * 2.0**-24 * (np.abs(x) + np.abs(deq))


def _int8_bound(x: np.ndarray, s: np.ndarray, deq: np.ndarray) -> np.ndarray:
    # round-to-nearest moves x/s by at most 1/2 (no saturation: |x/s| <= 127 up to fp32 rounding);
    # plus the same fp32 slack as above.
    return 0.5 * s + 4 * 2.0**-24 * (np.abs(x) + np.abs(deq))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_round_trip_within_format_bound(scheme, dtype):
    fn, q_dtype, _, _ = SCHEMES[scheme]
    for i, shape in enumerate([(13, 200), (130, 129), (5, 1)]):
        x = rand(shape, seed=1000 + i, dtype=dtype)
        q, scale = fn(x)
        _, _, full = reference(x, scheme)
        deq = dequant_any(q, scale, scheme).numpy()
        xn = x.float().numpy()
        bound = (_fp8_bound if q_dtype == FP8_DTYPE else _int8_bound)(xn, full, deq)
        err = np.abs(deq - xn)
        assert np.all(err <= bound), f"{shape}: worst excess {np.max(err - bound)}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_element_at_amax_maps_to_qmax(scheme):
    fn, _, qmax, group = SCHEMES[scheme]
    x = rand((130, 257), seed=7)
    q, _ = fn(x)
    xn, qn = x.numpy(), q.float().numpy()
    if group == "tensor":
        tiles = [(slice(None), slice(None))]
    elif group == "row":
        tiles = [(slice(i, i + 1), slice(None)) for i in range(x.shape[0])]
    else:
        bm, bk = group
        tiles = [(slice(i, i + bm), slice(j, j + bk))
                 for i in range(0, x.shape[0], bm) for j in range(0, x.shape[1], bk)]
    for tile in tiles:
        at = np.unravel_index(np.argmax(np.abs(xn[tile])), xn[tile].shape)
        assert qn[tile][at] == np.sign(xn[tile][at]) * qmax


def test_scale_one_gives_values_unchanged_and_ties_to_even():
    # amax 448 (127) gives a scale of exactly 1, so the quantised values are the inputs rounded.
    x = torch.tensor([[448.0, 1.0625, 1.1875, -1.1875, 248.0, 3 * 2.0**-10, 2.0**-10]])
    q, s = quant.per_token_fp8(x)
    assert s.item() == 1.0
    assert q.float().tolist() == [[448.0, 1.0, 1.25, -1.25, 256.0, 2 * 2.0**-9, 0.0]]

    xi = torch.tensor([[127.0, 2.5, 3.5, -2.5, -3.5, 0.5, 1.5, 126.5]])
    qi, si = quant.per_token_int8(xi)
    assert si.item() == 1.0
    assert qi.tolist() == [[127, 2, 4, -2, -4, 0, 2, 126]]


def test_subnormal_range_value():
    # 3 * 2^-9 of a scale-1 row is the e4m3 subnormal 0x03; it survives the round trip exactly.
    x = torch.tensor([[-448.0, 3 * 2.0**-9, 0.75 * 2.0**-9, 0.25 * 2.0**-9]])
    q, s = quant.per_token_fp8(x)
    assert bits(q).tolist() == [[0xFE, 0x03, 0x01, 0x00]]
    assert quant.dequant(q, s).tolist() == [[-448.0, 3 * 2.0**-9, 2.0**-9, 0.0]]


def test_negative_zero():
    x = torch.tensor([[448.0, -0.0, 0.0, -1e-9]])
    q, s = quant.per_token_fp8(x)
    assert bits(q).tolist() == [[0x7E, 0x80, 0x00, 0x80]]
    assert torch.signbit(quant.dequant(q, s)).tolist() == [[False, True, False, True]]
    # int8 has no negative zero: -0.0 becomes 0
    qi, si = quant.per_token_int8(torch.tensor([[127.0, -0.0, -0.4]]))
    assert qi.tolist() == [[127, 0, 0]]


# --------------------------------------------------------------------------------------------
# Saturation, zeros, non-finite values
# --------------------------------------------------------------------------------------------


def test_values_beyond_the_scale_saturate_instead_of_nan():
    x = rand((13, 200), seed=3)
    small = (x.abs().amax(dim=-1, keepdim=True) / 448.0 / 4.0).float()  # a quarter of the range
    q = quant.quantize_fp8(x, small)
    assert not torch.isnan(q.float()).any()
    assert q.float().abs().max() == 448.0 and (q.float().abs() == 448.0).sum() > 13
    np.testing.assert_array_equal(bits(q), e4m3_encode((x.numpy() / small.numpy())))

    qi = quant.quantize_int8(x, small * (448.0 / 127.0))
    assert qi.abs().max() == 127 and qi.min() == -127  # -128 never appears
    np.testing.assert_array_equal(
        bits(qi), int8_encode(x.numpy() / (small * (448.0 / 127.0)).numpy()))

    # with a given finite scale, +-Inf saturates (satfinite) while NaN stays NaN
    q = quant.quantize_fp8(torch.tensor([math.inf, -math.inf, math.nan]), torch.tensor(1.0))
    assert q.float()[:2].tolist() == [448.0, -448.0] and q.float()[2].isnan()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_all_zero_groups_give_finite_scales_and_zeros(scheme):
    fn, _, qmax, group = SCHEMES[scheme]
    x = rand((130, 200), seed=5)
    x[:1] = 0.0  # a zero row (and a zero 1x128 block)
    x[:, 128:] = 0.0  # a zero partial column block (zero 128x128 blocks)
    if group == "tensor":
        x.zero_()
    q, scale = fn(x)
    deq = dequant_any(q, scale, scheme)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert (q.float()[x == 0] == 0).all() and (deq[x == 0] == 0).all()
    floor = np.float32(quant.AMAX_FLOOR) / np.float32(qmax)
    assert (scale.numpy() == floor).any()  # the zero group's scale is the floor's


def test_partial_blocks_scale_over_real_elements_only():
    # x (3, 200): the last 1x128 block holds 72 real columns; put the block's largest value in the
    # last real column so a scale missing it (or one reading past K) would differ.
    x = rand((3, 200), seed=11)
    x[:, 128:] *= 1e-3
    x[:, 199] = torch.tensor([0.5, -0.25, 2.0])
    _, s = quant.per_block_fp8(x, ACT_BLOCK)
    assert s.shape == (3, 2)
    want = (x[:, 128:].abs().amax(dim=1) / 448.0).numpy()
    np.testing.assert_array_equal(s[:, 1].numpy(), want)

    # w (130, 129): the corner block is 2x1 real elements
    w = rand((130, 129), seed=12)
    w[128:, 128] = torch.tensor([-3e-3, 1e-3])
    _, sw = quant.per_block_fp8(w, WEIGHT_BLOCK)
    assert sw.shape == (2, 2)
    assert sw[1, 1].item() == np.float32(3e-3) / np.float32(448.0)
    np.testing.assert_array_equal(sw[1, 0].numpy(), (w[128:, :128].abs().amax() / 448.0).numpy())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=str)
def test_fp8_non_finite_poisons_its_group_only(bad):
    x = rand((4, 200), seed=13)
    x[1, 7] = bad
    q, s = quant.per_token_fp8(x)
    deq = quant.dequant(q, s)
    assert not torch.isfinite(s[1]).any() and deq[1].isnan().all()
    clean = torch.cat([x[:1], x[2:]])
    q_clean, s_clean = quant.per_token_fp8(clean)
    np.testing.assert_array_equal(bits(torch.cat([q[:1], q[2:]])), bits(q_clean))
    np.testing.assert_array_equal(torch.cat([s[:1], s[2:]]).numpy(), s_clean.numpy())

    qb, sb = quant.per_block_fp8(x, ACT_BLOCK)
    deq_b = quant.dequant_per_block(qb, sb, ACT_BLOCK)
    assert deq_b[1, :128].isnan().all() and torch.isfinite(deq_b[1, 128:]).all()
    assert torch.isfinite(deq_b[[0, 2, 3]]).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=str)
@pytest.mark.parametrize("call", [
    quant.per_tensor_int8, quant.per_token_int8, quant.per_channel_int8,
    lambda t: quant.quantize_int8(t, torch.tensor(1.0)),
    lambda t: quant.quantize(t, QuantType.per_Token, torch.int8),
], ids=["tensor", "token", "channel", "given_scale", "by_quant_type"])
def test_int8_rejects_non_finite(call, bad):
    x = rand((4, 16), seed=17)
    x[2, 3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        call(x)


# --------------------------------------------------------------------------------------------
# Shapes, layouts, references
# --------------------------------------------------------------------------------------------


def test_leading_dims_match_the_flattened_call():
    x = rand((2, 3, 200), seed=19)
    for fn in (quant.per_token_fp8, quant.per_token_int8,
               lambda t: quant.per_block_fp8(t, ACT_BLOCK)):
        q, s = fn(x)
        q2, s2 = fn(x.reshape(6, 200))
        assert q.shape == x.shape and s.shape == (2, 3, *s2.shape[1:])
        np.testing.assert_array_equal(bits(q.reshape(6, 200)), bits(q2))
        np.testing.assert_array_equal(s.reshape(s2.shape).numpy(), s2.numpy())
    # experts: (E, N, K) weights quantise per expert
    w = rand((2, 130, 257), seed=20)
    for fn in (quant.per_channel_fp8, lambda t: quant.per_block_fp8(t, WEIGHT_BLOCK)):
        q, s = fn(w)
        for e in range(2):
            qe, se = fn(w[e])
            np.testing.assert_array_equal(bits(q[e]), bits(qe))
            np.testing.assert_array_equal(s[e].numpy(), se.numpy())


def test_one_dimensional_activation_is_one_row():
    x = rand((200,), seed=21)
    q, s = quant.per_token_fp8(x)
    assert s.shape == (1,)
    qb, sb = quant.per_block_fp8(x, ACT_BLOCK)
    assert sb.shape == (2,)
    qb2, sb2 = quant.per_block_fp8(x[None], ACT_BLOCK)
    np.testing.assert_array_equal(bits(qb), bits(qb2[0]))
    torch.testing.assert_close(quant.dequant_per_block(qb, sb, ACT_BLOCK),
                               quant.dequant_per_block(qb2, sb2, ACT_BLOCK)[0], rtol=0, atol=0)


def test_empty_m():
    x = torch.empty(0, 200)
    q, s = quant.per_token_fp8(x)
    assert q.shape == (0, 200) and s.shape == (0, 1)
    q, s = quant.per_tensor_fp8(x)
    assert s.item() == np.float32(quant.AMAX_FLOOR) / np.float32(448.0)
    q, s = quant.per_block_fp8(x, ACT_BLOCK)
    assert q.shape == (0, 200) and s.shape == (0, 2)


def test_non_contiguous_input_same_result():
    x = rand((200, 13), seed=23).t()  # (13, 200), K not the fast dim
    assert not x.is_contiguous()
    for fn in (quant.per_token_fp8, quant.per_tensor_int8,
               lambda t: quant.per_block_fp8(t, ACT_BLOCK)):
        q, s = fn(x)
        q2, s2 = fn(x.contiguous())
        assert q.is_contiguous() and s.is_contiguous()
        np.testing.assert_array_equal(bits(q), bits(q2))
        np.testing.assert_array_equal(s.numpy(), s2.numpy())


def test_dequant_references_are_the_manual_products():
    x = rand((130, 257), seed=29)
    q, s = quant.per_token_fp8(x)
    assert torch.equal(quant.dequant(q, s), q.float() * s)
    q, s = quant.per_tensor_int8(x)
    assert s.shape == () and torch.equal(quant.dequant(q, s), q.float() * s)
    q, s = quant.per_block_fp8(x, WEIGHT_BLOCK)
    manual = torch.empty(130, 257)
    for i in range(2):
        for j in range(3):
            tile = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
            manual[tile] = q[tile].float() * s[i, j]
    assert torch.equal(quant.dequant_per_block(q, s, WEIGHT_BLOCK), manual)


@pytest.mark.parametrize("q_type,q_dtype,scheme", [
    (QuantType.per_Tensor, FP8_DTYPE, "tensor_fp8"),
    ("QuantType.per_Token", FP8_DTYPE, "token_fp8"),
    ("per_token", torch.int8, "token_int8"),
    (QuantType.per_Tensor, torch.int8, "tensor_int8"),
    ("per_1x128", FP8_DTYPE, "block1x128_fp8"),
    (QuantType.per_128x128, FP8_DTYPE, "block128x128_fp8"),
])
def test_quantize_by_quant_type(q_type, q_dtype, scheme):
    x = rand((130, 200), seed=31)
    q, s = quant.quantize(x, q_type, q_dtype)
    q2, s2 = SCHEMES[scheme][0](x)
    np.testing.assert_array_equal(bits(q), bits(q2))
    np.testing.assert_array_equal(s.numpy(), s2.numpy())
    assert torch.equal(quant.dequantize(q, s, q_type), dequant_any(q2, s2, scheme))


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,match", [
    (lambda: quant.per_token_fp8(torch.ones(3, 4, dtype=torch.int32)), "bf16, fp16 or fp32"),
    (lambda: quant.per_token_fp8(torch.ones(3, 4, dtype=torch.float64)), "bf16, fp16 or fp32"),
    (lambda: quant.per_token_fp8(torch.ones(3, 4).to(FP8_DTYPE)), "already quantised"),
    (lambda: quant.per_token_int8([[1.0]]), "torch.Tensor"),
    (lambda: quant.per_token_fp8(torch.ones(3, 0)), r"\(K\) is 0"),
    (lambda: quant.per_token_fp8(torch.tensor(1.0)), "at least 1-D"),
    (lambda: quant.per_channel_fp8(torch.ones(4)), r"\(\.\.\., N, K\)"),
    (lambda: quant.per_channel_int8(torch.ones(4)), "at least 2-D"),
    (lambda: quant.per_block_fp8(torch.ones(4), WEIGHT_BLOCK), "at least 2-D"),
    (lambda: quant.per_block_fp8(torch.ones(4, 4), (0, 128)), "two positive ints"),
    (lambda: quant.per_block_fp8(torch.ones(4, 4), (128,)), "two positive ints"),
    (lambda: quant.per_block_fp8(torch.ones(4, 4), (1.0, 128)), "two positive ints"),
    (lambda: quant.quantize_fp8(torch.ones(4, 5), torch.ones(4, 1, dtype=torch.float16)),
     "float32"),
    (lambda: quant.quantize_fp8(torch.ones(4, 5), torch.ones(3, 1)), "does not broadcast"),
    (lambda: quant.dequant(torch.ones(4, 5), torch.ones(4, 1)), "float8_e4m3fn or int8"),
    (lambda: quant.dequant(torch.ones(4, 5).to(FP8_DTYPE), torch.ones(5, 1)), "broadcast"),
    (lambda: quant.dequant(torch.ones(4, 5).to(FP8_DTYPE), torch.ones(4, 2)), "dequant_per_block"),
    (lambda: quant.dequant_per_block(torch.ones(4, 200).to(FP8_DTYPE), torch.ones(4, 1),
                                     ACT_BLOCK), r"shape \(4, 2\)"),
    (lambda: quant.dequant_per_block(torch.ones(4, 200).to(FP8_DTYPE),
                                     torch.ones(4, 2, dtype=torch.float64), ACT_BLOCK), "float32"),
    (lambda: quant.quantize(torch.ones(4, 5), "per_1x32"), "does not implement"),
    (lambda: quant.quantize(torch.ones(4, 5), QuantType.No), "does not implement"),
    (lambda: quant.quantize(torch.ones(4, 5), "per_1x128", torch.int8), "FP8 only"),
    (lambda: quant.quantize(torch.ones(4, 5), "per_Tensor", torch.float16), "q_dtype"),
    (lambda: quant.dequantize(torch.ones(4, 5).to(FP8_DTYPE), torch.ones(()), "No"),
     "does not implement"),
])
def test_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_unknown_quant_type_lists_the_valid_names():
    with pytest.raises(BadValue, match="QuantType.per_Token"):
        quant.quantize(torch.ones(4, 5), "per_row")


@pytest.mark.parametrize("q_type,scale_shape", [
    ("per_Tensor", (3, 1, 1)), ("per_Token", (3, 200, 1)), ("per_1x128", (3, 2, 3))])
def test_experts_quantised_per_expert_channel_or_block(q_type, scale_shape):
    w = torch.randn(3, 200, 300, generator=torch.Generator().manual_seed(0))
    w[1] *= 50  # experts of other magnitudes keep their own scales
    q, scale = quant.quantize_experts(w, q_type)
    assert q.dtype == quant.FP8_DTYPE and q.shape == w.shape
    assert scale.shape == scale_shape and scale.dtype == torch.float32
    back = quant.dequantize_experts(q, scale, q_type)
    for e in range(3):  # e4m3: 3 mantissa bits, ~2.6% rms each
        assert ((back[e] - w[e]).norm() / w[e].norm()) < 0.04
    if q_type == "per_Tensor":
        assert torch.equal(scale.flatten(), w.abs().amax(dim=(1, 2)) / quant.FP8_MAX)


def test_experts_refuse_other_schemes():
    with pytest.raises(ValueError, match="MoE experts are quantised .* not QuantType.No"):
        quant.quantize_experts(torch.randn(2, 4, 8), "No")

"""MXFP4 quantisation (gemmtune.quant.mxfp4 / dequant_mxfp4), bit for bit: the E8M0 block
scales, the E2M1 grid's rounding (nearest, ties to the even encoding) and saturation, the
nibble packing, all-zero blocks, the smallest scales, NaN/Inf; and random data against an
independent nearest-value search."""

from __future__ import annotations

import pytest
import torch

from gemmtune import quant

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def block(values, fill=0.0):
    """One row of one 32-element block: ``values`` first, then ``fill``."""
    values = list(values)
    return torch.tensor([values + [fill] * (32 - len(values))])


def codes_of(q: torch.Tensor) -> list[int]:
    """The 4-bit codes of a packed row, in element order."""
    return [c for byte in q.flatten().tolist() for c in (byte & 0xF, byte >> 4)]


def test_grid_values_encode_exactly_and_pack_low_nibble_first():
    q, s = quant.mxfp4(block(list(GRID) + [-v for v in GRID]))
    assert s.tolist() == [[127]]  # amax 6 = 1.5 x 2^2: scale 2^0
    assert codes_of(q)[:16] == list(range(16))
    assert q[0, 0].item() == 0 | (1 << 4) and q[0, 1].item() == 2 | (3 << 4)
    assert quant.dequant_mxfp4(q, s)[0, :16].tolist() == list(GRID) + [-v for v in GRID]
    assert q.shape == (1, 16) and q.dtype == torch.uint8 and s.dtype == torch.uint8


@pytest.mark.parametrize("amax, byte, value", [
    (6.0, 127, 6.0), (4.0, 127, 4.0), (7.99, 127, 6.0), (8.0, 128, 8.0), (1.0, 125, 1.0),
    (0.75, 124, 0.75), (2.0**-120, 5, 2.0**-120), (2.0**100, 225, 2.0**100),
    (3.0e38, 252, 6.0 * 2.0**125)])
def test_block_scale_is_floor_log2_amax_minus_2(amax, byte, value):
    """The scale byte, and the block's largest element after the round trip: amax / scale lies
    in [4, 8), so it comes back as itself on the grid or saturated to 6 scales."""
    q, s = quant.mxfp4(block([amax]))
    assert s.item() == byte
    assert quant.dequant_mxfp4(q, s)[0, 0].item() == value


@pytest.mark.parametrize("v, expected", [
    (0.25, 0.0), (0.2500001, 0.5), (0.75, 1.0), (1.25, 1.0), (1.2500001, 1.5), (1.75, 2.0),
    (2.5, 2.0), (2.5000002, 3.0), (3.5, 4.0), (5.0, 4.0), (5.0000005, 6.0), (5.9, 6.0),
    (0.1, 0.0), (2.9, 3.0)])
def test_ties_go_to_the_even_encoding(v, expected):
    """In a block whose amax is 6 (scale 1): a tie takes the value whose last mantissa bit is 0
    (0, 1, 2, 4 and 6 over 0.5, 1.5, 3); just past a tie, the next value up."""
    for sign in (1.0, -1.0):
        q, s = quant.mxfp4(block([6.0, sign * v]))
        assert s.item() == 127
        assert quant.dequant_mxfp4(q, s)[0, 1].item() == sign * expected, (v, sign)


def test_saturates_to_6():
    q, s = quant.mxfp4(block([7.5, -7.9, 6.5, 7.0]))  # amax 7.9: floor(log2) 2, scale 1
    assert s.item() == 127
    assert codes_of(q)[:4] == [7, 15, 7, 7]
    assert quant.dequant_mxfp4(q, s)[0, :4].tolist() == [6.0, -6.0, 6.0, 6.0]


def test_all_zero_block_gets_the_smallest_scale_and_zeros():
    t = torch.cat([torch.zeros(1, 32), block([1.0, -3.0])], dim=1)
    q, s = quant.mxfp4(t)
    assert s.tolist() == [[0, 126]]
    assert codes_of(q)[:32] == [0] * 32
    assert quant.dequant_mxfp4(q, s)[0, :32].eq(0).all()


def test_smallest_values():
    # The smallest normal fp32 block: amax 2^-126, scale 2^-128 clamps to byte 0 (2^-127), so
    # amax / scale = 2 exactly; the half step 2^-128 is the smallest non-zero value it holds.
    q, s = quant.mxfp4(block([2.0**-126, 2.0**-128, -(2.0**-128), 2.0**-129]))
    assert s.item() == 0
    assert quant.dequant_mxfp4(q, s)[0, :4].tolist() == [2.0**-126, 2.0**-128, -(2.0**-128), 0.0]
    # A subnormal block keeps the smallest scale; its values round to the grid on it.
    q, s = quant.mxfp4(block([1e-40, -1e-40]))
    assert s.item() == 0 and quant.dequant_mxfp4(q, s)[0, :2].tolist() == [0.0, -0.0]


def test_negative_zero_keeps_its_sign():
    q, _ = quant.mxfp4(block([1.0, -0.0]))
    assert codes_of(q)[1] == 8


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_inf_makes_its_block_nan_and_no_other(bad):
    t = torch.cat([block([1.0, bad]), block([2.0, -1.5])], dim=1)
    q, s = quant.mxfp4(t)
    assert s[0, 0].item() == 255 and s[0, 1].item() == 126
    out = quant.dequant_mxfp4(q, s)
    assert out[0, :32].isnan().all()
    assert out[0, 32:34].tolist() == [2.0, -1.5]


def _nearest_even(scaled: torch.Tensor) -> torch.Tensor:
    """Independent reference: the grid value nearest |scaled| (saturated), ties to even codes,
    by a search over the eight values."""
    grid = torch.tensor(GRID)
    mag = scaled.abs().clamp(max=6.0)
    dist = (mag[..., None] - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    # among the nearest, the even code; codes 0-7 are the grid's indices
    tied = dist == best
    even = tied & (torch.arange(8) % 2 == 0)
    index = torch.where(even.any(-1), even.float().argmax(-1), tied.float().argmax(-1))
    return torch.where(torch.signbit(scaled), -grid[index], grid[index])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_data_against_an_independent_search(dtype):
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(3, 5, 256, generator=gen)
         * torch.logspace(-3, 3, 8).repeat_interleave(32)).to(dtype)
    q, s = quant.mxfp4(t)
    assert q.shape == (3, 5, 128) and s.shape == (3, 5, 8)
    out = quant.dequant_mxfp4(q, s)
    blocks = t.float().reshape(3, 5, 8, 32)
    amax = blocks.abs().amax(-1)
    scale = 2.0 ** (torch.floor(torch.log2(amax)) - 2)
    expected = _nearest_even(blocks / scale[..., None]) * scale[..., None]
    assert torch.equal(out, expected.reshape(3, 5, 256))
    # and within one scale step of the input (the largest grid step is 2 scales, saturation
    # past 6 loses less than 2)
    assert ((out - t.float()).abs().reshape(3, 5, 8, 32) <= 2 * scale[..., None]).all()


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quant.mxfp4(torch.ones(2, 48))
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        quant.mxfp4(torch.ones(2, 64, dtype=torch.int8))
    q, s = quant.mxfp4(torch.ones(2, 64))
    with pytest.raises(ValueError, match="do not match"):
        quant.dequant_mxfp4(q, s[:, :1])
    with pytest.raises(ValueError, match="uint8"):
        quant.dequant_mxfp4(q.to(torch.int16), s)


def test_every_code_decodes_to_its_grid_value():
    """The computed decode (no table) gives the 16 codes' values exactly, -0 for code 8."""
    from gemmtune.kernels.mxfp4 import MAGNITUDES, e2m1_values
    values = e2m1_values(torch.arange(16, dtype=torch.uint8))
    want = torch.tensor(MAGNITUDES + tuple(-m for m in MAGNITUDES))
    assert torch.equal(values, want) and torch.signbit(values[8])


@pytest.mark.gpu
def test_quantise_and_dequantise_inside_a_cuda_graph():
    """Neither copies a host-made tensor, which a CUDA graph's capture would refuse."""
    t = torch.randn(8, 64, device="cuda")
    q, s = quant.mxfp4(t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q2, s2 = quant.mxfp4(t)
        back = quant.dequant_mxfp4(q2, s2)
    graph.replay()
    assert torch.equal(q2, q) and torch.equal(s2, s)
    assert torch.equal(back, quant.dequant_mxfp4(q, s))


def test_prepack_gathers_each_threads_codes_into_a_word_and_unpack_undoes_it():
    """Word t of block j holds the block's elements 2 t + 8 r and 2 t + 8 r + 1 (r = 0-3, as
    codes 2 r and 2 r + 1: thread t's share of an MMA operand), and within each row's 64-byte
    groups it is stored at word 4 t + j (a thread's words of 4 blocks: 16 contiguous bytes).
    In each word, code i's magnitude bits sit at bits PLACES[i][0] on and its sign at bit
    PLACES[i][1] (code 0 on bits 6-8 and 15: a bf16's exponent-and-mantissa bits of the value
    times 2^-126). unpack_mxfp4 gives the codes back, also from the layout's versions 1 and 2
    (what older state_dicts hold)."""
    from gemm_checks import older_packed_layout
    from gemmtune.kernels import mxfp4

    wq = torch.randint(0, 256, (3, 128), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(3))
    ws = torch.zeros(3, 8, dtype=torch.uint8)
    packed, scales = quant.prepack_mxfp4(wq, ws)
    assert scales is ws and packed.shape == wq.shape and packed.is_contiguous()
    words = lambda t: [int.from_bytes(bytes(t[i:i + 4].tolist()), "little")
                       for i in range(0, t.numel(), 4)]
    element = lambda row, e: int(wq[row, e // 2]) >> (4 * (e % 2)) & 15  # as quantised
    for row in range(3):
        stored = words(packed[row])
        for group in range(2):
            for j in range(4):
                block = 32 * (4 * group + j)
                for t in range(4):
                    word = stored[group * 16 + 4 * t + j]
                    for i, (magnitude, sign) in enumerate(mxfp4.PLACES):
                        code = element(row, block + 2 * t + 8 * (i // 2) + i % 2)
                        assert word >> magnitude & 7 == code & 7
                        assert word >> sign & 1 == code >> 3
    assert sorted(b for place in mxfp4.PLACES for b in (place[0], place[0] + 1, place[0] + 2,
                                                          place[1])) == list(range(32))
    unpacked, scales = quant.unpack_mxfp4(packed, ws)
    assert scales is ws and torch.equal(unpacked, wq)
    for layout in (1, 2):
        assert torch.equal(quant.unpack_mxfp4(older_packed_layout(wq, layout), ws,
                                              layout=layout)[0], wq)
    with pytest.raises(ValueError, match="layout=4: the packed layouts are \\(1, 2, 3\\)"):
        quant.unpack_mxfp4(packed, ws, layout=4)


def test_prepack_refuses_what_has_no_packed_layout():
    wq, ws = quant.mxfp4(torch.randn(4, 96))
    with pytest.raises(ValueError, match="^prepack_mxfp4: K=96 is not a multiple of 128"):
        quant.prepack_mxfp4(wq, ws)
    wq, ws = quant.mxfp4(torch.randn(4, 128))
    with pytest.raises(ValueError, match="do not belong together"):
        quant.prepack_mxfp4(wq, ws[:, :2])
    with pytest.raises(ValueError, match="uint8"):
        quant.prepack_mxfp4(wq.to(torch.int16), ws)
    with pytest.raises(ValueError, match="^unpack_mxfp4: K=96 is not a multiple of 128"):
        quant.unpack_mxfp4(*quant.mxfp4(torch.randn(4, 96)))
    with pytest.raises(ValueError, match="do not belong together"):
        quant.unpack_mxfp4(wq, ws[:, :2])

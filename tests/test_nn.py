"""TunedLinear's eager path: the op's bound calls, reached with the layer's own parameters, and
every way a layer's weight or bias can change under it."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

import gemmtune
import gemmtune.nn as tuned_nn
from gemm_checks import older_packed_layout


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    gemmtune.reset()
    yield
    gemmtune.reset()


@pytest.fixture
def op_calls(monkeypatch):
    """The calls that went through gemm_a16w16 from a TunedLinear (the layer's slow way)."""
    seen = []
    real = tuned_nn.gemm_a16w16

    def counting(x, w, bias=None, *args, **kwargs):
        seen.append(tuple(x.shape))
        return real(x, w, bias, *args, **kwargs)

    monkeypatch.setattr(tuned_nn, "gemm_a16w16", counting)
    return seen


def layer(n=24, k=40, bias=True, dtype=torch.float32):
    torch.manual_seed(1)
    lin = nn.Linear(k, n, bias=bias, dtype=dtype)
    gemmtune.patch_linear(lin)
    return lin


def x_of(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def expect(lin, x):
    return F.linear(x, lin.weight, lin.bias)


@torch.no_grad()
def test_a_repeated_shape_is_served_without_the_op(op_calls):
    lin = layer()
    for shape in [(3, 40), (3, 40), (2, 5, 40), (3, 40), (2, 5, 40)]:
        x = x_of(*shape)
        torch.testing.assert_close(lin(x), expect(lin, x))
    assert op_calls == [(3, 40), (2, 5, 40)]  # one first call per input shape


@torch.no_grad()
def test_changed_tables_send_the_next_call_through_the_op(op_calls):
    lin = layer()
    x = x_of(3, 40)
    lin(x)
    gemmtune.reset()
    torch.testing.assert_close(lin(x), expect(lin, x))
    lin(x)
    assert op_calls == [(3, 40), (3, 40)]


@torch.no_grad()
def test_another_weight_or_bias_object_is_the_one_used(op_calls):
    lin = layer()
    x = x_of(3, 40)
    lin(x)
    lin.weight = nn.Parameter(torch.randn(24, 40))
    torch.testing.assert_close(lin(x), expect(lin, x))
    lin.bias = nn.Parameter(torch.randn(24))
    torch.testing.assert_close(lin(x), expect(lin, x))
    lin._parameters["bias"] = nn.Parameter(torch.randn(24))  # as accelerate's loaders do
    torch.testing.assert_close(lin(x), expect(lin, x))
    # Alike in shape, dtype and device: the bound call serves them all, with the new tensors.
    assert op_calls == [(3, 40)]


@torch.no_grad()
def test_a_weight_changed_in_place_is_checked_again(op_calls):
    lin = layer()
    x = x_of(3, 40)
    lin(x)
    weight, bias = lin.weight, lin.bias
    weight.data = torch.randn(32, 40)  # the same Parameters, other shapes
    bias.data = torch.randn(32)
    torch.testing.assert_close(lin(x), expect(lin, x))
    assert lin(x).shape == (3, 32) and op_calls == [(3, 40), (3, 40)]
    torch.utils.swap_tensors(weight, nn.Parameter(torch.randn(32, 40, dtype=torch.bfloat16)))
    with pytest.raises(TypeError, match="cast one to match"):  # the op's check, not a kernel
        lin(x)
    bias.data = torch.randn(32, dtype=torch.bfloat16)
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(lin(xb), expect(lin, xb))


@torch.no_grad()
def test_converting_the_layer_in_place_is_checked_again():
    lin = layer()
    x = x_of(3, 40)
    lin(x)
    weight = lin.weight
    lin.to(torch.bfloat16)  # the same Parameter object, its data converted
    assert lin.weight is weight and lin.weight.dtype == torch.bfloat16
    xb = x.to(torch.bfloat16)
    y = lin(xb)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expect(lin, xb))
    # An input of the old dtype is the op's error again, as it is F.linear's.
    with pytest.raises(TypeError, match="cast one to match"):
        lin(x)


@torch.no_grad()
def test_a_pruned_layer_uses_its_masked_weight():
    lin = layer()
    x = x_of(3, 40)
    lin(x)
    prune.l1_unstructured(lin, "weight", amount=0.5)  # weight becomes a plain attribute
    assert "weight" not in lin._parameters
    want = F.linear(x, lin.weight_orig * lin.weight_mask, lin.bias)
    torch.testing.assert_close(lin(x), want)
    torch.testing.assert_close(lin(x), want)


@torch.no_grad()
def test_no_bias_layers_and_an_added_plain_bias(op_calls):
    lin = layer(bias=False)
    x = x_of(3, 40)
    torch.testing.assert_close(lin(x), x @ lin.weight.T)
    torch.testing.assert_close(lin(x), x @ lin.weight.T)
    assert op_calls == [(3, 40)]
    del lin.bias
    lin.bias = torch.randn(24)  # a plain tensor: in the instance's dict, not a parameter
    torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias)


def test_gradients_flow_through_a_patched_layer():
    lin = layer()
    x = x_of(3, 40).requires_grad_()
    with torch.no_grad():
        lin(x)  # a layer that has kept a bound call
    lin(x).sum().backward()
    ref = nn.Linear(40, 24)
    ref.load_state_dict(lin.state_dict())
    xr = x.detach().clone().requires_grad_()
    ref(xr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


@torch.no_grad()
def test_copies_and_pickles_of_a_layer_that_ran_still_run():
    lin = layer()
    x = x_of(3, 40)
    lin(x)
    torch.testing.assert_close(copy.deepcopy(lin)(x), expect(lin, x))
    buffer = io.BytesIO()
    torch.save(lin, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False)(x), expect(lin, x))
    torch.testing.assert_close(pickle.loads(pickle.dumps(lin))(x), expect(lin, x))


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


@torch.no_grad()
def test_a_parametrized_layer_uses_its_computed_weight():
    from torch.nn.utils import parametrize

    lin = layer()
    x = x_of(3, 40)
    lin(x)
    parametrize.register_parametrization(lin, "weight", _Doubled())  # a subclass, a property
    want = F.linear(x, 2 * lin.parametrizations.weight.original, lin.bias)
    torch.testing.assert_close(lin(x), want)
    torch.testing.assert_close(lin(x), want)


# --- patch_linear(quant="mxfp4") ----------------------------------------------------------


def _mlp(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 40, bias=False),
                         nn.Linear(40, 32)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp4_layers_run_the_quantised_weights(dtype):
    """Every Linear whose in_features is a multiple of 32 holds its weight in MXFP4 (the float
    weight gone) and computes with it; the one of 40 stays a TunedLinear; output in x's dtype."""
    model = _mlp(dtype)
    weights = [m.weight.detach().clone() for m in model if isinstance(m, nn.Linear)]
    seen = []
    model[0].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    assert gemmtune.patch_linear(model, quant="mxfp4") == 3
    first, second, third = model[0], model[2], model[3]
    assert isinstance(first, gemmtune.Mxfp4Linear) and isinstance(second, gemmtune.Mxfp4Linear)
    assert type(third) is gemmtune.TunedLinear  # in_features 40: not a whole MXFP4 block
    assert "weight" not in dict(first.named_parameters())
    assert set(first.state_dict()) == {"weight_q", "weight_scale", "weight_layout", "bias"}
    assert first.weight_q.shape == (96, 32) and first.weight_scale.shape == (96, 2)
    x = torch.randn(5, 64).to(dtype)
    y = model(x)
    assert y.dtype == dtype and seen == [(5, 96)]  # the module object kept its hook
    h = torch.relu(x.float() @ gemmtune.quant.dequant_mxfp4(first.weight_q, first.weight_scale).T
                   + first.bias.float())
    h = h.to(dtype).float() @ gemmtune.quant.dequant_mxfp4(second.weight_q,
                                                           second.weight_scale).T
    ref = h.to(dtype).float() @ weights[2].float().T + third.bias.float()
    assert ((y.float() - ref).norm() / ref.norm()).item() < 2e-2
    # It computed with the 4-bit weights: the float weights' model is 5x further from it.
    h = torch.relu(x.float() @ weights[0].float().T + first.bias.float())
    exact = (h.to(dtype).float() @ weights[1].float().T).to(dtype).float() \
        @ weights[2].float().T + third.bias.float()
    assert (y.float() - exact).norm() > 5 * (y.float() - ref).norm()


def test_mxfp4_refuses_fp32_weights_before_changing_anything():
    model = _mlp(torch.float32)
    with pytest.raises(TypeError, match="cast the model first"):
        gemmtune.patch_linear(model, quant="mxfp4")
    assert all(type(m) is nn.Linear for m in model if isinstance(m, nn.Linear))
    with pytest.raises(ValueError, match="quant='fp4'"):
        gemmtune.patch_linear(model, quant="fp4")


def test_mxfp4_layers_pass_gradients_to_their_inputs():
    model = _mlp()
    gemmtune.patch_linear(model, quant="mxfp4")
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    model(x).float().sum().backward()
    assert x.grad is not None and x.grad.shape == (3, 64) and x.grad.abs().sum() > 0
    assert model[0].bias.grad is not None


def test_mxfp4_leaves_the_model_as_it_was_when_a_layer_cannot_take_its_buffers():
    model = _mlp()
    model[2].weight_q = torch.zeros(1)  # a name the MXFP4 weight would take
    with pytest.raises(ValueError, match="already has weight_q"):
        gemmtune.patch_linear(model, quant="mxfp4")
    assert all(type(m) is nn.Linear and "weight" in dict(m.named_parameters())
               for m in (model[0], model[2], model[3]))


def test_mxfp4_layers_follow_autocast_as_linear_does():
    """fp32 activations under torch.autocast(bf16): cast to bf16, as nn.Linear's are."""
    model = _mlp()
    gemmtune.patch_linear(model, quant="mxfp4")
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model[0](x)
    assert y.dtype == torch.bfloat16
    want = model[0](x.to(torch.bfloat16))
    assert torch.equal(y, want)


def _two_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 96), nn.Linear(96, 64)).to(torch.bfloat16)


def test_mxfp4_weights_are_packed_where_the_table_tuned_packed_rows(tmp_path, monkeypatch):
    """A layer whose (N, K) and dtype have packed rows in the a16w4 table stores its weight
    packed (prepack_mxfp4) and calls gemm_a16w4(..., packed=True); the others stay as quantised;
    both compute the same as an unpacked copy."""
    from gemm_checks import install_user_table

    header = ("arch,cu_num,M,N,K,dtype,packed,libtype,solidx,splitK,us,kernelName,err_ratio,"
              "tflops,bw\n")
    install_user_table(monkeypatch, tmp_path / "a16w4.csv", "GEMMTUNE_CONFIG_A16W4", header,
                       [(1, 96, 128, "torch.bfloat16", True,
                         "triton.w4frag:BM8.BK128.SK1.P0.R0.L1"),
                        (1, 96, 128, "torch.bfloat16", False, "torch.dequant_linear")])
    model = _two_layers()
    plain = copy.deepcopy(model)
    gemmtune.patch_linear(model, quant="mxfp4")
    monkeypatch.setenv("GEMMTUNE_CONFIG_A16W4", f"replace:{tmp_path / 'none.csv'}")
    (tmp_path / "none.csv").write_text(header)
    gemmtune.reset()
    gemmtune.patch_linear(plain, quant="mxfp4")
    assert model[0].weight_packed and not model[1].weight_packed  # K = 96: no packed layout
    assert not plain[0].weight_packed
    assert "packed" in repr(model[0])
    assert torch.equal(gemmtune.quant.unpack_mxfp4(model[0].weight_q, model[0].weight_scale)[0],
                       plain[0].weight_q)
    x = torch.randn(3, 128).to(torch.bfloat16)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    # The layout travels with the codes: a state_dict saved packed, loaded into a model patched
    # where the table has no packed rows, is read packed (and the other way round).
    plain.load_state_dict(model.state_dict())
    assert plain[0].weight_packed
    # Saved before layouts were recorded: loaded as this layer stores its codes, with a
    # warning; packed then was the layout's first version (the words only transposed).
    from gemmtune.kernels import mxfp4

    older = {k: v for k, v in model.state_dict().items() if not k.endswith("weight_layout")}
    # the layout's first version: the words transposed
    older["0.weight_q"] = older_packed_layout(mxfp4.unpack(older["0.weight_q"]), 1)
    with pytest.warns(UserWarning, match="without 0.weight_layout"):
        assert model.load_state_dict(older, strict=False).missing_keys == ["0.weight_layout",
                                                                          "1.weight_layout"]
    assert model[0].weight_packed
    torch.testing.assert_close(plain(x), model(x), rtol=0, atol=0)
    gemmtune.patch_linear(again := copy.deepcopy(_two_layers()), quant="mxfp4")
    model.load_state_dict(again.state_dict())
    assert not model[0].weight_packed
    torch.testing.assert_close(model(x), again(x), rtol=0, atol=0)
    # Saved packed by an earlier gemmtune (layout 1: the words only transposed; 2: their bits
    # placed too): converted to the present packed layout as it loads, and computing the same.
    state = plain.state_dict()
    assert int(state["0.weight_layout"]) == mxfp4.PACKED_LAYOUT
    quantised = mxfp4.unpack(state["0.weight_q"])
    for layout in (1, 2):
        older = dict(state, **{"0.weight_q": older_packed_layout(quantised, layout),
                               "0.weight_layout": torch.tensor(layout, dtype=torch.uint8)})
        model.load_state_dict(older)
        assert model[0].weight_packed and int(model[0].weight_layout) == mxfp4.PACKED_LAYOUT
        assert torch.equal(mxfp4.unpack(model[0].weight_q), quantised)
        torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
    unknown = dict(state, **{"0.weight_layout": torch.tensor(7, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="0.weight_layout is 7: .* layouts \\[0, 1, 2, 3\\]"):
        model.load_state_dict(unknown)


@pytest.mark.parametrize("rows, packs", [
    # packed rows faster where both layouts were timed
    ([(1, True, "triton.w4frag:BM8.BK128.SK1.P0.R0.L1", 5.0),
      (1, False, "torch.dequant_linear", 9.0)], True),
    # packed rows slower in all
    ([(1, True, "triton.w4frag:BM8.BK128.SK1.P0.R0.L1", 5.0),
      (16, True, "triton.w4frag:BM16.BK128.SK1.P0.R0.L1", 9.0),
      (1, False, "triton.w4frag:BM8.BK128.SK1", 6.0),
      (16, False, "triton.w4frag:BM16.BK128.SK1", 6.0)], False),
    # the packed winner is the unpacking torch backend: every call would unpack
    ([(1, True, "torch.unpack_dequant_linear", 5.0), (1, False, "torch.dequant_linear", 9.0)],
     False),
    # packed rows only: the weight takes the layout its rows are for
    ([(1, True, "triton.w4frag:BM8.BK128.SK1.P0.R0.L1", 5.0)], True),
    # no M with rows of both layouts: the layout whose rows cover more M
    ([(1, True, "triton.w4frag:BM8.BK128.SK1.P0.R0.L1", 5.0),
      (8, False, "triton.w4frag:BM8.BK128.SK1", 9.0),
      (16, False, "triton.w4frag:BM16.BK128.SK1", 9.0)], False),
    ([(1, True, "triton.w4frag:BM8.BK128.SK1.P0.R0.L1", 5.0),
      (8, True, "triton.w4frag:BM8.BK128.SK1.P0.R0.L1", 5.0),
      (16, False, "triton.w4frag:BM16.BK128.SK1", 4.0)], True),
    # each M's two rows from one GPU model: at M = 1 a faster card's packed row beside a slower
    # one's as quantised is left out, and at M = 64 (one card) the packed row is slower
    ([(1, True, "triton.w4frag:BM8.BK128.SK1.P0.R0.L1", 5.0, "H200"),
      (1, False, "triton.w4frag:BM8.BK128.SK1", 20.0, "H100"),
      (64, True, "triton.w4wg:BN64.BM64.W4.S3.L1.O1", 30.0, "H100"),
      (64, False, "triton.w4wg:BN64.BM64.W4.S3.L0.O1", 20.0, "H100")], False),
    ([(1, True, "triton.w4frag:BM8.BK128.SK1.P0.R0.L1", 5.0, "H200"),
      (1, False, "triton.w4frag:BM8.BK128.SK1", 6.0, "H200"),
      (64, True, "triton.w4wg:BN64.BM64.W4.S3.L1.O1", 30.0, "H100"),
      (64, False, "triton.w4wg:BN64.BM64.W4.S3.L0.O1", 30.0, "H100")], True),
])
def test_mxfp4_layout_follows_the_faster_rows(tmp_path, monkeypatch, rows, packs):
    from gemmtune.families.a16w4.op import packed_layout_tuned

    dev = gemmtune.current_device()
    path = tmp_path / "a16w4.csv"
    header = "arch,cu_num,gpu,M,N,K,dtype,packed,libtype,solidx,splitK,us,kernelName\n"
    path.write_text(header + "".join(
        f"{dev.arch},{dev.cu_num},{gpu},{m},96,128,torch.bfloat16,{packed},x,0,0,{us},{name}\n"
        for m, packed, name, us, gpu in (row + ("",) * (5 - len(row)) for row in rows)))
    monkeypatch.setenv("GEMMTUNE_CONFIG_A16W4", f"replace:{path}")
    gemmtune.reset()
    assert packed_layout_tuned(96, 128, torch.bfloat16) is packs
    assert packed_layout_tuned(96, 96, torch.bfloat16) is False  # K without a packed layout
    assert packed_layout_tuned(64, 128, torch.bfloat16) is False  # no rows


_FRAG_L1 = "triton.w4frag:BM8.BK128.SK1.P0.R0.L1"
_FRAG_L0 = "triton.w4frag:BM8.BK128.SK1"


@pytest.mark.parametrize("device, rows, packs", [
    # this GPU's own pair at an M beats another model's pair there
    ("cpu:0:H200", [(1, True, 5.0, "H200"), (1, False, 6.0, "H200"),
                    (1, True, 7.0, "H100"), (1, False, 5.0, "H100")], True),
    # other Ms still count, each by the pair of one model: H100's at M = 64 outweighs
    ("cpu:0:H200", [(1, True, 5.0, "H200"), (1, False, 5.1, "H200"),
                    (64, True, 50.0, "H100"), (64, False, 30.0, "H100")], False),
    # a card with neither model's rows: the H200's packed row is faster than the H100's at
    # M = 1, but only the H100 has both layouts there
    ("cpu:0:H800", [(1, True, 5.0, "H100"), (1, False, 6.0, "H100"), (1, True, 4.0, "H200"),
                    (16, True, 10.0, "H100"), (16, False, 8.0, "H100")], False),
    ("cpu:0:H800", [(1, True, 5.0, "H100"), (1, False, 6.0, "H100"), (1, True, 7.0, "H200")],
     True),
    # no model has both layouts anywhere: the rows dispatch takes, compared as they are
    ("cpu:0:H200", [(1, True, 4.0, "H200"), (1, False, 6.0, "H100")], True),
    ("cpu:0:H200", [(1, True, 7.0, "H200"), (1, False, 6.0, "")], False),
    # rows of no named model pair among themselves
    ("cpu:0:H200", [(1, True, 5.0, ""), (1, False, 6.0, ""), (1, True, 9.0, "H100")], True),
])
def test_mxfp4_layout_compares_one_gpu_models_rows_at_each_m(tmp_path, monkeypatch, device,
                                                               rows, packs):
    from gemmtune.families.a16w4.op import packed_layout_tuned

    path = tmp_path / "a16w4.csv"
    header = "arch,cu_num,gpu,M,N,K,dtype,packed,libtype,solidx,splitK,us,kernelName\n"
    path.write_text(header + "".join(
        f"cpu,0,{gpu},{m},96,128,torch.bfloat16,{packed},x,0,0,{us},"
        f"{_FRAG_L1 if packed else _FRAG_L0}\n" for m, packed, us, gpu in rows))
    monkeypatch.setenv("GEMMTUNE_CONFIG_A16W4", f"replace:{path}")
    monkeypatch.setenv("GEMMTUNE_DEVICE", device)
    gemmtune.reset()
    try:
        assert packed_layout_tuned(96, 128, torch.bfloat16) is packs
    finally:
        monkeypatch.delenv("GEMMTUNE_DEVICE")
        gemmtune.reset()


def test_patched_layers_take_their_input_by_nn_linears_name():
    """``layer(input=x)`` works on an nn.Linear, so on both kinds of patched layers too."""
    model = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 8)).to(torch.bfloat16)
    gemmtune.patch_linear(model, quant="mxfp4")  # in_features 40: not a whole MXFP4 block
    assert isinstance(model[0], gemmtune.Mxfp4Linear) and type(model[1]) is gemmtune.TunedLinear
    x = torch.randn(3, 64).to(torch.bfloat16)
    h = model[0](input=x)
    assert torch.equal(h, model[0](x))
    assert torch.equal(model[1](input=h), model[1](h))

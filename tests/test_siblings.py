"""``fuse_siblings``: MXFP4 layers reading one input (q, k, v; gate, up) multiplied as one
GEMM, seen from one forward; each layer's output its columns of it, the same as unfused; the
state_dict, moves and copies kept right."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gemmtune
import gemmtune.nn as tuned_nn
import gemmtune.siblings as siblings
from gemm_checks import older_packed_layout


class _Block(nn.Module):
    """A transformer block's projections: q, k, v read x; o (same in_features) reads their
    mix; gate and up read the normed sum; down reads their product."""

    def __init__(self, bias: bool = False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(128, 128, bias=bias), \
            nn.Linear(128, 64, bias=bias), nn.Linear(128, 64, bias=bias)
        self.o = nn.Linear(128, 128, bias=bias)
        self.gate, self.up = nn.Linear(128, 256, bias=bias), nn.Linear(128, 256, bias=bias)
        self.down = nn.Linear(256, 128, bias=bias)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = x + self.o(q * torch.cat([k, v], -1))
        h = h / h.norm(dim=-1, keepdim=True)
        return h + self.down(torch.relu(self.gate(h)) * self.up(h))


@pytest.fixture
def gemms(monkeypatch):
    """(N, K) of every MXFP4 GEMM run, fused or not."""
    seen = []

    def counting(module):
        real = module.gemm_a16w4

        def gemm(x, wq, w_scale, bias=None, *args, **kwargs):
            seen.append((wq.shape[0], x.shape[-1]))
            return real(x, wq, w_scale, bias, *args, **kwargs)
        monkeypatch.setattr(module, "gemm_a16w4", gemm)

    counting(tuned_nn)
    counting(siblings)
    return seen


def _block(bias=False):
    torch.manual_seed(0)
    model = _Block(bias).to(torch.bfloat16)
    gemmtune.patch_linear(model, quant="mxfp4")
    return model


def _x(rows=5, seed=1):
    return torch.randn(rows, 128, generator=torch.Generator().manual_seed(seed)).to(
        torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
def test_layers_reading_one_input_run_as_one_gemm(gemms, bias):
    model = _block(bias)
    x = _x()
    want = model(x)
    unfused = list(gemms)
    assert len(unfused) == 7
    groups = gemmtune.fuse_siblings(model, _x(3, seed=2))
    # o has q's in_features but reads another input: not q's sibling
    assert sorted(groups) == [["gate", "up"], ["q", "k", "v"]]
    gemms.clear()
    with torch.no_grad():  # (with gradients wanted each layer runs on its own: below)
        got = model(x)
    assert sorted(gemms) == [(128, 128), (128, 256), (256, 128), (512, 128)]  # o down qkv gate_up
    # Each layer's columns of the fused product: its own dequantised weight's product
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    q = model.q(x)
    ref = x.float() @ gemmtune.quant.dequant_mxfp4(
        gemmtune.quant.unpack_mxfp4(model.q.weight_q, model.q.weight_scale)[0]
        if model.q.weight_packed else model.q.weight_q, model.q.weight_scale).T
    if bias:
        ref = ref + model.q.bias.float()
    torch.testing.assert_close(q.float(), ref, rtol=2e-2, atol=2e-2)


def test_the_layers_weights_are_rows_of_the_fused_weight_and_keep_their_names():
    model = _block(bias=True)
    keys = set(model.state_dict())
    gemmtune.fuse_siblings(model, _x())
    group = model.q.fused
    assert group is model.k.fused is model.v.fused and model.o.fused is None
    assert set(model.state_dict()) == keys
    assert model.k.weight_q.data_ptr() == group.tensor("weight_q")[128].data_ptr()
    assert model.v.weight_scale.data_ptr() == group.tensor("weight_scale")[192].data_ptr()
    assert model.v.bias.data_ptr() == group.tensor("bias")[192:].data_ptr()


def test_a_layer_served_again_or_another_input_computes_again(gemms):
    model = _block()
    gemmtune.fuse_siblings(model, _x())
    x = _x()
    gemms.clear()
    model.q(x)
    model.k(x)
    model.q(x)  # before v: q was served, so this is a new call
    assert gemms == [(256, 128), (256, 128)]
    model.v(x.clone())  # another tensor (equal values)
    x.add_(1)  # the same tensor changed in place
    model.k(x)
    assert gemms == [(256, 128)] * 4


def test_a_state_dict_loads_across_fused_and_unfused_and_either_layout(monkeypatch):
    """The fused model's state_dict loads into an unfused one and back, also where the group
    stores its weight packed and the saved codes are as quantised (converted on load)."""
    monkeypatch.setattr(siblings, "packed_layout_tuned", lambda n, k, dtype: n == 256)
    model, other = _block(), _block()
    with torch.no_grad():
        for layer in (other.q, other.k, other.v):
            layer.weight_q.copy_(layer.weight_q.flip(0))  # other weights
    gemmtune.fuse_siblings(model, _x())
    assert model.q.weight_packed and not other.q.weight_packed
    x = _x()
    want = other(x)
    model.load_state_dict(other.state_dict())
    assert model.q.weight_packed and model.q.fused is not None
    torch.testing.assert_close(model(x), want, rtol=2e-2, atol=2e-2)
    fresh = _block()
    fresh.load_state_dict(model.state_dict())  # packed codes into an unfused model
    assert fresh.q.weight_packed
    torch.testing.assert_close(fresh(x), want, rtol=2e-2, atol=2e-2)
    # Codes saved packed in the layout's earlier versions (1: words only transposed, 2: their
    # bits placed too) into the fused group (packed) and into an unfused model, and the group's
    # packed codes into a group that stores them as quantised: each converted as it loads.
    from gemmtune.kernels import mxfp4

    state = model.state_dict()
    for layout in (1, 2):
        older = dict(state)
        for name in ("q", "k", "v"):
            older[f"{name}.weight_q"] = older_packed_layout(
                mxfp4.unpack(state[f"{name}.weight_q"]), layout)
            older[f"{name}.weight_layout"] = torch.tensor(layout, dtype=torch.uint8)
        for target in (model, _block()):
            target.load_state_dict(older)
            assert target.q.weight_packed
            torch.testing.assert_close(target(x), want, rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(siblings, "packed_layout_tuned", lambda n, k, dtype: False)
    plain = _block()
    gemmtune.fuse_siblings(plain, _x())
    assert not plain.q.weight_packed and plain.q.fused is not None
    plain.load_state_dict(state)
    assert not plain.q.weight_packed
    torch.testing.assert_close(plain(x), want, rtol=2e-2, atol=2e-2)


def test_a_moved_or_copied_model_is_regrouped():
    model = _block()
    gemmtune.fuse_siblings(model, _x())
    x = _x()
    want = model(x)
    copied = copy.deepcopy(model)
    model._apply(lambda t: t.clone())  # every buffer replaced, as model.to(device) does
    old = model.q.fused.tensor("weight_q")
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    assert model.q.fused.tensor("weight_q").data_ptr() != old.data_ptr()
    assert model.k.weight_q.data_ptr() == model.q.fused.tensor("weight_q")[128].data_ptr()
    torch.testing.assert_close(copied(x), want, rtol=0, atol=0)


def test_layers_called_twice_or_by_keyword_stay_apart():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(128, 32), nn.Linear(128, 32), nn.Linear(128, 32)

        def forward(self, x):
            return self.a(x) + self.a(x) + self.b(x) + self.c(input=x)

    torch.manual_seed(0)
    model = Twice().to(torch.bfloat16)
    gemmtune.patch_linear(model, quant="mxfp4")
    assert gemmtune.fuse_siblings(model, _x()) == []  # a twice, c by keyword: b alone


def test_a_model_without_mxfp4_layers_is_refused_and_a_second_call_changes_nothing():
    plain = _Block().to(torch.bfloat16)  # not patched
    with pytest.raises(ValueError, match="patch_linear"):
        gemmtune.fuse_siblings(plain, _x())
    model = _block()
    assert len(gemmtune.fuse_siblings(model, _x())) == 2
    group = model.q.fused
    assert gemmtune.fuse_siblings(model, _x()) == [] and model.q.fused is group


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_layers_fuse_the_same_way(monkeypatch, bias):
    """TunedLinear siblings (patch_linear without quant): one gemm_a16w16 per group, the
    weights rows of the fused one, the same outputs."""
    shapes = []
    real = siblings.gemm_a16w16

    def counting(x, w, b=None, *args, **kwargs):
        shapes.append(tuple(w.shape))
        return real(x, w, b, *args, **kwargs)

    monkeypatch.setattr(siblings, "gemm_a16w16", counting)
    torch.manual_seed(0)
    model = _Block(bias).to(torch.bfloat16)
    gemmtune.patch_linear(model)
    x = _x()
    want = model(x)
    assert sorted(gemmtune.fuse_siblings(model, _x(3, seed=2))) == [["gate", "up"],
                                                                    ["q", "k", "v"]]
    shapes.clear()
    with torch.inference_mode():  # serving's context: inference tensors, no version counter
        torch.testing.assert_close(model(x), want, rtol=1e-2, atol=1e-2)
    assert sorted(shapes) == [(256, 128), (512, 128)]  # qkv and gate_up; o and down on their own
    assert isinstance(model.k.weight, nn.Parameter)
    assert model.k.weight.data_ptr() == model.q.fused.tensor("weight")[128].data_ptr()
    keys = set(model.state_dict())
    fresh = _Block(bias).to(torch.bfloat16)
    fresh.load_state_dict(model.state_dict())
    assert set(fresh.state_dict()) == keys
    torch.testing.assert_close(fresh(x), want, rtol=1e-2, atol=1e-2)


def test_with_gradients_wanted_each_layer_runs_on_its_own_and_gets_them():
    """Training through fused layers: the parameters keep their objects (an optimizer made
    before fusing still holds them) and get the gradients the unfused model gives them."""
    torch.manual_seed(0)
    model = _Block(bias=True).to(torch.bfloat16)
    gemmtune.patch_linear(model)
    plain = copy.deepcopy(model)
    params = [id(p) for p in model.parameters()]
    gemmtune.fuse_siblings(model, _x())
    assert [id(p) for p in model.parameters()] == params
    x = _x()
    for m in (model, plain):
        m(x).float().square().sum().backward()
    for name in ("q", "k", "v", "gate", "up"):
        for attr in ("weight", "bias"):
            mine, want = getattr(getattr(model, name), attr), getattr(getattr(plain, name), attr)
            torch.testing.assert_close(mine.grad, want.grad, rtol=1e-2, atol=1e-2)
    with torch.no_grad():  # an update through the layer's own parameter reaches the group
        model.k.weight.add_(1)
        torch.testing.assert_close(model.k(x), plain.k(x) + x.sum(-1, keepdim=True),
                                   rtol=2e-2, atol=2e-1)


def test_autocast_from_fp32_runs_one_gemm_a_group(gemms):
    model = _block()
    gemmtune.fuse_siblings(model, _x())
    gemms.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model(_x().float())  # each layer casts its own copy of x: the group keys the uncast one
    assert sorted(gemms) == [(128, 128), (128, 256), (256, 128), (512, 128)]


def test_a_member_cast_apart_dissolves_its_group():
    torch.manual_seed(0)
    model = _Block().to(torch.bfloat16)
    gemmtune.patch_linear(model)
    gemmtune.fuse_siblings(model, _x())
    model.k.half()
    x = _x()
    with torch.no_grad():
        out = model.q(x)
    assert model.q.fused is None and model.k.fused is None
    assert model.q.weight.dtype == torch.bfloat16 and model.k.weight.dtype == torch.float16
    assert out.dtype == torch.bfloat16


def test_a_tied_weight_stays_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(128, 32), nn.Linear(128, 32), nn.Linear(128, 32)
            self.c.weight = self.a.weight

        def forward(self, x):
            return self.a(x) + self.b(x) + self.c(x)

    torch.manual_seed(0)
    model = Tied().to(torch.bfloat16)
    gemmtune.patch_linear(model)
    assert gemmtune.fuse_siblings(model, _x()) == []  # a and c share a weight: b alone
    assert model.c.weight is model.a.weight


def test_the_group_holds_no_weight_and_frees_an_input_a_round_left():
    import gc

    model = _block()
    gemmtune.fuse_siblings(model, _x())
    group = model.q.fused
    x = _x()
    with torch.no_grad():
        model.q(x)  # k and v never called
    assert group._y is not None
    del x
    gc.collect()
    assert group._y is None  # the product went with its input
    assert not [v for v in vars(group).values() if isinstance(v, torch.Tensor)]

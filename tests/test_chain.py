"""Recorded chains of Triton launches (``kernels/triton/_chain.py``): what a replay launches with,
what a recording refuses (so the call runs its function every time) and when a replay declines
a call; on the GPU, ``fused_moe``'s eager calls replayed against the plain path bit for bit."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch

from gemmtune.kernels.triton import _chain, _checks, _replay
from gemmtune.kernels.triton._chain import ChainCall

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _FakeCompiled:
    """A compiled kernel whose launcher notes each launch (grid, stream, arguments)."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, launches: list):
        self._launches = launches
        self.run = self._run

    def __getitem__(self, grid):
        return lambda *args: None

    def _run(self, *launch):
        grid, stream, between, args = launch[:3], launch[3], launch[4:9], launch[9:]
        assert between == ("function", "metadata", None, None, None)
        self._launches.append((self._name, grid, stream, args))


class _FakeKernel:
    """A @triton.jit function as ``_checks.start`` uses it: ``kernel[grid](*args, **kw)``
    launches (noting the tensors it got) and returns its compiled kernel."""

    def __init__(self, name: str, arg_names: list[str], launches: list):
        self.arg_names = arg_names
        self.compiled = _FakeCompiled(launches)
        self.compiled._name = name
        self.direct = []  # the calls the usual way

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.direct.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture(autouse=True)
def _stream_zero(request, monkeypatch):
    """The CPU has no stream: there the current one is 0 (the GPU tests keep the real one)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(_replay, "current_stream", lambda device: 0)
        monkeypatch.setattr(_replay, "direct_launch", lambda compiled: None)


class _Chain:
    """Two launches as a fused MoE makes them: ``first`` writes a buffer of the call's own from
    x and w, ``second`` reads it into a new output; ``before``: host work before them."""

    def __init__(self, before=None, buffer_bytes: int = 64):
        self.launches = []
        self.first = _FakeKernel("first", ["x_ptr", "w_ptr", "buf_ptr", "n", "BLOCK"],
                                 self.launches)
        self.second = _FakeKernel("second", ["buf_ptr", "out_ptr", "n", "ACT"], self.launches)
        self.before = before
        self.buffer_bytes = buffer_bytes
        self.buffers = []

    def __call__(self, roles):
        x, w = roles
        if self.before is not None:
            self.before(roles)
        buf = torch.empty(self.buffer_bytes // 4, dtype=torch.float32)
        self.buffers.append(buf)
        out = torch.empty(x.shape[0], 8)
        _checks.start(self.first, (3, 2), False)(x, w, buf, x.shape[0], BLOCK=16)
        _checks.start(self.second, (3,), False, launch_pdl=True)(buf.view(-1, 4), out,
                                                                 x.shape[0], ACT=1)
        return out


def _roles():
    return torch.randn(4, 8), torch.randn(6, 8)


def _recorded(chain=None):
    """A ChainCall that has recorded one call of ``chain``: (it, the chain, the output)."""
    chain = chain or _Chain()
    call = ChainCall(chain, 0)
    roles = _roles()
    out = call(roles)
    assert call.refusal is None, call.refusal
    return call, chain, roles, out


def test_the_recorded_call_runs_as_usual_and_returns_its_output():
    call, chain, (x, w), out = _recorded()
    (grid, args, kwargs), = chain.first.direct
    assert grid == (3, 2) and args[0] is x and args[1] is w and kwargs == {"BLOCK": 16}
    (_, args, kwargs), = chain.second.direct
    assert args[1] is out and kwargs == {"ACT": 1, "launch_pdl": True}
    assert not chain.launches  # nothing replayed yet


def test_a_replay_puts_new_tensors_in_the_roles_keeps_its_buffers_and_makes_a_new_output():
    call, chain, _, first_out = _recorded()
    x2, w2 = _roles()
    out = call((x2, w2))
    assert len(chain.first.direct) == 1  # the function did not run again
    (first, grid1, stream1, args1), (second, grid2, stream2, args2) = chain.launches
    assert (first, grid1, second, grid2) == ("first", (3, 2, 1), "second", (3, 1, 1))
    assert stream1 == stream2 == 0
    buf = chain.buffers[0]
    assert args1 == (x2.data_ptr(), w2.data_ptr(), buf.data_ptr(), 4, 16)
    assert args2 == (buf.data_ptr(), out.data_ptr(), 4, 1)
    assert out.shape == (4, 8) and out.dtype == torch.float32
    assert out.data_ptr() != first_out.data_ptr()


def test_a_replayed_calls_buffers_stay_alive_with_the_recording():
    call, chain, _, _ = _recorded()
    address = chain.buffers[0].data_ptr()
    chain.buffers.clear()
    call(_roles())
    assert chain.launches[0][3][2] == address
    assert any(t.data_ptr() == address for t in call._recording._kept)


@pytest.mark.parametrize("before, why", [
    (lambda roles: torch.zeros(3), "aten.zeros"),  # a fill each call would need
    (lambda roles: roles[0].sum(), "aten.sum"),
])
def test_a_call_running_other_torch_ops_is_not_recorded(before, why):
    chain = _Chain(before)
    call = ChainCall(chain, 0)
    for calls in range(1, 5):
        call(_roles())
        assert why in call.refusal
        assert len(chain.first.direct) == calls  # every call runs the function
    assert not chain.launches


def test_a_second_attempt_records_after_a_first_calls_workspace_fill():
    # The first call of a stream may make its workspaces: its fill is not the calls' after it.
    made = []

    def workspace_once(roles):
        if not made:
            made.append(torch.zeros(4))

    chain = _Chain(workspace_once)
    call = ChainCall(chain, 0)
    call(_roles())
    assert "aten.zeros" in call.refusal
    call(_roles())
    assert call.refusal is None
    call(_roles())
    assert len(chain.first.direct) == 2 and len(chain.launches) == 2


def _refusal(chain_call) -> str:
    call = ChainCall(chain_call, 0)
    call(_roles())
    return call.refusal


def test_what_a_recording_cannot_place_is_refused(monkeypatch):
    class Offset(_Chain):  # a launch reading x from its second row
        def __call__(self, roles):
            out = torch.empty(4, 8)
            _checks.start(self.second, (1,), False)(roles[0][1:], out, 3, ACT=0)
            return out

    assert "offset" in _refusal(Offset())

    class ReturnsAView(_Chain):
        def __call__(self, roles):
            return super().__call__(roles)[1:]

    assert "own its memory" in _refusal(ReturnsAView())
    assert "bytes" in _refusal(_Chain(buffer_bytes=_chain.KEPT_BYTES_MAX + 64))

    class Defaulted(_Chain):
        def __call__(self, roles):
            out = torch.empty(4, 8)
            _checks.start(self.second, (1,), False)(roles[0], out, 4)  # ACT left to its default
            return out

    assert "default" in _refusal(Defaulted())
    assert "no Triton kernel" in _refusal(lambda roles: torch.empty(4, 8))


def test_interpreted_kernels_and_descriptors_are_not_recorded():
    chain = _Chain()
    chain.first.compiled = None  # the interpreter compiles nothing
    chain.second.compiled = None
    assert "interpreted" in _refusal(chain)

    class Described(_Chain):
        def __call__(self, roles):
            from triton.tools.tensor_descriptor import TensorDescriptor

            out = torch.empty(4, 8)
            desc = TensorDescriptor(roles[0], list(roles[0].shape), [8, 1], [4, 8])
            _checks.start(self.second, (1,), False)(desc, out, 4, ACT=0)
            return out

    assert "descriptors" in _refusal(Described())


class _Described(_Chain):
    """A launch taking host TMA descriptors around x (a role) and a buffer of its own."""

    def __call__(self, roles):
        from triton.tools.tensor_descriptor import TensorDescriptor

        buf = torch.empty(16, 8)
        self.buffers.append(buf)
        out = torch.empty(4, 8)
        _checks.start(self.second, (1,), False)(
            TensorDescriptor(roles[0], [4, 8], [8, 1], [4, 8]),
            TensorDescriptor(buf, [16, 8], [8, 1], [8, 8]), out, ACT=0)
        return out


def test_descriptors_are_expanded_around_each_calls_tensor(monkeypatch):
    got = []
    monkeypatch.setattr(_replay, "direct_launch", lambda compiled: _replay.DirectLaunch(
        lambda *args: got.append(args), ("between",), [None, None]))
    chain = _Described()
    chain.second.arg_names = ["x_desc", "buf_desc", "out_ptr", "ACT"]
    call, _, _, _ = _recorded(chain)
    x2, w2 = _roles()
    out = call((x2, w2))
    buf = chain.buffers[0].data_ptr()
    # Without Triton's descriptor metadata the C launch takes each descriptor as its address,
    # shape, strides, padding, shape and strides (what the launcher's wrapper would pass).
    assert got == [(1, 1, 1, 0, "between", x2.data_ptr(), 4, 8, 8, 1, False, 4, 8, 8, 1,
                    buf, 16, 8, 8, 1, False, 16, 8, 8, 1, out.data_ptr(), 0)]


def test_a_call_that_could_not_be_recorded_spends_no_attempt():
    # A role not contiguous, or two roles of one tensor: this call's, not the next one's.
    chain = _Chain()
    call = ChainCall(chain, 0)
    x, w = _roles()
    for _ in range(3):
        call((torch.randn(8, 4).t(), w))
        call((x, x))
    assert call.refusal is None and call._recording is None and not chain.launches
    call((x, w))
    call(_roles())
    assert call._recording is not None and len(chain.launches) == 2


def test_a_refusal_given_up_front_is_kept_and_nothing_is_recorded():
    chain = _Chain()
    call = ChainCall(chain, 0, refusal="fp32 operands")
    for _ in range(3):
        call(_roles())
    assert call.refusal == "fp32 operands" and len(chain.first.direct) == 3


def test_nothing_is_recorded_or_replayed_while_a_graph_is_captured(monkeypatch):
    chain = _Chain()
    call = ChainCall(chain, 0)
    monkeypatch.setattr(_chain, "_capturing", lambda: True)
    call(_roles())
    assert call._recording is None and call.refusal is None  # no attempt spent
    monkeypatch.setattr(_chain, "_capturing", lambda: False)
    call(_roles())
    assert call._recording is not None
    monkeypatch.setattr(_chain, "_capturing", lambda: True)
    assert _declined(call, chain, _roles()) and call.declines == 0  # as meant


def test_recordings_past_the_budget_give_their_buffers_back_oldest_first(monkeypatch):
    monkeypatch.setattr(_chain, "_RECORDINGS", weakref.WeakSet())
    monkeypatch.setattr(_chain, "KEPT_BYTES_TOTAL", 2500)
    calls = [ChainCall(_Chain(buffer_bytes=1024), 0) for _ in range(3)]
    for c in calls[:2]:
        c(_roles())
    calls[0](_roles())  # replayed: now the more recently used
    calls[2](_roles())  # 3 x 1 KiB > 2500 bytes: the least recently used gives its back
    first, second, third = (c._recording for c in calls)
    assert not first.evicted and second.evicted and not third.evicted
    assert second._kept == () and second.kept_bytes == 1024
    # Its call records again when next made (and the oldest then gives way).
    calls[1](_roles())
    assert calls[1]._recording is not second and not calls[1]._recording.evicted
    assert first.evicted


def test_a_role_absent_or_present_otherwise_than_recorded_is_declined():
    class Optional(_Chain):
        def __call__(self, roles):
            x, w, scale = roles
            return super().__call__((x, w if scale is None else scale))

    chain = Optional()
    call = ChainCall(chain, 0)
    x, w = _roles()
    call((x, w, None))
    assert call._recording is not None
    assert _declined(call, chain, (x, w, torch.randn(6, 8)))
    assert not _declined(call, chain, (x, w, None))
    call2 = ChainCall(chain, 0)
    call2((x, w, torch.randn(6, 8)))
    assert _declined(call2, chain, (x, w, None))


def test_an_output_of_another_dtype_is_made_in_that_dtype():
    class Half(_Chain):
        def __call__(self, roles):
            out = torch.empty(roles[0].shape[0], 8, dtype=torch.float16)
            _checks.start(self.second, (1,), False)(roles[0], out, 4, ACT=0)
            return out

    call, chain, _, _ = _recorded(Half())
    out = call(_roles())
    assert out.dtype == torch.float16 and out.shape == (4, 8) and chain.launches


def test_a_gemm_replay_declines_while_a_chain_is_recorded():
    from gemmtune.kernels.triton._replay import KernelCall, Replay

    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    kernel = _FakeKernel("gemm", ["x_ptr", "w_ptr", "y_ptr", "M"], [])
    replay = Replay.record(KernelCall(kernel, (1,), (x, w, y, 4), {}, {}), kernel.compiled,
                           (x, w, y, None, None, None), 0)
    roles = (x, w, y, None, None, None)
    assert replay.serves(roles)
    _checks.LAUNCHES.record = lambda *args: None
    try:
        assert not replay.serves(roles) and not replay.launch_fast(roles)
    finally:
        _checks.LAUNCHES.record = None


def test_a_launch_from_another_thread_is_not_seen_by_a_recording():
    other = _Chain()

    class WithAThread(_Chain):
        def __call__(self, roles):
            thread = threading.Thread(target=other, args=(roles,))
            thread.start()
            thread.join()
            return super().__call__(roles)

    chain = WithAThread()
    call, _, _, _ = _recorded(chain)
    call(_roles())
    assert [name for name, *_ in chain.launches] == ["first", "second"]
    assert len(other.first.direct) == 1  # launched the usual way, unrecorded


def test_on_the_cpu_nothing_is_recorded():
    chain = _Chain()
    call = ChainCall(chain, -1)
    for _ in range(3):
        call(_roles())
    assert call.refusal == "the call is not on a GPU" and len(chain.first.direct) == 3


def _declined(call, chain, roles) -> bool:
    """Whether the call ran the function (not the recording)."""
    ran = len(chain.first.direct)
    call(roles)
    return len(chain.first.direct) == ran + 1


def test_a_replay_declines_a_call_it_could_not_launch_as_recorded(monkeypatch):
    call, chain, _, _ = _recorded()
    x, w = _roles()
    assert not _declined(call, chain, (x, w))
    assert _declined(call, chain, (torch.randn(8, 4).t(), w))  # not contiguous
    unaligned = torch.randn(4 * 8 + 1)[1:].view(4, 8)
    assert _declined(call, chain, (unaligned, w))  # not 16-byte aligned as recorded
    monkeypatch.setattr(_replay, "current_stream", lambda device: 5)
    assert _declined(call, chain, (x, w))  # another stream: the buffers are the recording's
    monkeypatch.setattr(_replay, "current_stream", lambda device: 0)
    monkeypatch.setattr(_replay, "no_launch_hooks", lambda: False)
    assert _declined(call, chain, (x, w))  # a profiler's hooks see only the usual launches
    monkeypatch.setattr(_replay, "no_launch_hooks", lambda: True)
    declined = []
    thread = threading.Thread(target=lambda: declined.append(_declined(call, chain, (x, w))))
    thread.start()
    thread.join()
    assert declined == [True]  # another thread: its launches could interleave with these
    assert not _declined(call, chain, (x, w))
    assert call.declines == 5


def test_no_launch_is_observed_outside_a_recording():
    chain = _Chain()
    chain(_roles())
    assert _checks.LAUNCHES.record is None and len(chain.first.direct) == 1


def test_a_failing_call_leaves_no_observer_behind():
    def broken(roles):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        ChainCall(broken, 0)(_roles())
    assert _checks.LAUNCHES.record is None


def test_the_c_launch_gets_the_recorded_grid_stream_and_arguments(monkeypatch):
    got = []
    monkeypatch.setattr(_replay, "direct_launch", lambda compiled: _replay.DirectLaunch(
        lambda *args: got.append(args), ("between",)))
    call, chain, _, _ = _recorded()
    x2, w2 = _roles()
    out = call((x2, w2))
    buf = chain.buffers[0].data_ptr()
    assert got == [(3, 2, 1, 0, "between", x2.data_ptr(), w2.data_ptr(), buf, 4, 16),
                   (3, 1, 1, 0, "between", buf, out.data_ptr(), 4, 1)]


# ---------------------------------------------------------------- GPU: fused_moe's eager calls

MOE_CASES = {
    # (tokens, model_dim, inter_dim, experts, topk, kernel)
    "pair blocks": (1, 512, 256, 16, 4, "triton.moe1:BM16.BN64.BK128.W4.S4.PB1"
                    "+triton.moe2:BM16.BN128.BK128.SK1.W4.S3.PB1"),
    "routed": (24, 512, 256, 16, 4, "triton.moe1:BM16.BN64.BK64.W4.S3"
               "+triton.moe2:BM16.BN64.BK64.SK1.W4.S3"),
    "one stage": (4, 512, 256, 16, 4, "triton.moe_1stage:BN32.BK128.BD64.BI128.W4.S4"),
    "split stage 2": (1, 512, 256, 16, 4, "triton.moe1:BM16.BN64.BK128.W4.S4.PB1"
                      "+triton.moe2:BM16.BN128.BK64.SK2.W4.S3.PB1"),
    "persistent": (64, 512, 256, 16, 4, "triton.moe1:BM64.BN64.BK64.W4.S3.PB0.P1"
                   "+triton.moe2:BM64.BN128.BK64.SK1.W8.S3.PB0.P2"),
}


def _moe_inputs(tokens, model_dim, inter_dim, experts, topk, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, model_dim, device="cuda", generator=g).to(dtype)
    w1 = (torch.randn(experts, 2 * inter_dim, model_dim, device="cuda", generator=g)
          / model_dim ** 0.5).to(dtype)
    w2 = (torch.randn(experts, model_dim, inter_dim, device="cuda", generator=g)
          / inter_dim ** 0.5).to(dtype)
    scores = torch.rand(tokens, experts, device="cuda", generator=g)
    weight, ids = torch.topk(scores, topk, dim=1)
    return hidden, w1, w2, weight.float(), ids.to(torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_fused_moe_eager_calls_replay_bit_equal_to_the_plain_path(case):
    from gemmtune.families.fmoe import op

    tokens, model_dim, inter_dim, experts, topk, kernel = MOE_CASES[case]
    calls = []
    for _ in range(4):  # new activations, routing and weights (another layer) every call
        args = _moe_inputs(tokens, model_dim, inter_dim, experts, topk)
        calls.append((args, op.fused_moe(*args, kernel=kernel)))
    chain = op.bound_call(*calls[-1][0], kernel=kernel).chain
    assert chain.refusal is None and chain._recording is not None, chain.refusal
    # The 1-stage kernel adds each token's pairs in fp32 with atomics, in the order its
    # programs finish: the same inputs may round one element of bf16 either way.
    exact = case != "one stage"
    for args, out in calls:
        plain = op._run(*args, op.ActivationType.Silu, op.QuantType.No, False, None, kernel)
        torch.testing.assert_close(out, plain, rtol=0 if exact else 2 ** -7,
                                   atol=0 if exact else 1e-3)


@pytest.mark.gpu
def test_fp8_experts_replay_bit_equal_to_the_plain_path():
    from gemmtune import quant
    from gemmtune.families.fmoe import op

    tokens, model_dim, inter_dim, experts, topk = 2, 512, 256, 16, 4
    kernel = ("triton.moe1:BM16.BN64.BK128.W4.S4.PB1"
              "+triton.moe2:BM16.BN128.BK128.SK1.W4.S3.PB1")
    outs = []
    for layer in range(3):
        hidden, w1, w2, weight, ids = _moe_inputs(tokens + layer, model_dim, inter_dim,
                                                  experts, topk)
        hidden = hidden[:tokens]
        weight, ids = weight[:tokens].contiguous(), ids[:tokens].contiguous()
        w1q, w1s = quant.quantize_experts(w1, op.QuantType.per_Token)
        w2q, w2s = quant.quantize_experts(w2, op.QuantType.per_Token)
        args = (hidden, w1q, w2q, weight, ids)
        scales = dict(w1_scale=w1s, w2_scale=w2s)
        outs.append((args, scales, op.fused_moe(*args, quant_type=op.QuantType.per_Token,
                                                kernel=kernel, **scales)))
    args, scales, _ = outs[-1]
    chain = op.bound_call(*args, quant_type=op.QuantType.per_Token, kernel=kernel,
                          **scales).chain
    assert chain.refusal is None, chain.refusal
    for args, scales, out in outs:
        plain = op._run(*args, op.ActivationType.Silu, op.QuantType.per_Token, False, None,
                        kernel, op.checked_scales(op.QuantType.per_Token, args[0], args[1],
                                                  args[2], scales["w1_scale"],
                                                  scales["w2_scale"], None, None))
        torch.testing.assert_close(out, plain, rtol=0, atol=0)


@pytest.mark.gpu
def test_a_replayed_layer_under_a_cuda_graph_runs_its_function():
    from gemmtune.families.fmoe import op

    tokens, model_dim, inter_dim, experts, topk, kernel = MOE_CASES["pair blocks"]
    args = _moe_inputs(tokens, model_dim, inter_dim, experts, topk)
    for _ in range(3):
        op.fused_moe(*args, kernel=kernel)
    static = [a.clone() for a in args]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op.fused_moe(*static, kernel=kernel)
    fresh = _moe_inputs(tokens + 1, model_dim, inter_dim, experts, topk)
    for s, f in zip(static, fresh):
        s.copy_(f[:tokens])
    graph.replay()
    eager = op.fused_moe(*static, kernel=kernel)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)

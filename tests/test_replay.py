"""Replays of a planned Triton launch (``kernels/triton/_replay.py``): which arguments a replay
swaps, when it refuses (so the call goes the slow way), and on the GPU that every replayed
call computes what a fresh launch would."""

from __future__ import annotations

import pytest
import torch
import triton

import gemmtune
from gemm_checks import install_user_table
from gemmtune.kernels.torch_ref import gemm_a16w16_ref
from gemmtune.kernels.triton import _replay
from gemmtune.kernels.triton._replay import KernelCall, Replay

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _FakeKernel:
    arg_names = ["x_ptr", "w_ptr", "y_ptr", "bias_ptr", "M", "stride_xm", "workspace", "BLOCK"]


class _FakeCompiled:
    """Records the launches made through it, as a compiled kernel's ``run`` (what a replay
    calls) and its ``[grid]`` runner (what it calls under a profiler's hooks)."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.grids, self.calls, self.launches = [], [], []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return lambda *args: self.calls.append(args)

    def run(self, *launch):
        grid, stream, function, metadata, hooks, args = (launch[:3], launch[3], launch[4],
                                                         launch[5], launch[6:9], launch[9:])
        assert (function, metadata, hooks) == ("function", "metadata", (None, None, None))
        self.launches.append((grid, stream))
        self.calls.append(args)


@pytest.fixture(autouse=True)
def _stream_zero(request, monkeypatch):
    """The CPU has no CUDA stream: there the current one is 0 unless a test says otherwise
    (the GPU tests keep the real one)."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(_replay, "current_stream", lambda device: 0)


def _recording(x, w, y, workspace=None):
    """A recording of a launch of x, w and y (x also standing in for the missing bias), made on
    the current stream."""
    call = KernelCall(_FakeKernel, (5,), (x, w, y, x, x.shape[0], x.stride(0), workspace),
                      {"BLOCK": 64}, {"num_warps": 4})
    compiled = _FakeCompiled()
    return Replay.record(call, compiled, (x, w, y, None, None, None), 0), compiled


def test_a_replay_puts_the_new_tensors_where_the_first_calls_were():
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    replay, compiled = _recording(x, w, y)
    assert compiled.grids == [(5, 1, 1)]
    x2, y2 = torch.randn(4, 8), torch.empty(4, 6)
    replay((x2, w, y2, None, None, None))
    (args,) = compiled.calls
    assert compiled.launches == [((5, 1, 1), 0)]  # the recorded grid, the current stream
    # x also stands in for the missing bias; the integers and the constexpr are kept.
    assert args[0] is x2 and args[1] is w and args[2] is y2 and args[3] is x2
    assert args[4:] == (4, 8, None, 64)


def test_a_replay_keeps_no_tensor_of_the_first_call():
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    replay, _ = _recording(x, w, y)
    assert not any(isinstance(a, torch.Tensor) for a in replay._rest)
    assert replay.stream is None  # nothing bound to a stream: served on any


def test_a_replay_serves_only_tensors_triton_would_specialise_alike():
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    replay, _ = _recording(x, w, y)
    same = (torch.randn(4, 8), w, torch.empty(4, 6), None, None, None)
    assert replay.serves(same)
    strided = torch.randn(8, 4).t()  # (4, 8) with other strides
    unaligned = torch.randn(33)[1:].view(4, 8)  # 4 bytes past an aligned start
    for x2 in (strided, unaligned, torch.randn(4, 8, dtype=torch.float64), torch.randn(5, 8)):
        assert not replay.serves((x2, w, torch.empty(4, 6), None, None, None))
    # A bias where the recording had none is another launch.
    assert not replay.serves((same[0], w, same[2], torch.randn(6), None, None))


def test_a_scale_of_another_shape_is_another_launch():
    # A per-tensor and a per-row scale can share dtype, strides and alignment; the launch's
    # scale mode follows the shape.
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    scale_a, scale_b = torch.ones(1, 1), torch.ones(1, 1)
    call = KernelCall(_FakeKernel, (5,), (x, w, y, scale_a, x.shape[0], x.stride(0), None),
                      {"BLOCK": 64}, {})
    replay = Replay.record(call, _FakeCompiled(), (x, w, y, None, scale_a, scale_b), 0)
    assert replay.serves((x, w, y, None, torch.ones(1, 1), torch.ones(1, 1)))
    assert not replay.serves((x, w, y, None, torch.ones(4, 1), torch.ones(1, 1)))


def test_a_replay_holding_its_own_buffers_serves_its_stream_only(monkeypatch):
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    workspace = torch.zeros(16)
    monkeypatch.setattr(_replay, "current_stream", lambda device: 7)
    replay, compiled = _recording(x, w, y, workspace=workspace)
    assert replay.stream == 7
    roles = (torch.randn(4, 8), w, torch.empty(4, 6), None, None, None)
    assert replay.serves(roles)
    replay(roles)
    assert compiled.calls[0][6] is workspace  # the split-K partials stay the recording's
    monkeypatch.setattr(_replay, "current_stream", lambda device: 8)
    assert not replay.serves(roles)


def test_a_profilers_launch_hooks_still_see_replayed_launches(monkeypatch):
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    replay, compiled = _recording(x, w, y)
    monkeypatch.setattr(_replay, "no_launch_hooks", lambda: False)
    replay((x, w, y, None, None, None))  # through the runner, which calls the hooks
    assert compiled.calls[0][0] is x and len(compiled.calls[0]) == 8


def test_no_replay_is_recorded_where_it_could_not_serve_right():
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    call = KernelCall(_FakeKernel, (1,), (x, w, y, x, 4, 8, None), {"BLOCK": 64}, {})
    roles = (x, w, y, None, None, None)
    assert Replay.record(call, _FakeCompiled(), roles, 0) is not None
    assert Replay.record(call, None, roles, 0) is None  # the interpreter: nothing compiled
    # A buffer made for this call alone (a recording would keep it).
    assert Replay.record(call._replace(replayable=False), _FakeCompiled(), roles, 0) is None
    # A tensor's argument after another argument: a replay passes the tensors first.
    late = KernelCall(_FakeKernel, (1,), (x, w, y, 4, x, 8, None), {"BLOCK": 64}, {})
    assert Replay.record(late, _FakeCompiled(), roles, 0) is None
    # One tensor in two roles: a later call's two tensors could not be told apart.
    scale = torch.ones(1)
    shared = KernelCall(_FakeKernel, (1,), (x, w, y, scale, 4, 8, None), {"BLOCK": 64}, {})
    assert Replay.record(shared, _FakeCompiled(), (x, w, y, None, scale, scale), 0) is None


def _fast_recording(monkeypatch, x, w, y, workspace=None):
    """A recording launched through a stand-in for Triton's C launcher: (the replay, the
    argument lists the launcher got)."""
    launches = []
    monkeypatch.setattr(_replay, "direct_launch", lambda compiled: _replay.DirectLaunch(
        lambda *args: launches.append(args), ("between",)))
    replay, _ = _recording(x, w, y, workspace)
    return replay, launches


def test_a_fast_launch_gives_the_launcher_the_new_tensors_addresses(monkeypatch):
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    replay, launches = _fast_recording(monkeypatch, x, w, y)
    x2, y2 = torch.randn(4, 8), torch.empty(4, 6)
    assert replay.launch_fast((x2, w, y2, None, None, None))
    (args,) = launches
    # The grid, the stream, what the launcher takes before the kernel's arguments, then the
    # addresses (x's again for the missing bias) and the recorded rest.
    assert args[:5] == (5, 1, 1, 0, "between")
    assert args[5:9] == (x2.data_ptr(), w.data_ptr(), y2.data_ptr(), x2.data_ptr())
    assert args[9:] == (4, 8, None, 64)


def test_a_fast_launch_refuses_what_the_recording_did_not_see(monkeypatch):
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    replay, launches = _fast_recording(monkeypatch, x, w, y)
    strided = torch.randn(8, 4).t()
    unaligned = torch.randn(33)[1:].view(4, 8)
    for roles in ((strided, w, y, None, None, None), (unaligned, w, y, None, None, None),
                  (x, w, y, torch.randn(6), None, None)):  # a bias where none was recorded
        assert not replay.launch_fast(roles)
    monkeypatch.setattr(_replay, "no_launch_hooks", lambda: False)  # a profiler listens
    assert not replay.launch_fast((x, w, y, None, None, None))
    assert launches == []


def test_a_fast_launch_of_a_recording_bound_to_a_stream_keeps_to_it(monkeypatch):
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    monkeypatch.setattr(_replay, "current_stream", lambda device: 7)
    replay, launches = _fast_recording(monkeypatch, x, w, y, workspace=torch.zeros(16))
    assert replay.launch_fast((x, w, y, None, None, None))
    monkeypatch.setattr(_replay, "current_stream", lambda device: 8)
    assert not replay.launch_fast((x, w, y, None, None, None))
    assert len(launches) == 1


def test_a_strided_recording_is_never_launched_fast(monkeypatch):
    x, w, y = torch.randn(8, 4).t(), torch.randn(6, 8), torch.empty(4, 6)
    replay, launches = _fast_recording(monkeypatch, x, w, y)
    assert not replay.launch_fast((torch.randn(4, 8), w, y, None, None, None))
    assert launches == []


def test_without_a_known_launcher_a_fast_launch_goes_through_the_compiled_kernel(monkeypatch):
    # A Triton whose launcher layout is not known here: the compiled kernel's run, with
    # the addresses as integers.
    monkeypatch.setattr(_replay, "_DIRECT_LAUNCH_VERSIONS", ())
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    replay, compiled = _recording(x, w, y)
    assert replay.launch_fast((x, w, y, None, None, None))
    (args,) = compiled.calls
    assert args[:4] == (x.data_ptr(), w.data_ptr(), y.data_ptr(), x.data_ptr())


@pytest.mark.parametrize("kind", ["triton", "gluon"])
def test_a_host_descriptor_is_rebuilt_around_the_new_tensor(kind):
    # The persistent kernel takes x and w as Triton's host TMA descriptors, the TMA-ring kernel
    # as Gluon's (which carry the shared-memory layout the kernel was compiled for): a replay
    # makes a descriptor of the recorded geometry around each call's tensor.
    x, w, y = torch.randn(16, 32), torch.randn(16, 32), torch.empty(16, 16)
    layout = None
    if kind == "triton":
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(x, [16, 16])
    else:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        layout = gl.NVMMASharedLayout.get_default_for([16, 16], gl.float32)
        x_desc = TensorDescriptor.from_tensor(x, [16, 16], layout)
    call = KernelCall(_FakeKernel, (2,), (x_desc, w, y, x, 16, 32, None), {"BLOCK": 64}, {})
    compiled = _FakeCompiled()
    replay = Replay.record(call, compiled, (x, w, y, None, None, None), 0)
    assert replay is not None
    x2, y2 = torch.randn(16, 32), torch.empty(16, 16)
    assert replay.launch_fast((x2, w, y2, None, None, None))
    replay((x2, w, y2, None, None, None))
    for args in compiled.calls:
        desc = args[0]
        assert desc.base is x2 and list(desc.shape) == [16, 32] and desc.padding == "zero"
        assert list(desc.strides) == [32, 1] and list(desc.block_shape) == [16, 16]
        if layout is not None and not _replay._LIGHT_DESCRIPTORS:  # checked as Gluon checks it
            assert isinstance(desc, TensorDescriptor) and desc.layout == layout
    fast, checked = compiled.calls
    assert fast[1:4] == (w.data_ptr(), y2.data_ptr(), x2.data_ptr())  # the fast way: addresses
    assert checked[1] is w and checked[3] is x2


def _described_recording(monkeypatch, descriptors):
    """A recording whose first argument is a host descriptor of x, launched through a stand-in
    for Triton's C launch taking ``descriptors`` (the wrapper's metadata): (the replay, x's
    descriptor, the launches, the compiled kernel)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    launches = []
    monkeypatch.setattr(_replay, "direct_launch", lambda compiled: _replay.DirectLaunch(
        lambda *args: launches.append(args), ("between",), descriptors))
    x, w, y = torch.randn(16, 32), torch.randn(16, 32), torch.empty(16, 16)
    x_desc = TensorDescriptor.from_tensor(x, [16, 16])
    call = KernelCall(_FakeKernel, (2,), (x_desc, w, y, x, 16, 32, None), {"BLOCK": 64}, {})
    compiled = _FakeCompiled()
    replay = Replay.record(call, compiled, (x, w, y, None, None, None), 0)
    return replay, w, launches, compiled


def test_a_fast_launch_expands_a_descriptor_as_the_launchers_wrapper_would(monkeypatch):
    # A kernel lowered without TMA metadata takes the descriptor as address, shape, strides,
    # NaN padding, shape and strides again.
    replay, w, launches, _ = _described_recording(monkeypatch, [None])
    x2, y2 = torch.randn(16, 32), torch.empty(16, 16)
    assert replay.launch_fast((x2, w, y2, None, None, None))
    (args,) = launches
    assert args[4:5] == ("between",)
    assert args[5:15] == (x2.data_ptr(), 16, 32, 32, 1, False, 16, 32, 32, 1)
    assert args[15:] == (w.data_ptr(), y2.data_ptr(), x2.data_ptr(), 16, 32, None, 64)


def test_a_tma_descriptor_is_encoded_once_per_address(monkeypatch):
    encoded = []

    def fill(address, *encoding):
        encoded.append((address, encoding))
        return f"tensormap@{address}"

    monkeypatch.setattr(_replay, "_tma_fill", lambda: fill)
    meta = dict(swizzle=128, elem_size=4, elem_type=8, block_size=[16, 16], fp4_padded=False)
    replay, w, launches, _ = _described_recording(monkeypatch, [meta])
    x2, x3, y2 = torch.randn(16, 32), torch.randn(16, 32), torch.empty(16, 16)
    for x in (x2, x3, x2, x2):
        assert replay.launch_fast((x, w, y2, None, None, None))
    # Encoded as Triton's wrapper does (its host dtype code for device code 8 is 10).
    assert encoded == [(x2.data_ptr(), (128, 4, 10, [16, 16], [16, 32], [32, 1], 0)),
                       (x3.data_ptr(), (128, 4, 10, [16, 16], [16, 32], [32, 1], 0))]
    assert [args[5:10] for args in launches] == [
        (f"tensormap@{x.data_ptr()}", 16, 32, 32, 1) for x in (x2, x3, x2, x2)]
    assert launches[0][10:] == (w.data_ptr(), y2.data_ptr(), x2.data_ptr(), 16, 32, None, 64)


def test_an_fp4_descriptor_doubles_its_last_dimension_and_few_are_kept(monkeypatch):
    encoded = []
    monkeypatch.setattr(_replay, "_tma_fill", lambda: lambda address, *encoding: (
        encoded.append(address) or f"tensormap@{address}"))
    monkeypatch.setattr(_replay, "_DESCRIPTORS_KEPT", 2)
    meta = dict(swizzle=128, elem_size=1, elem_type=0, block_size=[16, 16], fp4_padded=True)
    replay, w, launches, _ = _described_recording(monkeypatch, [meta])
    xs = [torch.randn(16, 32) for _ in range(3)]
    y = torch.empty(16, 16)
    for x in xs + xs[:1]:
        assert replay.launch_fast((x, w, y, None, None, None))
    # Packed FP4: the descriptor spans twice the elements along the last dimension.
    assert launches[0][5:10] == (f"tensormap@{xs[0].data_ptr()}", 16, 64, 32, 1)
    # Two kept: the third address drops them, so the first is encoded again.
    assert encoded == [x.data_ptr() for x in xs + xs[:1]]


def _launcher_wrapper(launcher, tensordesc_meta):
    """A stand-in for Triton 3.6's wrapper around its C launch (``wrap_handle_tensordesc``)."""
    def inner(*args):
        return launcher(*args), tensordesc_meta
    return inner


def test_the_c_launch_is_read_from_the_launchers_wrapper(monkeypatch):
    import types

    monkeypatch.setattr(_replay, "_DIRECT_LAUNCH_VERSIONS", (triton.__version__,))
    meta = [None]
    launcher = types.SimpleNamespace(launch=_launcher_wrapper(max, meta), global_scratch_size=0,
                                     profile_scratch_size=0, launch_cooperative_grid=False,
                                     launch_pdl=True)
    compiled = types.SimpleNamespace(run=launcher, function=7, packed_metadata="packed")
    direct = _replay.direct_launch(compiled)
    assert direct == _replay.DirectLaunch(
        max, (7, False, True, None, None, "packed", None, None, None), meta)
    launcher.launch = max  # no descriptors: the C launch itself
    assert _replay.direct_launch(compiled).descriptors is None
    launcher.launch = lambda *args: None  # a wrapper of another shape: not known here
    assert _replay.direct_launch(compiled) is None
    launcher.launch, launcher.global_scratch_size = max, 128  # needs scratch memory
    assert _replay.direct_launch(compiled) is None


def test_descriptors_the_recording_cannot_place_go_through_the_compiled_kernel(monkeypatch):
    # The launcher takes two descriptors but only one argument is a role's: no C launch.
    replay, w, launches, compiled = _described_recording(monkeypatch, [None, None])
    x2, y2 = torch.randn(16, 32), torch.empty(16, 16)
    assert replay.launch_fast((x2, w, y2, None, None, None))
    assert launches == [] and len(compiled.calls) == 1


# ---------------------------------------------------------------------------------- the GPU
HEADER = ("arch,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,"
          "kernelName,err_ratio,tflops,bw\n")
KERNELS = ["triton.tile:BM16.BN64.BK128.G8.W4.S4", "triton.splitk:BM16.BN64.BK128.SK1.W4.S4",
           "triton.splitk:BM16.BN64.BK128.SK4.W4.S4"]


def _route(tmp_path, monkeypatch, kernel, m, n, k):
    install_user_table(monkeypatch, tmp_path / "rows.csv", "GEMMTUNE_CONFIG_BF16", HEADER,
                       [(m, n, k, False, "torch.bfloat16", "torch.bfloat16", False, False,
                         kernel)])


def _rel_err(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture
def replays(monkeypatch):
    """Counts the launches served by a replay (the checked way or the fast one)."""
    served = []
    real, real_fast = Replay.__call__, Replay.launch_fast

    def fast(self, roles):
        launched = real_fast(self, roles)
        if launched:
            served.append(self)
        return launched

    monkeypatch.setattr(Replay, "__call__", lambda self, roles: (served.append(self),
                                                                 real(self, roles)))
    monkeypatch.setattr(Replay, "launch_fast", fast)
    return served


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_replayed_calls_match_the_reference_on_new_inputs_and_layouts(tmp_path, monkeypatch,
                                                                      replays, kernel):
    m, n, k = 16, 576, 2048
    _route(tmp_path, monkeypatch, kernel, m, n, k)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5
    buffer = torch.randn(m * k + 8, device="cuda", generator=g, dtype=torch.bfloat16)
    inputs = [torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
              for _ in range(3)]
    inputs += [torch.randn(k, m, device="cuda", generator=g, dtype=torch.bfloat16).t(),
               buffer[1:m * k + 1].view(m, k),  # 2 bytes past an aligned start
               torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)]
    for x in inputs:  # the first records, the next replay; other layouts go the slow way
        y = gemmtune.gemm_a16w16(x, w)
        assert _rel_err(y, gemm_a16w16_ref(x, w, None, torch.float32)) < 1e-2, kernel
    # Calls 2 and 3 replay; the strided and the unaligned x are recorded anew (each replacing
    # the recording), and the last aligned x is recorded again after them.
    assert len(replays) == 2, kernel


@pytest.mark.gpu
def test_split_k_replays_keep_to_their_stream(tmp_path, monkeypatch, replays):
    m, n, k = 16, 576, 2048
    _route(tmp_path, monkeypatch, KERNELS[2], m, n, k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    outs = []
    for i, x in enumerate(xs):  # 3 calls on one stream, then 3 on another: record, replay x2
        stream = torch.cuda.Stream()
        if i % 3 == 0:
            stream.wait_stream(torch.cuda.current_stream())
            side = stream
        with torch.cuda.stream(side):
            outs.append(gemmtune.gemm_a16w16(x, w))
    torch.cuda.synchronize()
    for x, y in zip(xs, outs):
        assert _rel_err(y, gemm_a16w16_ref(x, w, None, torch.float32)) < 1e-2
    # Each stream's recording served its own two later calls, never the other stream's.
    assert len(replays) == 4 and replays[0] is replays[1] and replays[2] is replays[3]
    assert replays[0] is not replays[2] and replays[0].stream != replays[2].stream


@pytest.mark.gpu
def test_a_replay_follows_torchs_tf32_switch(tmp_path, monkeypatch):
    # fp32 operands use tf32 only where torch would: a recording made with it off must not
    # serve a call with it on, nor the reverse.
    m, n, k = 16, 256, 1024
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    exact = x.double() @ w.double().t()
    errors = {}
    for allow in (False, True, False):
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", allow)
        for _ in range(2):
            y = gemmtune.gemm_a16w16(x, w, kernel=KERNELS[0])
            errors.setdefault(allow, []).append(_rel_err(y.double(), exact))
    assert max(errors[False]) < 1e-5  # ieee fp32, before and after the tf32 calls
    assert min(errors[True]) > 1e-5  # tf32 rounds the operands to 10 mantissa bits


@pytest.mark.gpu
def test_split_k_recordings_share_their_streams_partials():
    # A recording per token count keeps the partials its launch used: its stream's one buffer
    # (grown as counts grow), not a buffer per count as per-call partials would.
    from gemmtune.families.bf16.op import REGISTRY

    n, k = 576, 2048
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    for m in (1, 5, 16, 33, 64):
        for _ in range(2):  # record, then replay
            y = gemmtune.gemm_a16w16(x[:m], w, kernel=KERNELS[2])
            assert _rel_err(y, gemm_a16w16_ref(x[:m], w, None, torch.float32)) < 1e-2, m
    recordings = REGISTRY.resolve(KERNELS[2])._replays
    partials = {key[0][0]: next(v for v in r._rest if isinstance(v, torch.Tensor)
                                and v.dtype == torch.float32)
                for key, r in recordings.items()}
    assert set(partials) >= {1, 5, 16, 33, 64}
    # 1-16 tokens fit the first buffer; each later count may grow it once.
    assert partials[1] is partials[5] is partials[16]
    assert len({id(p) for p in partials.values()}) <= 3


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_bound_calls_replay_inside_a_cuda_graph(tmp_path, monkeypatch, kernel, replays):
    m, n, k = 16, 576, 2048
    _route(tmp_path, monkeypatch, kernel, m, n, k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    static_x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gemmtune.gemm_a16w16(static_x, w)  # planned and recorded outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemmtune.gemm_a16w16(static_x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    served_before = len(replays)
    with torch.cuda.graph(graph):
        y = gemmtune.gemm_a16w16(static_x, w)
    if kernel == KERNELS[0]:  # the tile kernel's recording holds no stream's buffers
        assert len(replays) == served_before + 1
    for seed in range(2):
        torch.manual_seed(seed)
        static_x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(y, gemm_a16w16_ref(static_x, w, None, torch.float32)) < 1e-2, kernel


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton.tile:BM16.BN64.BK128.G8.W4.S4",
                                    "triton.splitk:BM16.BN64.BK128.SK4.W4.S4"])
def test_bound_a8w8_calls_replay_and_refuse_a_strided_scale(kernel, replays):
    from gemmtune import quant
    from gemmtune.kernels.torch_ref import gemm_a8w8_ref

    m, n, k = 16, 576, 2048
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = quant.per_channel_fp8(w)
    for seed in range(4):
        torch.manual_seed(seed)
        xq, xs = quant.per_token_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        if seed == 2:  # the same (M, 1) scale with a stride: refused, as the first call's
            wide = torch.full((m, 2), float("nan"), device="cuda")
            wide[:, :1] = xs
            with pytest.raises(ValueError, match="x_scale must be contiguous"):
                gemmtune.gemm_a8w8(xq, wq, wide[:, :1], ws, kernel=kernel)
            continue
        y = gemmtune.gemm_a8w8(xq, wq, xs, ws, kernel=kernel)
        ref = gemm_a8w8_ref(xq, wq, xs, ws, None, torch.float32)
        assert _rel_err(y, ref) < 1e-2, (kernel, seed)
    assert len(replays) >= 2, kernel  # the contiguous calls after the first


@pytest.mark.gpu
def test_persistent_calls_replay_with_descriptors_around_new_tensors(tmp_path, monkeypatch,
                                                                     replays):
    m, n, k = 128, 512, 1024
    kernel = "triton.persistent:BM64.BN64.BK64.G8.W4.S3"
    _route(tmp_path, monkeypatch, kernel, m, n, k)
    # Two weights of one shape (two layers): each call's descriptors are its own tensors'.
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
               for _ in range(2)]
    for seed in range(6):
        torch.manual_seed(seed)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if seed == 3:
            x = x.view(2, m // 2, k)  # leading dims: the same 2-D geometry
        w = weights[seed % 2]
        y = gemmtune.gemm_a16w16(x, w)
        assert _rel_err(y, gemm_a16w16_ref(x, w, None, torch.float32)) < 1e-2, seed
    assert len(replays) == 5
    if triton.__version__.startswith("3.6."):  # the C launch, descriptors made per address
        assert all(r._encoded is not None for r in replays)

"""Replays of a planned Triton launch (``kernels/triton/_replay.py``): which arguments a replay
swaps, when it refuses (so the call goes the slow way), and on the GPU that every replayed
call computes what a fresh launch would."""

from __future__ import annotations

import pytest
import torch

import gemmtune
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
def _stream_zero(monkeypatch):
    """The CPU has no CUDA stream: the current one is 0 unless a test says otherwise."""
    monkeypatch.setattr(_replay, "_current_stream", lambda device: 0)


def _recording(x, w, y, workspace=None, stream=0):
    call = KernelCall(_FakeKernel, (5,), (x, w, y, x, x.shape[0], x.stride(0), workspace),
                      {"BLOCK": 64}, {"num_warps": 4})
    compiled = _FakeCompiled()
    return Replay(call, compiled, (x, w, y, None, None, None), stream, 0), compiled


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
    replay = Replay(call, _FakeCompiled(), (x, w, y, None, scale_a, scale_b), 0, 0)
    assert replay.serves((x, w, y, None, torch.ones(1, 1), torch.ones(1, 1)))
    assert not replay.serves((x, w, y, None, torch.ones(4, 1), torch.ones(1, 1)))


def test_a_replay_holding_its_own_buffers_serves_its_stream_only(monkeypatch):
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    workspace = torch.zeros(16)
    replay, compiled = _recording(x, w, y, workspace=workspace, stream=7)
    assert replay.stream == 7
    roles = (torch.randn(4, 8), w, torch.empty(4, 6), None, None, None)
    monkeypatch.setattr(_replay, "_current_stream", lambda device: 7)
    assert replay.serves(roles)
    replay(roles)
    assert compiled.calls[0][6] is workspace  # the split-K partials stay the recording's
    monkeypatch.setattr(_replay, "_current_stream", lambda device: 8)
    assert not replay.serves(roles)


def test_a_profilers_launch_hooks_still_see_replayed_launches(monkeypatch):
    x, w, y = torch.randn(4, 8), torch.randn(6, 8), torch.empty(4, 6)
    replay, compiled = _recording(x, w, y)
    monkeypatch.setattr(_replay, "_no_launch_hooks", lambda: False)
    replay((x, w, y, None, None, None))  # through the runner, which calls the hooks
    assert compiled.calls[0][0] is x and len(compiled.calls[0]) == 8


def test_no_replay_is_recorded_without_a_compiled_kernel():
    x = torch.randn(4, 8)
    call = KernelCall(_FakeKernel, (1,), (x,), {}, {})
    assert Replay.record(call, None, (x,), 0) is None


# ---------------------------------------------------------------------------------- the GPU
HEADER = ("arch,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,"
          "kernelName,err_ratio,tflops,bw\n")
KERNELS = ["triton.tile:BM16.BN64.BK128.G8.W4.S4", "triton.splitk:BM16.BN64.BK128.SK1.W4.S4",
           "triton.splitk:BM16.BN64.BK128.SK4.W4.S4"]


def _route(tmp_path, monkeypatch, kernel, m, n, k):
    dev = gemmtune.current_device()
    path = tmp_path / "rows.csv"
    path.write_text(HEADER + f"{dev.arch},{dev.cu_num},{m},{n},{k},False,torch.bfloat16,"
                             f"torch.bfloat16,False,False,triton,0,0,1.0,{kernel},0,0,0\n")
    monkeypatch.setenv("GEMMTUNE_CONFIG_BF16", f"replace:{path}")
    gemmtune.reset()


def _rel_err(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_replayed_calls_match_the_reference_on_new_inputs_and_layouts(tmp_path, monkeypatch,
                                                                      kernel):
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


@pytest.mark.gpu
def test_split_k_replays_keep_to_their_stream(tmp_path, monkeypatch):
    m, n, k = 16, 576, 2048
    _route(tmp_path, monkeypatch, KERNELS[2], m, n, k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for i, x in enumerate(xs):  # alternating streams: each recording serves its own
        with torch.cuda.stream(streams[i % 2]):
            outs.append(gemmtune.gemm_a16w16(x, w))
    torch.cuda.synchronize()
    for x, y in zip(xs, outs):
        assert _rel_err(y, gemm_a16w16_ref(x, w, None, torch.float32)) < 1e-2


@pytest.mark.gpu
def test_split_k_recordings_share_their_streams_partials():
    # A recording per token count keeps what its launch used: one partials buffer per stream,
    # not one per count (a decode server sees every count up to its batch).
    from gemmtune.kernels.triton import gemm_splitk

    n, k = 576, 2048
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    for m in (1, 5, 16, 33, 64):
        for _ in range(2):  # record, then replay
            y = gemmtune.gemm_a16w16(x[:m], w, kernel=KERNELS[2])
            assert _rel_err(y, gemm_a16w16_ref(x[:m], w, None, torch.float32)) < 1e-2, m
    stream = torch.cuda.current_stream().cuda_stream
    partials = [key for key in gemm_splitk._STREAM_BUFFERS if key[0] == "partials"
                and key[2] == stream]
    assert len(partials) == 1

"""On the GPU: gemm_a16w16 at real sizes through each backend, in CUDA graphs and under inductor."""

from __future__ import annotations

import pytest
import torch

import gemmtune
from gemmtune.kernels.torch_ref import gemm_a16w16_ref
from gemmtune.families.bf16.op import DISPATCH

pytestmark = pytest.mark.gpu

HEADER = "arch,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,kernelName,err_ratio,tflops,bw\n"
TILE = "triton.tile:BM64.BN128.BK64.G8.W4.S3"


@pytest.fixture
def triton_rows(tmp_path, monkeypatch):
    """Route every bf16 shape with N=4096, K=4096 to the Triton tile kernel on this GPU."""
    dev = gemmtune.current_device()
    path = tmp_path / "rows.csv"
    path.write_text(HEADER + "".join(
        f"{dev.arch},{dev.cu_num},{m},4096,4096,{b},torch.bfloat16,torch.bfloat16,False,False,"
        f"triton,0,0,1.0,{TILE},0,0,0\n" for m in (16, 128, 1024) for b in (False, True)))
    monkeypatch.setenv("GEMMTUNE_CONFIG_BF16", f"replace:{path}")
    gemmtune.reset()


def _rel_err(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("m", [1, 13, 128, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_row_at_real_size(triton_rows, m, bias):
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", generator=g, dtype=torch.bfloat16) / 64
    b = torch.randn(4096, device="cuda", generator=g, dtype=torch.bfloat16) if bias else None
    y = gemmtune.gemm_a16w16(x, w, b)
    assert DISPATCH.plans[(m, 4096, 4096, bias, torch.bfloat16, torch.bfloat16, False, False,
                           x.get_device())].decision.kernel_name == TILE
    # bf16 output rounding (2^-9 relative) dominates: same bound torch's own bf16 GEMM meets.
    assert _rel_err(y, gemm_a16w16_ref(x, w, b, torch.float32)) < 1e-2


@pytest.mark.parametrize("use_triton", [False, True])
def test_cuda_graph_capture_and_replay(request, use_triton):
    if use_triton:
        request.getfixturevalue("triton_rows")
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    gemmtune.gemm_a16w16(x, w)  # plan, compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemmtune.gemm_a16w16(x, w)
    for seed in range(3):
        x.copy_(torch.randn(16, 4096, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(seed), dtype=torch.bfloat16))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(y, gemm_a16w16_ref(x, w, None, torch.float32)) < 1e-2


def test_torch_compile_inductor_fullgraph_on_gpu(triton_rows):
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.SiLU(),
                                torch.nn.Linear(4096, 4096)).cuda().to(torch.bfloat16).eval()
    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        gemmtune.patch_linear(model)
        assert not DISPATCH.plans
        got = torch.compile(model, fullgraph=True)(x)
    assert _rel_err(got, want) < 2e-2
    # The compiled graph called gemmtune's op, which dispatched to the table's Triton row (the
    # plan is made by the op's real implementation, never by its fake).
    plan = DISPATCH.plans[(128, 4096, 4096, True, torch.bfloat16, torch.bfloat16, False, False,
                           x.get_device())]
    assert plan.decision.kernel_name == TILE


def test_interleaved_timing_of_one_kernel_twice_agrees():
    from gemmtune.measure.timing import copies_to_exceed_l2, interleaved_graph_us

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    sets = [(x, w.clone()) for _ in range(copies_to_exceed_l2(w.numel() * 2))]
    (a, spread_a), (b, spread_b) = interleaved_graph_us(
        [lambda s: torch.nn.functional.linear(*s)] * 2, sets, rounds=3, replays=5)
    floor_us = w.numel() * 2 / 3.4e12 * 1e6  # above any H100/H200 bandwidth: a real time
    assert a > floor_us and b > floor_us
    assert abs(a - b) / min(a, b) < 0.2 and spread_a < 1 and spread_b < 1


def test_a_call_that_captures_no_gpu_work_is_not_timed():
    """A call that runs its GPU work outside the capturing stream leaves an empty graph, whose
    replays take no time: timing refuses it rather than report it as the fastest."""
    from gemmtune.measure.timing import EmptyGraphError, graph_replay_us

    x = torch.randn(256, 256, device="cuda")

    def elsewhere(inp):
        if torch.cuda.is_current_stream_capturing():
            return None  # as a call that launches on a cached, non-capturing stream does
        return inp @ inp

    with pytest.raises(EmptyGraphError, match="put no GPU work into its CUDA graph"):
        graph_replay_us(elsewhere, [x])
    # Work on the capturing stream is timed as before.
    us, _ = graph_replay_us(lambda inp: inp @ inp, [x])
    assert us > 0


def _gpu_kernels(fn) -> list[str]:
    """Names of the CUDA kernels ``fn`` ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def test_precompile_builds_without_running_then_the_candidate_runs():
    from gemmtune.families.bf16.op import Bf16Key
    from gemmtune.families.bf16.tuner import Bf16Tuner

    tuner = Bf16Tuner()
    key = Bf16Key(16, 576, 7168, False, "torch.bfloat16", "torch.bfloat16", False, False)
    prepared = tuner.prepare(key, seed=3)
    for name, kernel in (("triton.tile:BM16.BN64.BK128.G8.W4.S4", "gemm_tile_kernel"),
                         ("triton.splitk:BM16.BN32.BK128.SK8.W2.S5", "gemm_splitk_kernel")):
        built = _gpu_kernels(lambda: tuner.precompile(name, prepared))
        assert not [k for k in built if kernel in k], built  # compiled, never launched
        ran = _gpu_kernels(lambda: tuner.run(name, prepared))
        assert [k for k in ran if kernel in k], ran  # what the check above would have seen
        assert _rel_err(tuner.run(name, prepared), prepared.reference) < 1e-2

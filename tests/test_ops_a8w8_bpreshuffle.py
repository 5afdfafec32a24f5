"""gemm_a8w8_bpreshuffle: FP8/INT8 on weights packed by gemmtune.quant.shuffle_weight, dispatched
through a8w8_bpreshuffle_tuned_gemm.csv; the layout, every kernel that reads it against the
dequantised fp32 reference of the row-major weight, and the tuner."""

from __future__ import annotations

import csv
import io

import pytest
import torch

import gemmtune
from gemm_checks import SCALE_LAYOUTS, install_user_table, quantised_operands
from gemmtune import quant
from gemmtune.families.a8w8_bpreshuffle.op import DISPATCH
from gemmtune.kernels.torch_ref import TORCH_UNSHUFFLED, gemm_a8w8_ref
from gemmtune.tables.lookup import Rule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADER = "arch,cu_num,M,N,K,q_dtype_w,libtype,solidx,splitK,us,kernelName,err_ratio,tflops,bw\n"
Q_DTYPES = [torch.float8_e4m3fn, torch.int8]
Q_NAMES = {torch.float8_e4m3fn: "torch.float8_e4m3fn", torch.int8: "torch.int8"}
SPLITK = "triton.splitk:BM16.BN32.BK128.SK2.W4.S2"
SPLITK_SWAPPED = "triton.splitk:BM16.BN64.BK128.SK2.W4.S3.P0.PK0.SW1"
TILE = "triton.tile:BM16.BN32.BK256.G2.W4.S2"
GEMV = "triton.gemv:BN4.BK256.SK2.W4.S1"
GEMV_TWO_STEPS = "triton.gemv:BN16.BK128.SK1.W4.S2"


@pytest.fixture
def bpreshuffle_table(tmp_path, monkeypatch):
    """Install a user table (replacing the shipped one) with the given rows."""
    def install(*rows: tuple) -> None:  # (M, N, K, q_dtype_w, kernelName)
        install_user_table(monkeypatch, tmp_path / "bp_user.csv",
                           "GEMMTUNE_CONFIG_A8W8_BPRESHUFFLE", HEADER, rows)

    return install


def operands(M, N, K, q_dtype, layout="token_channel", seed=0):
    """(xq, wq row-major, wq shuffled, x_scale, w_scale)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    xq, wq, xs, ws = quantised_operands(M, N, K, q_dtype, layout, gen)
    return xq, wq, quant.shuffle_weight(wq), xs, ws


def assert_close_to_reference(y, xq, wq, x_scale, w_scale):
    ref = gemm_a8w8_ref(xq, wq, x_scale, w_scale, None, torch.float32)
    assert not torch.isnan(y).any()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    # bf16 output rounding: 2^-9 relative per element, ~2e-3 in norm.
    assert rel < 1e-2, rel


# --- the layout --------------------------------------------------------------------------------


@pytest.mark.parametrize("q_dtype", Q_DTYPES)
def test_shuffle_packs_16_row_by_128_byte_tiles_and_round_trips(q_dtype):
    _, wq, ws, _, _ = operands(1, 48, 384, q_dtype)
    assert ws.shape == wq.shape and ws.dtype == wq.dtype and ws.is_contiguous()
    flat, plain = ws.view(torch.uint8).reshape(-1), wq.view(torch.uint8)
    # Band 0's tiles along K, then band 1's: each the 16 x 128 block, rows in order.
    assert torch.equal(flat[:2048], plain[:16, :128].reshape(-1))
    assert torch.equal(flat[2048:4096], plain[:16, 128:256].reshape(-1))
    assert torch.equal(flat[3 * 2048:4 * 2048], plain[16:32, :128].reshape(-1))
    assert not torch.equal(flat, plain.reshape(-1))
    assert torch.equal(quant.unshuffle_weight(ws).view(torch.uint8), plain)


@pytest.mark.parametrize("shape, dtype, match", [
    ((40, 128), torch.float8_e4m3fn, "N must be a multiple of 16 and K of 128"),
    ((32, 96), torch.int8, "N must be a multiple of 16 and K of 128"),
    ((32, 128), torch.bfloat16, "quantise to torch.float8_e4m3fn or torch.int8"),
])
def test_shuffle_refuses_what_does_not_tile(shape, dtype, match):
    w = torch.zeros(shape).to(dtype)
    with pytest.raises(ValueError, match=match):
        quant.shuffle_weight(w)
    with pytest.raises(ValueError, match="expected a 2-D"):
        quant.shuffle_weight(torch.zeros(2, 32, 128).to(torch.int8))


def test_model_shapes_leave_out_weights_that_do_not_tile():
    from gemmtune.models.shapes import ModelSpec, untuned_rows

    fits = gemmtune.get_family("a8w8_bpreshuffle").why_not_gemm
    assert fits(4096, 14336, "fp8") is None and fits(4096, 14336, "int8") is None
    assert "K of 128" in fits(4096, 1000, "fp8") and "N must be" in fits(4100, 4096, "fp8")
    # An MLP of 1000: down (K = 1000) does not tile; gate/up (N = 2000), attention and the
    # lm_head (K = hidden = 1024) do.
    spec = ModelSpec(name="odd", source="test", model_type="llama",
                     architectures=("LlamaForCausalLM",), hidden_size=1024,
                     num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                     vocab_size=32000, dense_intermediate_size=1000)
    rows = untuned_rows(spec, 1, m_values=(1,))
    every = {(r.key.N, r.key.K) for r in rows["a8w8"]}
    tiled = {(r.key.N, r.key.K) for r in rows["a8w8_bpreshuffle"]}
    assert tiled == {(n, k) for n, k in every if n % 16 == 0 and k % 128 == 0}
    assert (2000, 1024) in tiled and every - tiled == {(1024, 1000)}


def test_bench_leaves_out_weights_that_do_not_tile(capsys):
    """A model's router (8 x 4096) has no tiled layout: the bench says so and runs the rest."""
    from gemmtune.bench import BenchShape
    from gemmtune.cli import _taken

    family = gemmtune.get_family("a8w8-bpreshuffle")
    shapes = [BenchShape("router", 1, 8, 4096), BenchShape("qkv", 1, 6144, 4096)]
    assert _taken(shapes, family, "fp8") == shapes[1:]
    assert "router M=1 N=8 K=4096 left out: a (8, 4096) weight does not tile" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match="none of the shapes"):
        _taken(shapes[:1], family, "fp8")
    # A family without the rule keeps everything.
    assert _taken(shapes, gemmtune.get_family("a8w8"), "fp8") == shapes


# --- the op ------------------------------------------------------------------------------------


# The swapped dot (a wgmma with w's rows as M) and the GEMV are FP8 kernels here; int8 runs the
# others.
@pytest.mark.parametrize("kernel, M, N, q_dtype", [
    *((kernel, M, N, q_dtype) for kernel, M, N in ((SPLITK, 13, 48), (TILE, 70, 48),
                                                   (TORCH_UNSHUFFLED, 13, 48))
      for q_dtype in Q_DTYPES),
    (SPLITK_SWAPPED, 5, 64, torch.float8_e4m3fn), (GEMV, 1, 48, torch.float8_e4m3fn),
    (GEMV, 3, 48, torch.float8_e4m3fn), (GEMV_TWO_STEPS, 1, 32, torch.float8_e4m3fn)])
def test_table_row_runs_its_kernel_on_the_shuffled_weight(bpreshuffle_table, kernel, M, N,
                                                          q_dtype):
    K = 384
    bpreshuffle_table((M, N, K, Q_NAMES[q_dtype], kernel))
    xq, wq, wqs, xs, ws = operands(M, N, K, q_dtype, seed=M)
    y = gemmtune.gemm_a8w8_bpreshuffle(xq, wqs, xs, ws, dtype=torch.float32)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert_close_to_reference(y, xq, wq, xs, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.exact and plan.decision.kernel_name == kernel


@pytest.mark.parametrize("layout", list(SCALE_LAYOUTS))
def test_no_row_runs_a_triton_default_that_reads_the_tiles(bpreshuffle_table, layout):
    bpreshuffle_table()
    M, N, K = 3, 32, 256
    xq, wq, wqs, xs, ws = operands(M, N, K, torch.float8_e4m3fn, layout)
    y = gemmtune.gemm_a8w8_bpreshuffle(xq.view(1, M, K), wqs, xs, ws)
    assert y.shape == (1, M, N) and y.dtype == torch.bfloat16
    assert_close_to_reference(y.view(M, N), xq, wq, xs, ws)
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.rule is Rule.default
    assert plan.decision.kernel_name.startswith("triton.splitk:")


def test_row_major_kernels_are_not_this_familys(bpreshuffle_table):
    xq, _, wqs, xs, ws = operands(4, 32, 256, torch.float8_e4m3fn)
    for kernel, why in (("triton.splitk:BM16.BN32.BK64.SK2.W4.S2", "use a multiple of 128"),
                        ("triton.splitk:BM16.BN32.BK128.SK2.W4.S2.P2", "pdl=2 prefetches"),
                        ("triton.gemv:BN16.BK64.SK4.W4.S1", "use a multiple of 128"),
                        ("triton.persistent:BM16.BN32.BK128.G2.W4.S2",
                         "no backend for kernelName")):
        with pytest.raises(ValueError, match=why):
            gemmtune.gemm_a8w8_bpreshuffle(xq, wqs, xs, ws, kernel=kernel)


def test_register_direct_kernel_says_where_it_cannot_run(bpreshuffle_table):
    """triton.frag is a Gluon kernel: FP8 on a GPU only."""
    xq, _, wqs, xs, ws = operands(4, 32, 256, torch.int8)
    why = "float8_e4m3fn only" if torch.cuda.is_available() else "do not run in Triton's interp"
    with pytest.raises(ValueError, match=why):
        gemmtune.gemm_a8w8_bpreshuffle(xq, wqs, xs, ws, kernel="triton.frag:BM16.BK128.SK2.A1")


def test_bad_arguments_say_what_to_do():
    xq, _, wqs, xs, ws = operands(4, 32, 256, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="N must be a multiple of 16"):
        gemmtune.gemm_a8w8_bpreshuffle(xq, wqs[:24], xs, ws[:24])
    # A strided weight of a shape already served contiguously is checked, not run.
    gemmtune.gemm_a8w8_bpreshuffle(xq, wqs, xs, ws)
    wide = torch.empty(32, 512, dtype=wqs.dtype, device=wqs.device)
    wide[:, :256] = wqs
    with pytest.raises(ValueError, match="wq must be contiguous"):
        gemmtune.gemm_a8w8_bpreshuffle(xq, wide[:, :256], xs, ws)
    with pytest.raises(TypeError, match="both must be one of"):
        gemmtune.gemm_a8w8_bpreshuffle(xq, wqs.view(torch.int8), xs, ws)


def test_custom_op_fake_and_schema():
    # int8: the schema test's CPU kernels have no FP8 multiply
    xq, _, wqs, xs, ws = operands(4, 32, 128, torch.int8)
    torch.library.opcheck(torch.ops.gemmtune.gemm_a8w8_bpreshuffle.default,
                          (xq, wqs, xs, ws, torch.bfloat16),
                          test_utils=("test_schema", "test_faketensor"))


# --- GPU: real sizes, CUDA graphs --------------------------------------------------------------


GPU_SWAPPED = "triton.splitk:BM16.BN128.BK256.SK4.W4.S3.P1.PK128.SW1"


# The swapped dot (FP8, M <= 64) where it runs; the other kernels at every M and dtype.
@pytest.mark.gpu
@pytest.mark.parametrize("kernel, M, q_dtype", [
    *((kernel, M, q_dtype) for kernel in (None, "triton.splitk:BM16.BN32.BK256.SK4.W2.S4.P1",
                                          "triton.tile:BM64.BN128.BK128.G8.W4.S3")
      for M in (1, 16, 64, 200, 1000) for q_dtype in Q_DTYPES),
    *((GPU_SWAPPED, M, torch.float8_e4m3fn) for M in (1, 16, 64)),
    *(("triton.gemv:BN2.BK1024.SK4.W4.S2.P1", M, torch.float8_e4m3fn) for M in (1, 5, 16)),
    *((f"triton.frag:BM{bm}.BK{bk}.SK{sk}.A{a}.P1", M, torch.float8_e4m3fn)
      for bm, bk, sk, a, M in ((8, 256, 4, 1, 1), (16, 256, 7, 1, 16), (64, 128, 8, 2, 64),
                               (64, 256, 1, 1, 200), (64, 128, 2, 3, 1000)))])
def test_gpu_real_sizes(bpreshuffle_table, kernel, M, q_dtype):
    N, K = 1536, 7168
    bpreshuffle_table(*([(M, N, K, Q_NAMES[q_dtype], kernel)] if kernel else []))
    for layout in SCALE_LAYOUTS:
        xq, wq, wqs, xs, ws = operands(M, N, K, q_dtype, layout, seed=M)
        y = gemmtune.gemm_a8w8_bpreshuffle(xq, wqs, xs, ws)
        assert_close_to_reference(y, xq, wq, xs, ws)
    (plan, *_) = DISPATCH.plans.values()
    assert plan.decision.kernel_name.startswith(kernel or "triton.")


@pytest.mark.gpu
def test_gpu_cuda_graph_replay(bpreshuffle_table):
    M, N, K = 16, 576, 7168
    bpreshuffle_table()
    xq, wq, wqs, xs, ws = operands(M, N, K, torch.float8_e4m3fn)
    gemmtune.gemm_a8w8_bpreshuffle(xq, wqs, xs, ws)  # plan and compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemmtune.gemm_a8w8_bpreshuffle(xq, wqs, xs, ws)
    new_xq, _, _, new_xs, _ = operands(M, N, K, torch.float8_e4m3fn, seed=5)
    xq.copy_(new_xq)
    xs.copy_(new_xs)
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(y, xq, wq, xs, ws)


# --- the tuner ---------------------------------------------------------------------------------


def test_tuner_tries_only_kernels_that_read_the_tiles(tmp_path):
    """Every candidate passes the gate against the row-major weight's reference, the GEMV among
    them for FP8; the persistent TMA kernel and cuBLASLt (row-major only) are never candidates;
    a shape that does not tile fails alone, saying why."""
    from gemmtune.families.a8w8_bpreshuffle.op import SCHEMA
    from gemmtune.families.a8w8_bpreshuffle.tuner import A8w8BpreshuffleTuner
    from gemmtune.tables.store import read_table
    from gemmtune.tune.engine import TuneConfig, Tuner, default_gpus
    from gemmtune.tune.family import TuneOptions

    inp = tmp_path / "u.csv"
    inp.write_text("M,N,K,q_dtype_w\n5,48,256,torch.float8_e4m3fn\n5,40,256,torch.int8\n")
    out = io.StringIO()
    config = TuneConfig(input=inp, output=tmp_path / "t.csv", profile=tmp_path / "prof.csv",
                        timeout=120, options=TuneOptions(iters=3, warmup=1),
                        gpus=default_gpus(), workers=4 if default_gpus() else 1)
    summary = Tuner(A8w8BpreshuffleTuner, config, out=out).run()
    assert summary.tuned == 1 and len(summary.failed) == 1, out.getvalue()
    assert "N must be a multiple of 16" in out.getvalue()
    (row,) = read_table(tmp_path / "t.csv", SCHEMA).rows
    assert row.key.N == 48
    with open(tmp_path / "prof.csv") as f:
        statuses = [(r["kernelName"], r["status"]) for r in csv.DictReader(f)]
    assert statuses and all(s == "ok" for _, s in statuses), statuses
    names = [n for n, _ in statuses]
    assert TORCH_UNSHUFFLED in names and any(n.startswith("triton.splitk:") for n in names)
    assert any(n.startswith("triton.gemv:") for n in names)
    # The register-direct Gluon kernel is a candidate where it runs: FP8 on a GPU.
    assert any(n.startswith("triton.frag:") for n in names) == torch.cuda.is_available()
    assert not any(n.startswith(("triton.persistent:", "cublaslt")) for n in names)

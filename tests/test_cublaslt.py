"""cuBLASLt backend: names (CPU), import without nvmath (CPU), and on the GPU every enumerated
algorithm against an fp64 reference, names rebuilding the heuristic's algorithms bit for bit,
CUDA-graph capture, bias, fp32 output, odd layouts, and calls from two streams and from two
threads at once."""

import os
import re
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace

import pytest
import torch

import gemmtune
from gemm_checks import assert_bad_name, install_user_table
from gemmtune.kernels import cublaslt
from gemmtune.kernels.cublaslt import (
    INSTALL_HINT,
    KERNEL_PREFIX,
    CublasLtKernel,
    CublasLtScaledKernel,
    LtAlgo,
    enumerate_algos,
)
from gemmtune.kernels.cublaslt._bindings import enum_value, label
from gemmtune.kernels.cublaslt.candidates import _split_k_values, _wanted_tiles
from gemmtune.kernels.problem import GemmProblem, Scaling
from gemmtune.kernels.torch_ref import gemm_a8w8_ref, gemm_a16w16_ref

NAMES = [
    "cublaslt:id66.tile64x8.stages64xAUTO.sk4.red2.swz0.co1.cl1x2x1.in0",
    "cublaslt:id66.tile128x256.stages64xAUTO.sk1.red0.swz1.co0.cl2x1x1.in0",
    "cublaslt:id21.tile128x128.stages32x5.sk8.red1.swz2.co3.clAUTO.in4",
    "cublaslt:id0.tileUNDEFINED.stagesUNDEFINED.sk1.red0.swz0.co0.clAUTO.in0",
    "cublaslt:id66.tile8x1024.stages768xAUTO.sk32.red4.swz0.co15.cl16x1x1.in0",
]

BF16 = GemmProblem(16, 4096, 4096, torch.bfloat16, torch.bfloat16)
FP8 = GemmProblem(16, 4096, 4096, torch.float8_e4m3fn, torch.bfloat16, scaling=Scaling.rowwise)


# --------------------------------------------------------------------------------------------
# Names (CPU)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_name_round_trip(name):
    algo = LtAlgo.from_name(name)
    assert algo.name == name
    assert LtAlgo.from_name(algo.name) == algo
    assert name.startswith(KERNEL_PREFIX + ":")


def test_fields_read_back():
    algo = LtAlgo.from_name(NAMES[0])
    assert algo == LtAlgo(algo_id=66, tile="64x8", stages="64xAUTO", split_k=4, reduction=2,
                          swizzle=0, custom=1, cluster="1x2x1", inner=0)


@pytest.mark.parametrize("bad, says", [
    ("triton.tile:BM16.BN16.BK16.G1.W4.S2", "prefix"),
    ("cublaslt", "prefix"),
    ("cublaslt:id66.tile64x8.stages64xAUTO.sk4.red2.swz0.co1.cl1x2x1", "fields"),
    ("cublaslt:id66.tile64x8.stages64xAUTO.sk4.red2.swz0.co1.cl1x2x1.in0.x1", "fields"),
    ("cublaslt:id66.tileBIG.stages64xAUTO.sk4.red2.swz0.co1.cl1x2x1.in0", "tileBIG"),
    ("cublaslt:id66.stages64xAUTO.tile64x8.sk4.red2.swz0.co1.cl1x2x1.in0", "stages64xAUTO"),
    ("cublaslt:id66.tile64x8.stages64xAUTO.sk-1.red2.swz0.co1.cl1x2x1.in0", "sk-1"),
    ("cublaslt:id66.tile64x8.stages64xAUTO.sk4.red3.swz0.co1.cl1x2x1.in0", "reduction"),
    ("cublaslt:id66.tile64x8.stages64xAUTO.sk4.red2.swz0.co1.cl1x2.in0", "cl1x2"),
    ("cublaslt:ID66.tile64x8.stages64xAUTO.sk4.red2.swz0.co1.cl1x2x1.in0", "ID66"),
])
def test_bad_names_say_what_is_expected(bad, says):
    assert_bad_name(LtAlgo.from_name, bad, says, "cublaslt:id<int>")  # the accepted form is shown


def test_bad_field_values_are_refused():
    with pytest.raises(ValueError, match="cluster"):
        LtAlgo(66, "64x8", "64xAUTO", 4, 2, 0, 1, "1x2", 0)
    with pytest.raises(ValueError, match="algo_id"):
        LtAlgo(True, "64x8", "64xAUTO", 4, 2, 0, 1, "AUTO", 0)


@pytest.mark.parametrize("kernel_cls", [CublasLtKernel, CublasLtScaledKernel])
def test_kernels_are_their_names_without_a_gpu(kernel_cls):
    for name in NAMES:
        kernel = kernel_cls(name)
        assert kernel.name == name and kernel.algo == LtAlgo.from_name(name)
        assert kernel_cls(kernel.name).algo == kernel.algo
    # Leading zeros parse; the kernel then carries the canonical name a table row is written with.
    assert kernel_cls(NAMES[0].replace("id66", "id066")).name == NAMES[0]
    with pytest.raises(ValueError, match=re.escape(f"{KERNEL_PREFIX}:id<int>.tile<R>x<C>")):
        kernel_cls("cublaslt:nope")


def test_registries_resolve_rows_to_kernels_and_explain_bad_names():
    from gemmtune.dispatch import KernelNameError
    from gemmtune.families.a8w8.op import REGISTRY as A8W8
    from gemmtune.families.bf16.op import REGISTRY as BF16_REGISTRY

    for registry, kernel_cls in ((BF16_REGISTRY, CublasLtKernel), (A8W8, CublasLtScaledKernel)):
        kernel = registry.resolve(NAMES[1])
        assert type(kernel) is kernel_cls and kernel.name == NAMES[1]
        with pytest.raises(KernelNameError, match=re.escape(f"{KERNEL_PREFIX}:id<int>")):
            registry.resolve(NAMES[1].rsplit(".", 1)[0])  # the inner shape left out


def test_split_k_values_surround_the_heuristic():
    assert _split_k_values(5, 7168) == [4, 6, 3, 7, 2, 1, 10]
    assert _split_k_values(1, 4096) == [2, 3]
    # Splits shorter than 128 along K are not tried.
    assert _split_k_values(2, 520) == [1, 3, 4]


def test_wanted_tiles_follow_m():
    labels = ["64x8", "64x16", "128x16", "128x32", "256x64", "64x256", "96x16", "UNDEFINED"]
    assert _wanted_tiles(13, set(), labels) == ["64x8", "64x16", "128x16", "128x32"]
    assert _wanted_tiles(1, {"96x16"}, labels) == ["64x8", "64x16", "128x16", "96x16"]


# --------------------------------------------------------------------------------------------
# Without nvmath, without a GPU (CPU)
# --------------------------------------------------------------------------------------------

def test_imports_and_explains_without_nvmath_or_gpu():
    # A fresh interpreter where `import nvmath` fails and no GPU is visible.
    script = textwrap.dedent(f"""
        import sys
        sys.modules["nvmath"] = None  # makes `import nvmath...` raise ImportError
        import torch
        from gemmtune.kernels import cublaslt
        from gemmtune.kernels.problem import GemmProblem, Scaling
        k = cublaslt.CublasLtKernel({NAMES[0]!r})
        why = k.check(GemmProblem(16, 4096, 4096, torch.bfloat16, torch.bfloat16))
        assert {INSTALL_HINT!r} in why, why
        scaled = cublaslt.CublasLtScaledKernel({NAMES[0]!r})
        why = scaled.check(GemmProblem(16, 4096, 4096, torch.float8_e4m3fn, torch.bfloat16,
                                       scaling=Scaling.rowwise))
        assert {INSTALL_HINT!r} in why, why
        try:
            cublaslt.enumerate_algos(16, 64, 64, torch.bfloat16, torch.bfloat16, False)
        except ImportError as e:
            assert {INSTALL_HINT!r} in str(e), e
        else:
            raise AssertionError("enumerate_algos ran without nvmath")
        print("ok")
    """)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize("change, says", [
    (dict(scaling=Scaling.tensor), "tensor scales"),
    (dict(scaling=Scaling.rowwise), "rowwise scales"),
    (dict(preshuffled=True), "shuffled"),
    (dict(dtype=torch.float32, out_dtype=torch.float32), "float32"),
    (dict(dtype=torch.float8_e4m3fn), "float8"),
    (dict(out_dtype=torch.float16), "float16"),
    (dict(dtype="torch.bfloat16"), "torch.dtype"),  # table names are mapped above the kernels
])
def test_check_refuses_unsupported_problems_with_a_reason(change, says):
    why = CublasLtKernel(NAMES[0]).check(replace(BF16, **change))
    assert isinstance(why, str) and says in why


@pytest.mark.parametrize("change, says", [
    (dict(scaling=Scaling.none), "none scales"),
    (dict(scaling=Scaling.block), "block scales"),
    (dict(preshuffled=True), "shuffled"),
    (dict(dtype=torch.int8), "FP8 (e4m3) only"),
    (dict(dtype=torch.bfloat16), "FP8 (e4m3) only"),
    (dict(out_dtype=torch.int8), "output"),
])
def test_scaled_check_refuses_unsupported_problems_with_a_reason(change, says):
    why = CublasLtScaledKernel(NAMES[0]).check(replace(FP8, **change))
    assert isinstance(why, str) and says in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
@pytest.mark.parametrize("kernel_cls, problem", [(CublasLtKernel, BF16),
                                                 (CublasLtScaledKernel, FP8)])
def test_check_on_a_cpu_machine_gives_a_reason(kernel_cls, problem):
    why = kernel_cls(NAMES[0]).check(problem)
    assert isinstance(why, str) and ("GPU" in why or INSTALL_HINT in why)


@pytest.mark.skipif(torch.cuda.is_available() and cublaslt.nvmath_missing() is None,
                    reason="checks the answer where cuBLASLt cannot run")
def test_a8w8_row_that_cannot_run_here_falls_back_with_the_kernels_reason(tmp_path, monkeypatch):
    from gemmtune.families.a8w8.op import DISPATCH, A8w8Key

    install_user_table(monkeypatch, tmp_path / "a8w8.csv", "GEMMTUNE_CONFIG_A8W8",
                       "arch,cu_num,M,N,K,q_dtype_w,libtype,solidx,splitK,us,kernelName,"
                       "err_ratio,tflops,bw\n",
                       [(16, 4096, 4096, "torch.float8_e4m3fn", NAMES[0])])
    with pytest.warns(UserWarning, match="cannot run this shape") as caught:
        decision = DISPATCH.decide(A8w8Key(16, 4096, 4096, "torch.float8_e4m3fn"))
    assert decision.kernel_name != NAMES[0] and NAMES[0] in decision.note  # the default runs
    assert any("GPU" in str(w.message) or INSTALL_HINT in str(w.message) for w in caught)


def test_labels_cover_every_cublaslt_enum():
    """Every tile/stages/cluster label nvmath knows fits the name's pattern (CPU; needs nvmath)."""
    L = pytest.importorskip("nvmath.bindings.cublasLt", reason="nvmath-python not installed")
    base = LtAlgo.from_name(NAMES[0])
    for enum_cls, prefix, field in ((L.MatmulTile, "TILE_", "tile"),
                                    (L.MatmulStages, "STAGES_", "stages"),
                                    (L.ClusterShape, "SHAPE_", "cluster")):
        for member in enum_cls:
            text = label(enum_cls, prefix, int(member))
            algo = LtAlgo(**{**base.__dict__, field: text})
            assert LtAlgo.from_name(algo.name) == algo
            assert enum_value(enum_cls, prefix, text, field) == int(member)


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------

SHAPES = [(1, 576, 7168), (16, 4096, 4096), (13, 1000, 520), (128, 4096, 4096),
          (1024, 4096, 4096)]

# Relative Frobenius error against an fp64 reference. bf16 output rounds each element to nearest
# (half an ulp = 2^-9 relative), so the norm ratio is <= 2^-9 ~ 2e-3; 1e-2 leaves 5x for fp32
# accumulation-order effects. fp32 output is the fp32 accumulator: K adds of ~2^-24 each give
# ~sqrt(K) * 2^-24 ~ 4e-6 for K = 7168 in practice; 1e-4 leaves 25x.
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


@pytest.fixture
def nvmath_lt():
    return pytest.importorskip(
        "nvmath.bindings.cublasLt",
        reason=f"nvmath-python is not importable; `{INSTALL_HINT}` to run the cuBLASLt tests")


def _inputs(m, n, k, dtype=torch.bfloat16, seed=0, bias=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen, device="cuda").to(dtype) if bias else None
    return x, w, b


def _ref(x, w, b=None):
    y = x.double() @ w.double().t()
    return y + b.double() if b is not None else y


def _rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


def _run_poisoned(kernel, x, w, b, out_dtype):
    out = torch.full((*x.shape[:-1], w.shape[0]), float("nan"), dtype=out_dtype, device="cuda")
    got = kernel(x, w, b, out_dtype, None, None, out=out)
    assert got is out
    torch.cuda.synchronize()
    return out


def _check_all(m, n, k, out_dtype, bias):
    x, w, b = _inputs(m, n, k, bias=bias)
    ref = _ref(x, w, b)
    algos = enumerate_algos(m, n, k, x.dtype, out_dtype, bias)
    assert algos, f"no algorithms for {m}x{n}x{k}"
    assert len({a.name for a in algos}) == len(algos)
    bad = []
    for algo in algos:
        kernel = CublasLtKernel(algo.name)
        assert kernel.check(GemmProblem(m, n, k, x.dtype, out_dtype, bias)) is None
        y = _run_poisoned(kernel, x, w, b, out_dtype)
        nans = int(torch.isnan(y).sum())
        err = _rel_err(y, ref) if not nans else float("nan")
        if nans or not err < REL_TOL[out_dtype]:
            bad.append(f"{algo.name}: {nans} NaN, rel err {err:.2e}")
    assert not bad, f"{len(bad)}/{len(algos)} algorithms wrong for {m}x{n}x{k}:\n" + \
        "\n".join(bad)
    return algos


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_every_enumerated_algo_is_correct(nvmath_lt, m, n, k):
    algos = _check_all(m, n, k, torch.bfloat16, bias=False)
    heuristic = cublaslt.heuristic_algos(m, n, k, torch.bfloat16, torch.bfloat16, False)
    assert algos[0] == heuristic[0]  # the heuristic's pick is always a candidate, first
    assert len(algos) > len(heuristic)  # and the enumeration goes beyond it


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_every_enumerated_algo_with_bias(nvmath_lt, m, n, k):
    _check_all(m, n, k, torch.bfloat16, bias=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 576, 7168), (13, 1000, 520), (128, 4096, 4096)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_output(nvmath_lt, m, n, k, bias):
    _check_all(m, n, k, torch.float32, bias=bias)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_names_rebuild_the_heuristic_bit_for_bit(nvmath_lt, m, n, k, bias):
    x, w, b = _inputs(m, n, k, seed=1, bias=bias)
    raw_kernels = cublaslt.heuristic_kernels(m, n, k, x.dtype, x.dtype, bias)
    assert raw_kernels
    for raw in raw_kernels:
        named = CublasLtKernel(raw.name)
        assert named is not raw
        assert cublaslt.algo_bytes(named, m, n, k, x.dtype, x.dtype, bias) == \
            cublaslt.algo_bytes(raw, m, n, k, x.dtype, x.dtype, bias), raw.name
        y_raw = _run_poisoned(raw, x, w, b, x.dtype)
        y_named = _run_poisoned(named, x, w, b, x.dtype)
        assert torch.equal(y_raw, y_named), raw.name


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(16, 4096, 4096), (1, 576, 7168)])
def test_cuda_graph_replays_on_new_inputs(nvmath_lt, m, n, k):
    algos = enumerate_algos(m, n, k, torch.bfloat16, torch.bfloat16, True)
    split = [a for a in algos if a.split_k > 1][:1]
    for algo in [algos[0]] + split:
        kernel = CublasLtKernel(algo.name)
        x, w, b = _inputs(m, n, k, seed=2, bias=True)
        kernel(x, w, b, x.dtype, None, None)  # plan before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = kernel(x, w, b, x.dtype, None, None)
        x2, w2, b2 = _inputs(m, n, k, seed=3, bias=True)
        x.copy_(x2)
        w.copy_(w2)
        b.copy_(b2)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(y).any(), f"{algo.name}: replay wrote nothing"
        assert _rel_err(y, _ref(x2, w2, b2)) < REL_TOL[torch.bfloat16], algo.name


@pytest.mark.gpu
def test_leading_dims_strides_and_misaligned_views(nvmath_lt):
    m, n, k = 16, 1000, 520
    kernel = CublasLtKernel(cublaslt.heuristic_algos(m, n, k, torch.bfloat16, torch.bfloat16,
                                                     False)[0].name)
    x, w, _ = _inputs(m, n, k, seed=4)
    ref = _ref(x, w)
    y3 = kernel(x.view(2, 8, k), w, None, x.dtype, None, None)
    assert y3.shape == (2, 8, n)
    assert _rel_err(y3.view(m, n), ref) < 1e-2
    wide = torch.zeros(m, k + 8, dtype=x.dtype, device="cuda")
    wide[:, 3:3 + k] = x  # non-contiguous rows and an address 6 bytes off alignment
    y = kernel(wide[:, 3:3 + k], w, None, x.dtype, None, None)
    assert _rel_err(y, ref) < 1e-2
    flat = torch.zeros(m * k + 1, dtype=x.dtype, device="cuda")
    flat[1:].copy_(x.flatten())  # contiguous but misaligned by one element
    y = kernel(flat[1:].view(m, k), w, None, x.dtype, None, None)
    assert _rel_err(y, ref) < 1e-2
    fp16 = CublasLtKernel(cublaslt.heuristic_algos(m, n, k, torch.float16, torch.float16,
                                                   False)[0].name)
    xh, wh = x.half(), w.half()
    assert _rel_err(fp16(xh, wh, None, torch.float16, None, None), _ref(xh, wh)) < 1e-2


@pytest.mark.gpu
def test_check_on_the_gpu(nvmath_lt):
    m, n, k = BF16.m, BF16.n, BF16.k
    best = cublaslt.heuristic_algos(m, n, k, torch.bfloat16, torch.bfloat16, False)[0]
    assert CublasLtKernel(best.name).check(BF16) is None
    # A configuration cuBLASLt refuses (id 66 rejects an AUTO cluster shape) is a reason.
    refused = LtAlgo(**{**best.__dict__, "cluster": "AUTO"})
    why = CublasLtKernel(refused.name).check(BF16)
    assert isinstance(why, str) and refused.name in why
    with pytest.raises(ValueError, match="scale"):
        CublasLtKernel(best.name)(*_inputs(m, n, k)[:2], None, torch.bfloat16,
                                  torch.ones((), device="cuda"), None)


# --------------------------------------------------------------------------------------------
# FP8 with scales (the a8w8 table's cublaslt rows)
# --------------------------------------------------------------------------------------------

def test_why_not_types():
    assert cublaslt.why_not_types(torch.float8_e4m3fn, torch.bfloat16, "") is not None
    assert cublaslt.why_not_types(torch.bfloat16, torch.bfloat16, "outer") is not None
    assert cublaslt.why_not_types(torch.float8_e4m3fn, torch.bfloat16, "outer") is None
    assert "output" in cublaslt.why_not_types(torch.float8_e4m3fn, torch.int8, "tensor")


def _fp8_inputs(m, n, k, layout, seed=0, bias=False):
    from gemmtune import quant

    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_token, per_channel = quant.token_channel_quantisers(torch.float8_e4m3fn)
    # A few outlier tokens, so per-token scales differ a lot.
    x = torch.randn(m, k, generator=gen, device="cuda") \
        * (1 + 4 * torch.rand(m, 1, generator=gen, device="cuda"))
    (xq, xs), (wq, ws) = per_token(x), per_channel(torch.randn(n, k, generator=gen,
                                                                device="cuda") / k ** 0.5)
    xs, ws = xs.reshape(-1), ws.reshape(-1)
    if layout in ("tensor", "tensor-x"):
        xs = xs.max().reshape(1)
    if layout in ("tensor", "tensor-w"):
        ws = ws.max().reshape(1)
    b = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16) if bias else None
    return xq, wq, xs, ws, b


def _fp8_ref(xq, wq, xs, ws, b):
    y = (xq.double() @ wq.double().t()) * xs.double().reshape(-1, 1) \
        * ws.double().reshape(1, -1)
    return y + b.double() if b is not None else y


FP8_SHAPES = [(1, 576, 7168), (16, 4096, 4096), (13, 1008, 512), (200, 4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", FP8_SHAPES)
def test_fp8_enumerated_algos_are_correct_in_every_scale_layout(nvmath_lt, m, n, k):
    algos = enumerate_algos(m, n, k, torch.float8_e4m3fn, torch.bfloat16, False,
                            scaling="outer")
    assert algos, f"no FP8 algorithms for {m}x{n}x{k}"
    bad, exercised = [], 0
    for algo in algos:
        kernel = CublasLtScaledKernel(algo.name)
        if kernel.check(GemmProblem(m, n, k, torch.float8_e4m3fn, torch.bfloat16,
                                    scaling=Scaling.rowwise)) is not None:
            continue  # not plannable per tensor: the tuner's check drops it the same way
        exercised += 1
        for layout in ("outer", "tensor", "tensor-x", "tensor-w"):
            for bias in (False, True):
                xq, wq, xs, ws, b = _fp8_inputs(m, n, k, layout, seed=m, bias=bias)
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                got = kernel(xq, wq, b, torch.bfloat16, xs, ws, out=out)
                torch.cuda.synchronize()
                err = _rel_err(got, _fp8_ref(xq, wq, xs, ws, b))
                if got is not out or not err < REL_TOL[torch.bfloat16]:
                    bad.append(f"{algo.name} {layout} bias={bias}: rel err {err:.2e}")
    assert exercised and not bad, "\n".join(bad) or "no algorithm passed check()"


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_fp8_other_outputs_with_bias_run_or_fall_back_to_torch(nvmath_lt, out_dtype):
    """check() plans bf16 output without bias (what rows are tuned for); any other call either
    plans too or runs torch with one warning, never fails."""
    import warnings

    m, n, k = 16, 4096, 4096
    algo = enumerate_algos(m, n, k, torch.float8_e4m3fn, torch.bfloat16, False,
                           scaling="outer")[0]
    kernel = CublasLtScaledKernel(algo.name)
    xq, wq, xs, ws, _ = _fp8_inputs(m, n, k, "outer", seed=8)
    b = torch.randn(n, device="cuda", dtype=out_dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            y = kernel(xq, wq, b, out_dtype, xs, ws)
            assert y.dtype == out_dtype
            assert _rel_err(y, _fp8_ref(xq, wq, xs, ws, b)) < REL_TOL[torch.bfloat16]
    assert len(caught) <= 1  # a refusal warns once, not per call


@pytest.mark.gpu
def test_fp8_cuda_graph_replays_with_new_scales(nvmath_lt):
    m, n, k = 16, 4096, 4096
    algo = enumerate_algos(m, n, k, torch.float8_e4m3fn, torch.bfloat16, False,
                           scaling="outer")[0]
    kernel = CublasLtScaledKernel(algo.name)
    xq, wq, xs, ws, _ = _fp8_inputs(m, n, k, "outer", seed=5)
    kernel(xq, wq, None, torch.bfloat16, xs, ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernel(xq, wq, None, torch.bfloat16, xs, ws)
    xq2, wq2, xs2, ws2, _ = _fp8_inputs(m, n, k, "outer", seed=6)
    for dst, src in ((xq, xq2), (wq, wq2), (xs, xs2), (ws, ws2)):
        dst.copy_(src)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel_err(y, _fp8_ref(xq2, wq2, xs2, ws2, None)) < REL_TOL[torch.bfloat16]


@pytest.mark.gpu
def test_fp8_row_dispatches_through_gemm_a8w8(nvmath_lt, tmp_path, monkeypatch):
    import gemmtune
    from gemmtune.families.a8w8.op import DISPATCH

    m, n, k = 16, 4096, 4096
    algo = enumerate_algos(m, n, k, torch.float8_e4m3fn, torch.bfloat16, False,
                           scaling="outer")[0]
    install_user_table(monkeypatch, tmp_path / "a8w8.csv", "GEMMTUNE_CONFIG_A8W8",
                       "arch,cu_num,M,N,K,q_dtype_w,libtype,solidx,splitK,us,kernelName,"
                       "err_ratio,tflops,bw\n",
                       [(m, n, k, "torch.float8_e4m3fn", algo.name)])
    xq, wq, xs, ws, b = _fp8_inputs(m, n, k, "outer", seed=7, bias=True)
    y = gemmtune.gemm_a8w8(xq, wq, xs.reshape(-1, 1), ws.reshape(-1, 1), b)
    assert _rel_err(y, _fp8_ref(xq, wq, xs, ws, b)) < REL_TOL[torch.bfloat16]
    (plan,) = DISPATCH.plans.values()
    assert plan.decision.kernel_name == algo.name


# --------------------------------------------------------------------------------------------
# Concurrency: two streams, two threads
# --------------------------------------------------------------------------------------------

# Skinny and long along K: cuBLASLt's split-K territory (the heuristic picks split-K 2-5 for
# M = 16 at K >= 4096 on H100), and N small enough that a GEMM may leave SMs for the other
# stream's.
CONCURRENT = (16, 2048, 8192)
ROUNDS = 64  # calls per stream or thread


def _workspace_algos(m, n, k, dtype, out_dtype, bias, scaling="", most=2) -> list[LtAlgo]:
    """Split-K algorithms whose plans use a workspace (partial sums in the compute or output
    type, or the in-place scheme's counters): the enumerated ones first, then the heuristic's
    first with split-K forced."""
    algos = enumerate_algos(m, n, k, dtype, out_dtype, bias, scaling=scaling)
    if not algos:
        return []
    tries = [a for a in algos if a.split_k > 1] + [
        replace(algos[0], split_k=sk, reduction=red) for sk in (4, 8) for red in (2, 4)]
    found, device = [], torch.cuda.current_device()
    for algo in tries:
        try:
            plan = cublaslt.get_plan(algo, m, n, k, bias, dtype, out_dtype, device, scaling)
        except ValueError:
            continue
        if plan.workspace_bytes and algo not in found:
            found.append(algo)
    return found[:most]


def _hold(streams) -> None:
    """Keep each stream busy for ~50 ms (10^8 cycles at 1.5-2 GHz), so that every call
    enqueued next waits behind it and the two streams' queues then drain together. The host
    enqueues a call in ~15-30 us, about as long as one of these GEMMs runs: without the hold the
    streams would hardly overlap. 2 x 64 calls take ~4 ms to enqueue, well inside the hold."""
    for s in streams:
        with torch.cuda.stream(s):
            torch.cuda._sleep(10**8)


def _on_two_streams(call) -> tuple[list[list[torch.Tensor]], list[torch.cuda.Stream]]:
    """``call(i, out)`` for stream i = 0, 1, ROUNDS times each, interleaved, never syncing in
    between; every output is its own NaN-poisoned buffer. The outputs of each stream, and the
    streams."""
    m, n, _ = CONCURRENT
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [[torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
             for _ in range(ROUNDS)] for _ in streams]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())  # inputs and NaN fills first
    _hold(streams)
    for r in range(ROUNDS):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                assert call(i, outs[i][r]) is outs[i][r]
    torch.cuda.synchronize()
    return outs, streams


def _wrong(outs, refs) -> list[str]:
    """Every output against its fp32 reference; REL_TOL's bound (bf16 rounding leaves ~2e-3).
    An output that took another call's partial sums, bias or scales is off by O(1)."""
    bad = []
    for i, (runs, ref) in enumerate(zip(outs, refs)):
        for r, y in enumerate(runs):
            err = _rel_err(y, ref.double())
            if not err < REL_TOL[torch.bfloat16]:  # NaN (an unwritten output) fails too
                bad.append(f"stream/thread {i} call {r}: rel err {err:.2e}")
    return bad


@pytest.mark.gpu
def test_two_streams_at_once_with_split_k_workspaces(nvmath_lt):
    """Same shape, different inputs and biases on two streams. Were one workspace shared by the
    device's streams, both streams' split-K GEMMs would write their partial sums (or the
    in-place scheme's counters) into the same buffer; with the queues draining together, one
    stream's reduction would read the other's partials and its rows come out wrong."""
    m, n, k = CONCURRENT
    algos = _workspace_algos(m, n, k, torch.bfloat16, torch.bfloat16, True)
    assert algos, f"no split-K algorithm with a workspace for {m}x{n}x{k}"
    inputs = [_inputs(m, n, k, seed=20 + i, bias=True) for i in range(2)]
    refs = [gemm_a16w16_ref(x, w, b, torch.float32) for x, w, b in inputs]
    for algo in algos:
        kernel = CublasLtKernel(algo.name)
        assert kernel.check(GemmProblem(m, n, k, torch.bfloat16, torch.bfloat16, True)) is None
        outs, streams = _on_two_streams(
            lambda i, out: kernel(*inputs[i], torch.bfloat16, None, None, out=out))
        bad = _wrong(outs, refs)
        assert not bad, f"{algo.name}:\n" + "\n".join(bad)
        plan = kernel._plans[(m, n, k, True, torch.bfloat16, torch.bfloat16, "",
                              torch.cuda.current_device())]
        assert len({plan.workspaces[s.cuda_stream] for s in streams}) == 2


@pytest.mark.gpu
def test_fp8_two_streams_at_once_with_per_row_scales(nvmath_lt):
    """FP8 with per-row scales, different inputs and scales on each stream. Where cuBLASLt has
    FP8 split-K algorithms with a workspace, a workspace shared by the streams would corrupt
    results as in the bf16 test. Every algorithm also shows that cuBLASLt reads the scale
    pointers when a call is enqueued: all calls wait behind the hold while the descriptor's pointers change
    from call to call, so a later read would give many calls another's scales."""
    m, n, k = CONCURRENT
    algos = _workspace_algos(m, n, k, torch.float8_e4m3fn, torch.bfloat16, False, "outer") or \
        enumerate_algos(m, n, k, torch.float8_e4m3fn, torch.bfloat16, False, scaling="outer")[:1]
    assert algos, f"no FP8 algorithm for {m}x{n}x{k}"
    inputs = [_fp8_inputs(m, n, k, "outer", seed=30 + i) for i in range(2)]
    refs = [gemm_a8w8_ref(xq, wq, xs, ws, None, torch.float32) for xq, wq, xs, ws, _ in inputs]
    for algo in algos:
        kernel = CublasLtScaledKernel(algo.name)
        outs, _ = _on_two_streams(lambda i, out: kernel(
            inputs[i][0], inputs[i][1], None, torch.bfloat16, inputs[i][2], inputs[i][3],
            out=out))
        assert not kernel._refused, f"{algo.name} ran torch, not cuBLASLt"
        bad = _wrong(outs, refs)
        assert not bad, f"{algo.name}:\n" + "\n".join(bad)


def _in_two_threads(call) -> list[list[torch.Tensor]]:
    """``call(i)`` ROUNDS times in each of two threads (i = 0, 1) at once, each on a stream of
    its own; the outputs of each thread, or the first error a thread raised. A barrier starts
    the loops together, and a 1 us GIL switch interval hands the GIL between the threads inside
    every call (the default 5 ms would let a whole loop run alone)."""
    barrier, errors = threading.Barrier(2), []
    outs: list[list[torch.Tensor]] = [[], []]

    def work(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                barrier.wait()
                for _ in range(ROUNDS):
                    outs[i].append(call(i))
            stream.synchronize()
        except BaseException as e:  # re-raised by the main thread
            errors.append(e)
            barrier.abort()

    torch.cuda.synchronize()  # inputs made on the default stream
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    return outs


def _no_workspace_algo(m, n, k, dtype, out_dtype, bias, scaling="") -> LtAlgo:
    """An enumerated algorithm that uses no workspace where there is one: then only the
    descriptor can mix two threads' calls up."""
    algos = enumerate_algos(m, n, k, dtype, out_dtype, bias, scaling=scaling)
    assert algos, f"no {dtype} algorithm for {m}x{n}x{k}"
    device = torch.cuda.current_device()
    for algo in algos:
        if not cublaslt.get_plan(algo, m, n, k, bias, dtype, out_dtype, device,
                                 scaling).workspace_bytes:
            return algo
    return algos[0]


@pytest.mark.gpu
def test_two_threads_at_once_one_shape_with_bias(nvmath_lt):
    """Two threads call one shape with bias, each with its own input and bias. Were the shape's
    descriptor shared by the threads, one could write its bias pointer into it between another's
    write and cublasLtMatmul: that call would then add the other thread's bias (off by ~1
    relative, since bias and product are both ~N(0, 1))."""
    m, n, k = CONCURRENT
    algo = _no_workspace_algo(m, n, k, torch.bfloat16, torch.bfloat16, True)
    kernel = CublasLtKernel(algo.name)
    assert kernel.check(GemmProblem(m, n, k, torch.bfloat16, torch.bfloat16, True)) is None
    x0, w, b0 = _inputs(m, n, k, seed=40, bias=True)
    x1, _, b1 = _inputs(m, n, k, seed=41, bias=True)
    inputs = [(x0, w, b0), (x1, w, b1)]
    outs = _in_two_threads(lambda i: kernel(*inputs[i], torch.bfloat16, None, None))
    refs = [gemm_a16w16_ref(x, w, b, torch.float32) for x, w, b in inputs]
    bad = _wrong(outs, refs)
    assert not bad, f"{algo.name}:\n" + "\n".join(bad)


@pytest.mark.gpu
def test_fp8_two_threads_at_once_with_their_own_scales(nvmath_lt):
    """Two threads call one FP8 shape with per-row scales, each with its own inputs and scales.
    Were the shape's descriptor shared by the threads, it would hold the last scale pointers
    either wrote, so a call could run with the other thread's scales (per-token scales here differ up to 5x
    from row to row, and the threads' weights differ: off by O(1))."""
    m, n, k = CONCURRENT
    algo = _no_workspace_algo(m, n, k, torch.float8_e4m3fn, torch.bfloat16, False, "outer")
    kernel = CublasLtScaledKernel(algo.name)
    inputs = [_fp8_inputs(m, n, k, "outer", seed=50 + i) for i in range(2)]
    outs = _in_two_threads(lambda i: kernel(
        inputs[i][0], inputs[i][1], None, torch.bfloat16, inputs[i][2], inputs[i][3]))
    assert not kernel._refused, f"{algo.name} ran torch, not cuBLASLt"
    refs = [gemm_a8w8_ref(xq, wq, xs, ws, None, torch.float32) for xq, wq, xs, ws, _ in inputs]
    bad = _wrong(outs, refs)
    assert not bad, f"{algo.name}:\n" + "\n".join(bad)


@pytest.mark.gpu
def test_the_ops_from_two_streams_and_two_threads_at_once(nvmath_lt):
    """The same through the public ops, forcing a cuBLASLt kernel by name: dispatch's own state
    (plans made by both threads at once, the miss counts) takes part too. gemm_a16w16 with bias
    on a split-K algorithm with a workspace where there is one; gemm_a8w8 with per-token
    scales."""
    m, n, k = CONCURRENT
    bf16_algo = (_workspace_algos(m, n, k, torch.bfloat16, torch.bfloat16, True)
                 or [_no_workspace_algo(m, n, k, torch.bfloat16, torch.bfloat16, True)])[0]
    fp8_algo = _no_workspace_algo(m, n, k, torch.float8_e4m3fn, torch.bfloat16, False, "outer")
    bf16_inputs = [_inputs(m, n, k, seed=60 + i, bias=True) for i in range(2)]
    fp8_inputs = [_fp8_inputs(m, n, k, "outer", seed=70 + i) for i in range(2)]
    bf16_refs = [gemm_a16w16_ref(x, w, b, torch.float32) for x, w, b in bf16_inputs]
    fp8_refs = [gemm_a8w8_ref(xq, wq, xs, ws, None, torch.float32)
                for xq, wq, xs, ws, _ in fp8_inputs]

    def bf16_call(i, out=None):
        y = gemmtune.gemm_a16w16(*bf16_inputs[i], kernel=bf16_algo.name)
        return y if out is None else out.copy_(y)

    def fp8_call(i, out=None):
        xq, wq, xs, ws, _ = fp8_inputs[i]
        y = gemmtune.gemm_a8w8(xq, wq, xs, ws, kernel=fp8_algo.name)
        return y if out is None else out.copy_(y)

    for call, refs in ((bf16_call, bf16_refs), (fp8_call, fp8_refs)):
        gemmtune.reset()  # the threads plan at once, too
        outs = _in_two_threads(call)
        assert not _wrong(outs, refs), "\n".join(_wrong(outs, refs))
        outs, _ = _on_two_streams(call)
        assert not _wrong(outs, refs), "\n".join(_wrong(outs, refs))
    plans = [p for p in gemmtune.get_family("a8w8").dispatcher.plans.values()]
    assert [p.decision.kernel_name for p in plans] == [fp8_algo.name]


@pytest.mark.gpu
def test_scales_made_for_a_call_live_until_cublaslt_has_read_them(nvmath_lt):
    # A per-tensor w scale beside per-token x scales is broadcast to a vector made for the
    # call: the output, allocated after it, must not be handed its memory before the matmul
    # reads it (every call here would then read scales from its own output).
    from gemmtune import quant

    m, n, k = 2, 8192, 4096
    name = cublaslt.heuristic_algos(m, n, k, torch.float8_e4m3fn, torch.bfloat16, False,
                                    scaling="outer")[0].name
    wq, ws = quant.per_tensor_fp8(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    for seed in range(4):
        torch.manual_seed(seed)
        xq, xs = quant.per_token_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        y = gemmtune.gemm_a8w8(xq, wq, xs, ws.reshape(1, 1), kernel=name)
        ref = gemm_a8w8_ref(xq, wq, xs, ws, None, torch.float32)
        assert float((y.float() - ref).norm() / ref.norm()) < 2e-2, seed


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["bf16", "fp8 tensor", "fp8 outer"])
def test_bound_calls_serve_new_inputs_and_send_odd_layouts_the_general_way(nvmath_lt, case):
    """The ops' bound cuBLASLt calls (the checks the key does not pin, then the matmul): fresh
    inputs every call, 3-D x, and an x at an address cuBLASLt's algorithm cannot take, which
    goes the general way (a copy) and is still right."""
    m, n, k = 8, 512, 256
    fp8 = case.startswith("fp8")
    scaling = "" if not fp8 else case.split()[1]
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    name = cublaslt.heuristic_algos(m, n, k, dtype, torch.bfloat16, False,
                                    **({"scaling": scaling} if fp8 else {}))[0].name
    for seed in range(3):
        if fp8:
            xq, wq, xs, ws, _ = _fp8_inputs(m, n, k, scaling, seed=seed)
            call = lambda x: gemmtune.gemm_a8w8(x, wq, xs, ws, kernel=name)  # noqa: E731
            ref = lambda x: _fp8_ref(x, wq, xs, ws, None)  # noqa: E731
            x = xq
        else:
            x, w, _ = _inputs(m, n, k, seed=seed)
            call = lambda x: gemmtune.gemm_a16w16(x, w, kernel=name)  # noqa: E731
            ref = lambda x: gemm_a16w16_ref(x, w, None, torch.float64)  # noqa: E731
        for _ in range(2):  # the first plans and binds; the second is the bound call
            assert _rel_err(call(x), ref(x)) < REL_TOL[torch.bfloat16]
        bound = list(gemmtune.get_family("a8w8" if fp8 else "bf16").dispatcher.calls.values())
        assert any("_bound_launch" in fn.__qualname__ for fn in bound)
        x3 = x.reshape(2, m // 2, k)
        assert _rel_err(call(x3).reshape(m, n), ref(x)) < REL_TOL[torch.bfloat16]
        # Two bytes past an aligned block: not an address the algorithm takes.
        odd = torch.empty(m * k + 16, dtype=x.dtype, device="cuda")[2:2 + m * k].view(m, k)
        odd.copy_(x)
        assert odd.data_ptr() % 16
        assert _rel_err(call(odd), ref(x)) < REL_TOL[torch.bfloat16]


@pytest.mark.gpu
def test_bound_calls_keep_their_plans_through_clear_plans(nvmath_lt):
    # A bound call holds its plan: forgetting the plans must not destroy the descriptors it
    # still launches with.
    m, n, k = 8, 512, 256
    name = cublaslt.heuristic_algos(m, n, k, torch.bfloat16, torch.bfloat16, False)[0].name
    for seed in range(3):
        x, w, _ = _inputs(m, n, k, seed=seed)
        y = gemmtune.gemm_a16w16(x, w, kernel=name)
        assert _rel_err(y, gemm_a16w16_ref(x, w, None, torch.float64)) < REL_TOL[torch.bfloat16]
        cublaslt.clear_plans()

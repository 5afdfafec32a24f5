"""The fused-MoE stage and one-stage kernels and the FP8 quantiser compile for sm_90 on this CPU machine: the
interpreter runs the other tests without compiling anything, so what only a compile refuses (a
global the jitted code reads, an FP8 dot's constraints) would otherwise first fail on a GPU."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).parent.parent / "src"

SCRIPT = textwrap.dedent("""
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from gemmtune.kernels.triton import moe_one_stage, moe_persistent, moe_quant, moe_stages

    def ptx(kernel, pointers, constexprs):
        names = inspect.signature(kernel.fn).parameters
        signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i32")
                     for n in names}
        return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    routing = {n: "*i32" for n in ("sorted_ids_ptr", "block_expert_ptr", "block_rows_ptr",
                                   "rows_used_ptr", "topk_ids_ptr", "expert_map_ptr")}
    fp32 = {n: "*fp32" for n in ("inter_ptr", "partial_ptr", "topk_weight_ptr", "xs_ptr",
                                 "is_ptr", "ws_ptr", "qs_ptr")}
    quant_out = {"arrivals_ptr": "*i32", "q_ptr": "*fp8e4nv"}
    no_quant_out = dict(QUANT_OUT=False, FP8_MAX=448.0, AMAX_FLOOR=1e-12, ONE_TILE=True,
                        BLOCK_Q=16, ROUTING_READY=False)
    tiles = dict(PAIR_BLOCKS=False, PDL=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                 INPUT_PRECISION="tf32")
    for dtype, scaled, mma in (("bf16", 0, "bf16.bf16"), ("fp8e4nv", 1, "e4m3.e4m3"),
                               ("fp8e4nv", 2, "e4m3.e4m3")):
        first = ptx(moe_stages.moe_stage1_kernel,
                    {**routing, **fp32, **quant_out, "x_ptr": f"*{dtype}",
                     "w1_ptr": f"*{dtype}"},
                    dict(TOPK=2, ACT=0, MUL_WEIGHT=False, SCALED=scaled,
                         SPLIT_K=2 if scaled else 1,  # FP8: parts added atomically
                         **{**no_quant_out, "ROUTING_READY": bool(scaled)}, **tiles))
        second = ptx(moe_stages.moe_stage2_kernel,
                     {**routing, **fp32, "inter_ptr": f"*{dtype}", "w2_ptr": f"*{dtype}"},
                     dict(MUL_WEIGHT=True, SCALED=scaled, SPLIT_K=1, **tiles))
        assert "wgmma.mma_async" in first and mma in first and mma in second, (dtype, scaled)
        # The routing read before waiting for the launch before where it was in place already
        # (stage 2; stage 1 after the activations' quantiser), after it where not.
        assert -1 < first.find("ld.global") and -1 < first.find("griddepcontrol.wait")
        loads_first = first.find("ld.global") < first.find("griddepcontrol.wait")
        assert loads_first == bool(scaled), scaled
        assert -1 < second.find("ld.global") < second.find("griddepcontrol.wait")
    # The persistent stages with FP8 operands through TMA: stage 1 with per-row scales as
    # written, stage 2 with block scales flattened.
    first = ptx(moe_persistent.moe_stage1_tma_kernel,
                {**routing, **fp32, "x_ptr": "*fp8e4nv",
                 "w1_desc": "tensordesc<fp8e4nv[128, 64]>"},
                dict(TOPK=2, ACT=0, MUL_WEIGHT=False, SCALED=1, INPUT_PRECISION="tf32",
                     PDL=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, FLATTEN=False))
    second = ptx(moe_persistent.moe_stage2_tma_kernel,
                 {**routing, **fp32, "partial_ptr": "*bf16",
                  "inter_desc": "tensordesc<fp8e4nv[128, 64]>",
                  "w2_desc": "tensordesc<fp8e4nv[256, 64]>"},
                 dict(MUL_WEIGHT=True, SCALED=2, INPUT_PRECISION="tf32", PDL=True,
                      BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, FLATTEN=True))
    assert all("e4m3.e4m3" in k and "cp.async.bulk.tensor" in k for k in (first, second))
    one_stage = ptx(moe_one_stage.moe_one_stage_kernel,
                    {**{n: "*bf16" for n in ("x_ptr", "w1_ptr", "w2_ptr", "out_ptr",
                                             "inter_ptr")},
                     **{n: "*i32" for n in ("ready_ptr", "done_ptr", "converted_ptr",
                                            "topk_ids_ptr", "expert_map_ptr")},
                     "acc_ptr": "*fp32", "topk_weight_ptr": "*fp32", "trace_ptr": "*i64"},
                    dict(TOPK=2, TOPK_P2=2, ACT=0, MUL_WEIGHT1=False, INPUT_PRECISION="tf32",
                         PDL=True, BLOCK_T=16, BLOCK_N=64, BLOCK_K=64, BLOCK_D=64, BLOCK_I=64,
                         TRACE=False))
    assert "bf16.bf16" in one_stage
    # Stage 1 quantising its own output, split or not, in one tile or two passes: the count's
    # acquire-release atomic, and the other programs' rows read past L1.
    for split, one_tile in ((1, True), (2, False)):
        first = ptx(moe_stages.moe_stage1_kernel,
                    {**routing, **fp32, **quant_out, "x_ptr": "*fp8e4nv", "w1_ptr": "*fp8e4nv"},
                    dict(TOPK=2, ACT=0, MUL_WEIGHT=False, SCALED=1, SPLIT_K=split,
                         **{**no_quant_out, "QUANT_OUT": True, "ONE_TILE": one_tile,
                            "BLOCK_Q": 256}, **{**tiles, "PAIR_BLOCKS": split == 2}))
        assert "gpu.acq_rel.add" in first and "ld.global.cg" in first and \
            "cvt.rn.satfinite.e4m3x2.f32" in first, (split, one_tile)
    moe_sum = ptx(moe_stages.moe_sum_kernel,
                  {"partial_ptr": "*bf16", "topk_ids_ptr": "*i32", "expert_map_ptr": "*i32",
                   "out_ptr": "*bf16"}, dict(TOPK=6, TOPK_P2=8, PDL=True, SPECULATE=False,
                                            BLOCK_D=1024))
    assert "ld.global" in moe_sum
    moe_sum = ptx(moe_stages.moe_sum_kernel,
                  {"partial_ptr": "*bf16", "topk_ids_ptr": "*i32", "expert_map_ptr": "*i32",
                   "out_ptr": "*bf16"}, dict(TOPK=6, TOPK_P2=8, PDL=True, SPECULATE=True,
                                            BLOCK_D=1024))
    assert "ld.global" in moe_sum
    # Every row; a grouped routing's; pair blocks'; gate and up sums (a split stage 1's), in
    # one tile or two passes.
    for routed, gated, one_tile, chunks in ((0, False, True, 1), (1, False, False, 1),
                                            (2, True, True, 1), (1, True, False, 1),
                                            (0, False, True, 4)):
        quantiser = ptx(moe_quant.quant_rows_kernel,
                        {"x_ptr": "*fp32", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
                         "routed_a_ptr": "*i32", "routed_b_ptr": "*i32"},
                        dict(FP8_MAX=448.0, AMAX_FLOOR=1e-12, SCALE_GIVEN=False, WRITE_Q=True,
                             ROUTED=routed, ROUTED_BLOCK_M=16, GATED=gated, ACT=0,
                             PDL=True, ONE_TILE=one_tile, BLOCK_D=128, CHUNKS=chunks))
        # Divisions rounded to nearest, as torch's: an approximate one would move FP8 roundings.
        # (The gated values' SiLU divides as stage 1's activation does.)
        assert "div.rn.f32" in quantiser and (gated or "div.approx" not in quantiser \\
            and "div.full" not in quantiser)
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels' own tests compile "
                                                        "them for real")
def test_moe_stage_kernels_and_the_fp8_quantiser_compile_for_sm90():
    compiles_for_hopper(SCRIPT)


def compiles_for_hopper(script: str, *args: str) -> None:
    """Run ``script`` (it compiles kernels for sm_90 and prints "ok") outside the interpreter,
    ``args`` its command line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SRC)
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


GEMV_SCRIPT = textwrap.dedent("""
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from gemmtune.kernels.triton import gemm_gemv, gemm_splitk

    def ptx(kernel, dtype, constexprs, **options):
        # What a launch specialises on its own: 16-byte aligned pointers, K and row strides
        # divisible by 16, unit K strides.
        names = list(inspect.signature(kernel.fn).parameters)
        aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
                   if n.endswith("_ptr") or n in ("K", "stride_xm", "stride_wn")}
        constexprs = {**constexprs, "stride_xk": 1, "stride_wk": 1, "stride_yn": 1}
        pointers = {n: "*fp32" for n in ("scale_a_ptr", "scale_b_ptr", "part_ptr")}
        pointers.update(x_ptr=f"*{dtype}", w_ptr=f"*{dtype}", y_ptr="*bf16", bias_ptr="*bf16",
                        count_ptr="*i32")
        signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i32")
                     for n in names}
        return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                        attrs=aligned),
                              target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    gemv = gemm_gemv.gemm_gemv_kernel
    common = dict(HAS_BIAS=True, SPLIT_CHUNK=16, PDL=1)
    whole_k = [ptx(gemv, "bf16", dict(SCALE_A=0, SCALE_B=0, USE_WORKSPACE=False, BLOCK_M=1,
                                      BLOCK_N=4, BLOCK_K=1024, STAGES=stages, W_TILED=False,
                                      **common))
               for stages in (1, 2)]
    split = ptx(gemv, "fp8e4nv", dict(SCALE_A=3, SCALE_B=3, USE_WORKSPACE=True, BLOCK_M=2,
                                      BLOCK_N=4, BLOCK_K=1024, STAGES=1, W_TILED=False, **common))
    # A pre-shuffled w (whole 128-byte rows of tiles) streams in 16-byte vectors too.
    tiled = ptx(gemv, "fp8e4nv", dict(SCALE_A=1, SCALE_B=1, USE_WORKSPACE=True, BLOCK_M=1,
                                      BLOCK_N=4, BLOCK_K=1024, STAGES=2, W_TILED=True, **common))
    evict_first = "ld.global.L1::evict_first.L2::cache_hint.v4"
    for name, text, first_out in (("one step", whole_k[0], True), ("two", whole_k[1], True),
                                  ("block-scaled", split, False), ("tiled", tiled, True)):
        # w streams in 16-byte vectors (unscaled and per-token, tiled too: first to leave the
        # caches; block-scaled: plain). Before the PDL wait: w's first step only, of those
        # first to leave (x after it); block-scaled, nothing.
        assert (evict_first in text) == first_out, (name, text.count(evict_first))
        assert "ld.global.v4" in text.replace("L1::evict_first.L2::cache_hint.", ""), name
        wait = text.find("griddepcontrol.wait")
        before = text[:wait]
        assert -1 < wait, name
        if first_out:
            assert before.count("ld.global") == before.count(evict_first) > 0, name
        else:
            assert "ld.global" not in before, name
    assert "gpu.acq_rel.add" in split and "ld.global.cg" in split

    # The split-K kernel's swapped dot (swap_ab): w's 64 rows as a warpgroup MMA's M, x's 16
    # rows as its N, FP8 from shared memory; unswapped, 16 rows of x only reach mma.sync.
    def splitk_ptx(swap, promote_k=None, tiled=False):
        return ptx(gemm_splitk.gemm_splitk_kernel, "fp8e4nv",
                   dict(HAS_BIAS=False, SCALE_A=1, SCALE_B=1, USE_WORKSPACE=True,
                        INPUT_PRECISION="tf32", MAX_IMPRECISE_ACC=promote_k, BLOCK_M=16, BLOCK_N=64,
                        BLOCK_K=128, SPLIT_CHUNK=16, PDL=1, W_ELEM_BYTES=1, SWAP_AB=swap,
                        W_TILED=tiled),
                   num_warps=4, num_stages=4)

    fast = splitk_ptx(True)
    assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in fast
    assert "wgmma" not in splitk_ptx(False)
    # Promoted every 64 of a 128 step: the swapped dot's sums go into fp32 twice per step, so
    # more fp32 adds than the fast dot, still on wgmma.
    promoted = splitk_ptx(True, 64)
    assert "wgmma.mma_async.sync.aligned.m64n16k32" in promoted
    assert promoted.count("add.f32") > fast.count("add.f32"), (promoted.count("add.f32"),
                                                               fast.count("add.f32"))
    # A pre-shuffled w (W_TILED) is copied to shared memory in 16-byte pieces as rows are: the
    # tile addressing keeps the copies vectorised, and the dot is the same warpgroup MMA.
    tiled = splitk_ptx(True, tiled=True)
    assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in tiled
    copies = [t.count("cp.async.cg.shared.global") for t in (fast, tiled)]
    assert copies[0] > 0 and copies[0] == copies[1], copies
    print("ok")
""")



@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel's own tests compile "
                                                        "it for real")
def test_gemv_and_swapped_splitk_kernels_compile_for_sm90():
    compiles_for_hopper(GEMV_SCRIPT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the probe itself runs and checks "
                                                        "its results")
def test_gluon_probe_loads_w_fragments_straight_into_wgmma_registers():
    """benchmarks/gluon_frag_probe.py's premise, at compile time: w stored in fragment order
    reaches the warpgroup MMA's A operand in 16-byte loads, row-major w in 4-byte ones, neither
    through shared memory (the layout conversion is free: as many shared-memory accesses as x
    and the epilogue need in both)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SRC)
    probe = Path(__file__).parent.parent / "benchmarks" / "gluon_frag_probe.py"
    done = subprocess.run([sys.executable, str(probe), "--ptx"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in done.stdout.splitlines():
        bk, counts = line.split(": ", 1)
        found = ast.literal_eval(counts)
        frag, rowreg = found["frag"], found["rowreg"]
        assert frag["wgmma"] == rowreg["wgmma"] > 0, line
        assert frag["ld.global.b32"] == 0 and frag["ld.global.v4"] > rowreg["ld.global.v4"], line
        assert rowreg["ld.global.b32"] > 0, line
        assert (frag["ld.shared"], frag["st.shared"]) == (rowreg["ld.shared"],
                                                          rowreg["st.shared"]), line


PREFETCH_SCRIPT = textwrap.dedent("""
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sys.path.insert(0, sys.argv[1])
    import l2_prefetch_probe as probe

    kernel = triton.compile(
        ASTSource(fn=probe._prefetch_l2,
                  signature={"ptr": "*u8", "n_chunks": "i32", "CHUNK_BYTES": "constexpr",
                             "BLOCK": "constexpr"},
                  constexprs={"CHUNK_BYTES": probe.CHUNK, "BLOCK": probe.THREADS}),
        target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    ptx = kernel.asm["ptx"]
    # One bulk prefetch a thread (a warp, one chunk each), kept though nothing reads its result
    assert ptx.count("cp.async.bulk.prefetch.L2.global [") == 1, ptx
    assert f"], {probe.CHUNK};" in ptx, ptx
    assert kernel.asm.get("cubin"), "ptxas refused it"
    print("ok")
""")


def test_the_l2_prefetch_probes_kernel_keeps_its_bulk_prefetch():
    """benchmarks/l2_prefetch_probe.py's kernel, whose asm result nothing reads: compiled for
    sm_90, its prefetch stays and ptxas takes it (a GPU run of the probe is rare)."""
    compiles_for_hopper(PREFETCH_SCRIPT, str(Path(__file__).parent.parent / "benchmarks"))


# What the Gluon scripts share: ptxas's report of a kernel's PTX (its registers and spills are
# ptxas's decisions; the PTX cannot show them).
PTXAS_REPORT = textwrap.dedent("""
    import os
    import re
    import subprocess
    import tempfile
    from triton.backends.nvidia.compiler import get_ptxas

    def ptxas_report(ptx):
        # ptxas -v's report of ptx for sm_90a (with the ptxas Triton assembles sm_90 with: its
        # PTX version), and the bytes of spill stores it reports
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(90).path, "-v", "-arch=sm_90a", f.name, "-o",
                               os.devnull], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stderr, int(re.search(r"(\\d+) bytes spill stores", done.stderr).group(1))
""")


# The TMA-fed Gluon GEMMs (ring, wsring) compiled for sm_90: w and x as FP8 TMA descriptors in
# (block_n, block_k) and (block_m, block_k) boxes, the end's pointers, the rest i32 or constexpr.
TMA_GEMM_COMPILE = textwrap.dedent("""
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    def compile_tma_gemm(kernel, block_n, block_m, block_k, constexprs, options, x_rows=None):
        boxes = {"w_desc": [block_n, block_k], "x_desc": [x_rows or block_m, block_k]}
        descs = {n: f"tensordesc<fp8e4nv{box},"
                    f"{gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv)!r}>"
                 for n, box in boxes.items()}
        pointers = {"y_ptr": "*bf16", "bias_ptr": "*bf16", "scale_a_ptr": "*fp32",
                    "scale_b_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32"}
        signature = {n: descs.get(n) or pointers.get(n) or
                     ("constexpr" if n in constexprs else "i32")
                     for n in inspect.signature(kernel.fn).parameters}
        return triton.compile(gluon._runtime.GluonASTSource(
            fn=kernel, signature=signature, constexprs=constexprs),
            target=GPUTarget("cuda", 90, 128), options=options)
""")


FRAG_SCRIPT = PTXAS_REPORT + textwrap.dedent("""
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from gemmtune.kernels.triton import gemm_frag

    def compiled(block_m, block_k, split_k, ahead, pdl, w_tiled, epilogue):
        names = inspect.signature(gemm_frag.gemm_frag_kernel.fn).parameters
        pointers = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "y_ptr": "*bf16",
                    "bias_ptr": "*bf16", "scale_a_ptr": "*fp32", "scale_b_ptr": "*fp32",
                    "part_ptr": "*fp32", "count_ptr": "*i32"}
        scale_a, scale_b, has_bias = epilogue
        constexprs = dict(HAS_BIAS=has_bias, SCALE_A=scale_a, SCALE_B=scale_b, SPLIT_K=split_k,
                          BLOCK_M=block_m, BLOCK_K=block_k, AHEAD=ahead, PDL=pdl,
                          PER_LOAD=gemm_frag.partials_per_load(abs(split_k), 64, block_m, 4),
                          W_TILED=w_tiled, ADD_SPLITS=split_k < 0)
        constexprs["SPLIT_K"] = abs(split_k)
        signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i32")
                     for n in names}
        # As Triton specialises them at a launch: pointers, K and the row pitches multiples of 16.
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                   if n.endswith("_ptr") or n in ("K", "stride_xm", "stride_wn")}
        return triton.compile(gluon._runtime.GluonASTSource(
            fn=gemm_frag.gemm_frag_kernel, signature=signature, attrs=aligned,
            constexprs=constexprs), target=GPUTarget("cuda", 90, 128))


    # (scale_a, scale_b, bias): per row, per tensor or none, FP8 block scales (3: PER_BLOCK),
    # and with and without bias
    for block_m, block_k, split_k, ahead, pdl, w_tiled, epilogue in (
            (8, 128, 1, 1, False, True, (2, 2, False)), (16, 256, 4, 1, True, True, (1, 0, True)),
            (64, 256, 8, 1, True, True, (2, 2, True)), (32, 128, 20, 3, True, True, (0, 1, False)),
            (16, 256, 4, 1, True, False, (2, 1, False)),
            (64, 128, 2, 3, False, False, (0, 0, True)),
            (16, 128, 4, 3, True, False, (3, 3, False)),
            (64, 128, 32, 2, False, False, (3, 3, True)),
            (64, 128, 8, 1, True, False, (3, 3, False)),
            (64, 128, 6, 1, False, False, (2, 2, False)),
            (32, 256, -8, 1, True, False, (2, 2, True)),
            (16, 128, -22, 3, True, True, (3, 3, False))):
        # A negative split: the splits add their partials (ADD_SPLITS)
        kernel = compiled(block_m, block_k, split_k, ahead, pdl, w_tiled, epilogue)
        text = kernel.asm["ptx"]
        # w: a 4-byte load per fragment register (4 per 32-deep MMA step of a thread), for
        # ahead + 1 steps (those before the loop and the one in it); x alone goes through
        # shared memory.
        fragments = 4 * block_k // 32 * (ahead + 1)
        assert text.count("ld.global.b32") >= fragments, (block_m, text.count("ld.global.b32"))
        assert kernel.metadata.shared <= max(block_m * block_k, 64 * block_m * 4), \
            kernel.metadata.shared
        assert f"wgmma.mma_async.sync.aligned.m64n{block_m}k32.f32.e4m3.e4m3" in text
        # PDL: w's first steps load before the wait, x (16-byte loads) after it.
        wait = text.find("griddepcontrol.wait")
        assert (text.find("ld.global.b32") < wait < text.find("ld.global.v4")) if pdl \
            else wait == -1
        assert ("atom.global" in text) == (split_k != 1)
        # Added splits: each partial's elements added at L2 (relaxed fp32 atomics).
        assert ("global.gpu.relaxed.add.f32" in text) == (split_k < 0)
        report, spilled = ptxas_report(text)
        # At BLOCK_M 64 the kernel uses all 255 registers and some configs spill a few dozen
        # bytes (up to 76 measured, Triton 3.6 and 3.9); below it none spills.
        assert spilled <= (128 if block_m == 64 else 0), \
            (block_m, block_k, ahead, epilogue, report)
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel's own tests run it")
def test_fragment_order_kernel_loads_w_straight_into_wgmma_registers():
    """triton.frag (Gluon) for sm_90, on row-major and pre-shuffled w: w straight into the MMA's
    registers, no shared memory for it, the FP8 warpgroup MMA with x's block as its N, PDL's
    wait after w's first loads."""
    compiles_for_hopper(FRAG_SCRIPT)


RING_SCRIPT = PTXAS_REPORT + TMA_GEMM_COMPILE + textwrap.dedent("""
    import torch
    from gemmtune.kernels.triton import _swapped, gemm_ring


    # (block_m, block_k, stages, split_k, (scale_a, scale_b, bias)); the largest rings the
    # space admits and the largest split sums among them, and FP8 block scales (3: PER_BLOCK);
    # every other one launched with PDL
    for i, (block_m, block_k, stages, split_k, epilogue) in enumerate((
            (8, 128, 8, 1, (2, 2, False)), (16, 256, 4, 4, (1, 0, True)),
            (64, 256, 4, 2, (2, 2, True)), (32, 128, 8, 20, (0, 1, False)),
            (8, 128, 22, 32, (2, 2, True)), (64, 256, 6, 32, (2, 2, True)),
            (16, 128, 8, 1, (3, 3, False)), (64, 128, 12, 32, (3, 3, True)),
            (16, 256, 4, -4, (2, 2, True)), (64, 128, 8, -32, (3, 3, True)),
            (128, 128, 4, 1, (2, 2, True)), (128, 128, 4, -8, (3, 3, False)),
            (128, 128, 2, 4, (2, 2, False)), (128, 128, 3, 32, (3, 3, True)),
            # stream-K (stages = -programs an SM): ``streamed``'s deepest rings
            (16, 256, -2, 0, (2, 2, True)), (32, 256, -4, 0, (2, 2, False)),
            (64, 128, -1, 0, (3, 3, False)), (64, 128, -2, 0, (2, 2, True)),
            (128, 128, -1, 0, (3, 3, True)), (128, 128, -1, 0, (2, 2, True)))):
        # A negative split: the splits add their partials (ADD_SPLITS); split 0: stream-K, its
        # programs an SM given by -stages, the ring the deepest that many hold (the
        # candidates'). 128 rows of x: 128 rows of w too, on two warpgroups (the wide tile).
        add_splits, streamed, split_k = split_k < 0, split_k == 0, max(abs(split_k), 1)
        block_n = 128 if block_m == 128 else 64
        pdl = i % 2 == 1
        config = gemm_ring.RingConfig(block_m, block_k, max(stages, 2), split_k,
                                      int(add_splits), block_n, -stages if streamed else 0,
                                      int(pdl))
        if streamed:
            config = next(c for c in gemm_ring.streamed(block_m, block_k, block_n, block_m,
                                                        7168, 7168, torch.float8_e4m3fn)
                          if c.stream_k == -stages)
        stages = config.stages
        scale_a, scale_b, has_bias = epilogue
        constexprs = dict(HAS_BIAS=has_bias, SCALE_A=scale_a, SCALE_B=scale_b, SPLIT_K=split_k,
                          BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, STAGES=stages,
                          PER_LOAD=_swapped.partials_per_load(split_k, block_n, block_m,
                                                              block_n // 16),
                          ADD_SPLITS=add_splits, STREAM_K=streamed, PDL=pdl)
        regs = gemm_ring.max_registers(config)
        kernel = compile_tma_gemm(gemm_ring.gemm_ring_kernel, block_n, block_m, block_k,
                                  constexprs, {"num_warps": block_n // 16,
                                               **({} if regs is None else {"maxnreg": regs})})
        text = kernel.asm["ptx"]
        # Both operands through TMA: two bulk tensor copies per slot before the loop and two in
        # it, and the loop's wait on the slot's mbarrier.
        assert text.count("cp.async.bulk.tensor") >= 2 * stages + 2, text.count("cp.async.bulk")
        assert text.count("mbarrier.try_wait") >= 1
        # PDL: w's slots load before the wait for the previous kernel and x's after it, the
        # next kernel released after the loop's last MMA; stream-K waits before any load,
        # having released the next one.
        wait = text.find("griddepcontrol.wait")
        release = text.find("griddepcontrol.launch_dependents")
        if pdl:
            before = text[:wait].count("cp.async.bulk.tensor")
            assert before == (0 if streamed else stages), (stages, before)
            assert (release < wait) if streamed else (text.rfind("wgmma.mma_async") < release)
        else:
            assert wait == release == -1
        assert f"wgmma.mma_async.sync.aligned.m64n{block_m}k32.f32.e4m3.e4m3" in text
        ring = stages * (block_n + block_m) * block_k
        assert ring <= kernel.metadata.shared <= ring + block_n * block_m * 4 + 1024, \
            (ring, kernel.metadata.shared)
        assert kernel.metadata.num_warps == block_n // 16
        assert ("atom.global" in text) == (split_k > 1 or streamed)
        # Added splits and stream-K's parts: each partial's elements added at L2 (relaxed fp32
        # atomics: atom in Triton 3.6, red in 3.9), one read back.
        assert ("global.gpu.relaxed.add.f32" in text) == (add_splits or streamed), add_splits
        assert kernel.metadata.shared <= 227 * 1024  # what a block may have on an H100
        report, spilled = ptxas_report(text)
        # The wide tile (128 x 128 on two warpgroups) spills: 24-32 B, 152-260 B where a few
        # splits' partials are summed in order (Triton 3.6 and 3.9; its whole sum unrolled), and
        # 624-1012 B with stream-K; the others none, but stream-K's 4 an SM at 128 registers
        # (32 B in 3.6). Whether it pays is the GPU's to say.
        limit = (1024 if streamed else 288) if block_m == 128 else (32 if streamed else 0)
        assert spilled <= limit, (block_m, stages, split_k, streamed, report)
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel's own tests run it")
def test_ring_kernel_feeds_both_operands_through_tma():
    """triton.ring (Gluon) for sm_90: w and x through TMA into the ring, the FP8 warpgroup MMA
    with x's block as its N, the ring's shared memory as configured, the split's counter only
    where K is split."""
    compiles_for_hopper(RING_SCRIPT)


WSRING_SCRIPT = PTXAS_REPORT + TMA_GEMM_COMPILE + textwrap.dedent("""
    import torch
    from gemmtune.kernels.triton import _swapped, gemm_wsring

    spills = {}
    # (block_m, block_n, stages, split_k, (scale_a, scale_b, bias), per_sm, order): every
    # tile, the deepest rings they take, block scales (3) and per-row ones, two programs an SM,
    # programs looping over units, x's blocks first; a negative split adds its partials; order
    # + 4: fast accumulation (per-row and per-tensor scales only); + 8: stream-K (persistent).
    for case in (
            (128, 128, 6, 4, (3, 3, False), 1, 0), (128, 128, 4, -8, (3, 3, True), 1, 0),
            (128, 64, 6, 1, (2, 2, True), 1, 0), (64, 128, 6, 2, (1, 1, False), 1, 0),
            (64, 64, 6, -32, (3, 3, False), 1, 0), (64, 64, 6, 3, (3, 3, True), 2, 0),
            (128, 128, 4, 5, (3, 3, False), 1, 0), (64, 128, 4, 5, (2, 2, False), 1, 0),
            (128, 128, 4, 1, (3, 3, True), 1, 1), (64, 64, 4, -4, (3, 3, False), 2, 1),
            (64, 128, 4, 2, (3, 3, False), 1, 2), (64, 64, 4, 1, (2, 2, True), 1, 3),
            (128, 128, 4, 4, (2, 2, False), 1, 4), (64, 64, 4, -3, (2, 1, True), 2, 5),
            (64, 128, 3, 2, (1, 1, False), 1, 6), (128, 64, 4, 1, (0, 0, True), 1, 4),
            (128, 128, 4, 1, (3, 3, False), 1, 9), (64, 64, 4, 1, (2, 2, True), 2, 15),
            (64, 128, 4, 1, (3, 3, True), 1, 11), (64, 64, 8, 1, (2, 2, False), 1, 4),
            (128, 64, 8, 1, (3, 3, False), 1, 0), (64, 128, 8, 3, (3, 3, True), 1, 1),
            (64, 16, 8, 1, (3, 3, False), 1, 0), (64, 32, 8, 1, (2, 2, True), 1, 4),
            (64, 32, 6, -2, (3, 3, False), 1, 0), (64, 16, 8, 3, (2, 2, False), 1, 0),
            (64, 32, 16, 1, (3, 3, False), 1, 0), (64, 64, 12, 1, (3, 3, False), 1, 0),
            (64, 64, 6, 1, (3, 3, False), 2, 1), (64, 32, 8, 1, (3, 3, False), 1, 0, 16),
            (64, 64, 8, -2, (2, 2, True), 1, 5, 32), (64, 64, 6, 1, (3, 3, False), 2, 1, 16),
            (128, 64, 6, 1, (3, 3, False), 1, 9, 32), (64, 64, 4, 2, (3, 3, False), 2, 16),
            (64, 64, 6, 1, (2, 2, True), 2, 32, 16)):
        # order: 0 a program a unit, w's blocks first; 1 a loop over units; 2 x's blocks
        # first; 3 both; + 16, + 32: w's first slots before the PDL wait, the next kernel
        # released at the start or after the loop (w_ahead 1, 2). An eighth number: x's rows
        # a load brings (M under block_m), the rest of the slot zeroed by the math warps.
        block_m, block_n, stages, split_k, epilogue, per_sm, order, *x_rows = case
        x_rows = x_rows[0] if x_rows else block_m
        w_ahead = 1 if order & 16 else (2 if order & 32 else 0)
        fast, streamed, order = bool(order & 4), bool(order & 8), order % 4
        m_first, persistent = order >= 2, order in (1, 3)
        add_splits, split_k = split_k < 0, abs(split_k)
        config = gemm_wsring.WsRingConfig(block_m, block_n, stages, split_k, int(add_splits),
                                          per_sm, int(per_sm == 2), int(persistent), int(m_first),
                                          int(fast), int(streamed), w_ahead)
        scale_a, scale_b, has_bias = epilogue
        constexprs = dict(HAS_BIAS=has_bias, SCALE_A=scale_a, SCALE_B=scale_b, SPLIT_K=split_k,
                          BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
                          PER_LOAD=_swapped.partials_per_load(split_k, block_n, block_m,
                                                              block_m // 16),
                          ADD_SPLITS=add_splits, PDL=per_sm == 2,
                          PERSISTENT=persistent, M_FIRST=m_first, FAST=fast,
                          STREAM_K=streamed, W_AHEAD=w_ahead)
        assert gemm_wsring.why_not_fits(config, x_rows, 4096, 4096, torch.float8_e4m3fn) is None, \
            gemm_wsring.why_not_fits(config, x_rows, 4096, 4096, torch.float8_e4m3fn)
        kernel = compile_tma_gemm(gemm_wsring.gemm_wsring_kernel, block_n, block_m, 128,
                                  constexprs, {"num_warps": block_m // 16,
                                               "maxnreg": gemm_wsring.max_registers(config)},
                                  x_rows)
        text = kernel.asm["ptx"]
        # Fewer rows of x a load: the slots' other rows stored as zeros once, fenced from the
        # MMA's reads; else neither.
        assert ("fence.proxy.async.shared::cta" in text) == (x_rows < block_m), x_rows
        if x_rows < block_m:  # stored, fenced, every math warp past them, then the first MMA
            fence = text.index("fence.proxy.async.shared::cta")
            mma = text.index("wgmma.mma_async")
            assert fence < text.index(f"bar.sync \t0, {block_m * 2};", fence) < mma
        # x's rows are the MMA's M, w's its N; the producer warp's two bulk tensor copies a
        # slot; registers handed from the producer to the math warps; a slot freed by one
        # arrive of the math warps after their barrier (bar.sync over their threads alone).
        assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k32.f32.e4m3.e4m3" in text
        copies = 4 if w_ahead else 2  # and w's then x's first slots around the PDL wait
        assert text.count("cp.async.bulk.tensor") == copies, text.count("cp.async.bulk.tensor")
        assert "setmaxnreg.dec" in text and "setmaxnreg.inc" in text
        assert "mbarrier.arrive" in text
        assert f"bar.sync \t0, {block_m * 2};" in text
        # The ring and its mbarriers: the end's conversion of the tile reuses the ring.
        ring = gemm_wsring.ring_bytes(config)
        assert ring < kernel.metadata.shared <= gemm_wsring.smem_bytes(config), \
            kernel.metadata.shared
        # per_sm programs fit an SM together (each block reserves 1 KiB of its 228).
        assert (kernel.metadata.shared + 1024) * per_sm <= 228 * 1024, kernel.metadata.shared
        # The math warps, and a warpgroup beside them for the producer warp.
        assert kernel.metadata.num_warps == block_m // 16 + 4, kernel.metadata.num_warps
        assert kernel.metadata.num_warps * 32 == config.threads
        assert f".maxnreg {gemm_wsring.max_registers(config)}" in text
        # Split, or stream-K's parts of tiles: counters, and (added) the parts' fp32 sums.
        assert ("atom.global" in text) == (split_k > 1 or streamed)
        assert ("global.gpu.relaxed.add.f32" in text) == (add_splits or streamed), add_splits
        # PDL with w ahead: the math warps wait before any load (x's scales, the end's); the
        # producer loads w's first slots (its loop's first copy, as in the main loop) before
        # its wait and x's after it; the next kernel released before any copy (1) or after the
        # last MMA (2). Otherwise released, then the wait, before any memory is touched.
        pdl = "griddepcontrol.wait" in text
        assert pdl == constexprs["PDL"]
        wait = text.find("griddepcontrol.wait")
        release = text.find("griddepcontrol.launch_dependents")
        if w_ahead:
            copies = [m.start() for m in re.finditer("cp.async.bulk.tensor", text)]
            assert wait < text.index("ld.global")
            producer_wait = text.index("griddepcontrol.wait", copies[0])
            descriptor = [re.search(r"\\[(%rd\\d+),", text[c:]).group(1) for c in copies]
            assert sum(c < producer_wait for c in copies) == 1
            assert descriptor[0] == descriptor[2] != descriptor[1] == descriptor[3], descriptor
            if w_ahead == 1:
                assert release < copies[0]
            else:
                assert text.rfind("wgmma.mma_async") < release
        elif pdl:
            assert release < wait < text.index("cp.async.bulk.tensor")
        report, spills[block_m, block_n, split_k, add_splits, persistent, m_first, fast,
                       streamed, x_rows] = ptxas_report(text)
        # Each MMA overlaps the previous step's scaling: ptxas serialises none (C7514: another
        # instruction reads an MMA's registers before its wait).
        assert "C7514" not in report and "C7517" not in report, report
        # Fast accumulation: each MMA into the running sum, waited for with the next in flight.
        assert ("wgmma.wait_group.sync.aligned 1;" in text) == fast, fast
    # Only the end spills, past the main loop: a split's sum in order, its loop over the
    # splits unrolled with every load hoisted (128 x 128: 292-340 B at 4 splits, 556-588 with
    # fast accumulation, 516-616 at 5;
    # 64 x 128 at 5: 700; added: 80), and a persistent 128 x 128 program's end (300: values
    # for it kept across the units' loop; Triton 3.6 and 3.9), and stream-K's programs (their
    # loop over parts and its ends: 128 x 128 72-592 B, 64 x 128 212-216, 64 x 64 two an SM
    # 84-88). A cost once a unit, timed by the tuner beside the configs that have none.
    assert all(b == 0 for k, b in spills.items()
               if ((k[2] == 1 and not k[4]) or k[:2] == (64, 64)) and not k[7]), spills
    assert all(b <= {(64, 64): 96, (64, 128): 256}.get(k[:2], 640)
               for k, b in spills.items() if k[7]), spills
    assert all(b <= 768 for b in spills.values()), spills
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel's own tests run it")
def test_warp_specialised_ring_compiles_for_hopper():
    """triton.wsring (Gluon) for sm_90: a producer warp feeding the ring through TMA, the math
    warps' FP8 warpgroup MMA with x's rows as its M, slots freed by one arrive after the math
    warps' own barrier, the split's counter only where K is split."""
    compiles_for_hopper(WSRING_SCRIPT)


W4_SCRIPT = textwrap.dedent("""
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from gemmtune.kernels.triton import gemm_w4

    names = list(inspect.signature(gemm_w4.gemm_w4_kernel.fn).parameters)
    # (x's dtype, blocks, tl.dot_scaled, the MMA expected); "u8": x in MXFP4 too (its fp16
    # codes multiplied, or both decoded by tl.dot_scaled)
    for dtype, (bm, bn, bk), ds, mma in (("bf16", (16, 64, 128), 0, "mma.sync"),
                                         ("fp16", (64, 128, 64), 0, "wgmma.mma_async"),
                                         ("u8", (16, 64, 128), 0, "mma.sync"),
                                         ("u8", (64, 128, 64), 0, "wgmma.mma_async"),
                                         ("bf16", (16, 64, 128), 1, "wgmma.mma_async"),
                                         ("u8", (16, 64, 256), 1, "mma.sync")):
        split_k = 4 if bm == 16 else 1
        constexprs = dict(HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split_k,
                          SPLIT_CHUNK=2, X_MXFP4=dtype == "u8", DOT_SCALED=bool(ds))
        out = "bf16" if dtype == "u8" else dtype
        pointers = {"x_ptr": f"*{dtype}", "wq_ptr": "*u8", "ws_ptr": "*u8", "xs_ptr": "*u8",
                    "bias_ptr": f"*{out}", "y_ptr": f"*{out}", "part_ptr": "*fp32",
                    "count_ptr": "*i32"}
        signature = {n: pointers.get(n) or ("constexpr" if n in constexprs else "i32")
                     for n in names}
        kernel = triton.compile(ASTSource(fn=gemm_w4.gemm_w4_kernel, signature=signature,
                                          constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 128),
                                options={"num_warps": 4, "num_stages": 3})
        # The dequantised tile goes to the tensor cores: mma.sync for 16 rows of x, the
        # warpgroup MMA from 64 (and for bf16 x through tl.dot_scaled, which makes the decoded
        # w the warpgroup MMA's left operand even at 16 rows); a split's counter only where K
        # is split.
        assert mma in kernel.asm["ptx"], (dtype, bm)
        assert ("atom.global" in kernel.asm["ptx"]) == (split_k > 1)
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel's own tests run it")
def test_mxfp4_weight_kernel_compiles_for_hopper():
    """gemm_w4 (MXFP4 weights dequantised in registers) builds for sm_90 in bf16 and fp16, and
    through tl.dot_scaled, its dot on the tensor cores."""
    compiles_for_hopper(W4_SCRIPT)




# The word-reading Gluon MXFP4 kernels (w4frag, w4xa) compiled for sm_90: x bf16 or MXFP4 codes,
# the codes and scales uint8, 16-byte aligned pointers, K and row strides; the rest i32 or
# constexpr.
MXFP4_WORD_COMPILE = textwrap.dedent("""
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon

    def compile_mxfp4_words(kernel, x_mxfp4, constexprs, warps):
        names = inspect.signature(kernel.fn).parameters
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                   if n.endswith("_ptr") or n in ("K", "stride_xm", "stride_wn")}
        pointers = {"x_ptr": "*u8" if x_mxfp4 else "*bf16", "wq_ptr": "*u8", "ws_ptr": "*u8",
                    "xs_ptr": "*u8", "y_ptr": "*bf16", "bias_ptr": "*bf16",
                    "part_ptr": "*fp32", "count_ptr": "*i32"}
        signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i32")
                     for n in names}
        return triton.compile(gluon._runtime.GluonASTSource(
            fn=kernel, signature=signature, attrs=aligned, constexprs=constexprs),
            target=GPUTarget("cuda", 90, 128), options={"num_warps": warps}).asm["ptx"]
""")


W4FRAG_SCRIPT = PTXAS_REPORT + MXFP4_WORD_COMPILE + textwrap.dedent("""
    from gemmtune.kernels.triton import _swapped, gemm_w4frag

    # (block_m, block_k, split_k (negative: added), pdl, bias, packed w, MXFP4 x, warps[, x
    # read from shared memory a block at a time])
    for block_m, block_k, split_k, pdl, bias, packed, x_mxfp4, warps, *by_block in (
            (8, 128, 1, False, False, False, False, 4), (16, 256, 4, True, True, False, False, 4),
            (32, 64, -8, True, False, False, False, 4), (8, 32, 2, False, True, False, False, 4),
            (8, 128, 4, True, False, True, False, 4), (32, 256, -2, False, True, True, False, 4),
            (8, 128, 4, True, False, True, True, 4), (16, 64, -3, False, False, False, True, 4),
            (32, 256, 2, True, False, False, True, 4), (8, 128, -4, True, False, True, True, 4),
            (8, 128, -5, True, False, True, False, 2), (16, 128, -9, True, False, True, False, 2),
            (8, 64, 2, False, True, False, True, 2), (16, 256, 3, True, True, True, True, 2),
            (16, 128, -9, True, False, True, False, 2, True),
            (8, 256, 2, False, True, True, False, 2, True)):
        by_block = bool(by_block and by_block[0])
        constexprs = dict(HAS_BIAS=bias, SPLIT_K=abs(split_k), BLOCK_M=block_m,
                          BLOCK_K=block_k, PDL=pdl,
                          PER_LOAD=_swapped.partials_per_load(abs(split_k), 64, block_m,
                                                              warps),
                          ADD_SPLITS=split_k < 0, PACKED=packed, X_MXFP4=x_mxfp4,
                          X_BY_BLOCK=by_block)
        text = compile_mxfp4_words(gemm_w4frag.gemm_w4frag_kernel, x_mxfp4, constexprs, warps)
        loop = text[text.find("mma.sync"):text.rfind("mma.sync")]
        # Per scale block, each thread loads one 32-bit word of codes for each of its 2 rows
        # of each 16 its warp takes (4 // warps MMAs down w's 64 rows; packed: one 16-byte
        # load a row for 4 blocks, first to evict) and multiplies on mma.sync (bf16, fp32
        # sums). x comes straight from global memory (no shared memory in the loop), but with
        # packed w in K order through shared memory (16-byte stores of bf16, MXFP4 x's codes
        # decoded first, before the loop and in it; a barrier a group; ldmatrix).
        tiles = 4 // warps
        blocks = min(block_k, 128) // 32  # a step's blocks, or from 128 a group of 4 blocks
        if packed:  # w's codes first to leave L1 and L2 (x is read again, w once)
            assert text.count("ld.global.L1::evict_first.L2::cache_hint.v4.b32") >= \
                2 * tiles * blocks // 4
        else:
            assert text.count("ld.global.b32") >= 2 * tiles * blocks, \\
                text.count("ld.global.b32")
        assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") >= \\
            2 * tiles * blocks * block_m // 8
        if packed:
            assert text.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == \\
                blocks * block_m // 8, text.count("ldmatrix")
            assert text.count("st.shared.v4.b32") == block_m // warps, \\
                text.count("st.shared.v4")
            # Two barriers a group: before the reads, and (Triton's: the slot is chosen at run
            # time) between the reads and the store of the group ahead
            first = text.find("ldmatrix")
            assert text[:first].rsplit("st.shared", 1)[1].count("bar.sync") == 1
            assert text[first:text.rfind("st.shared.v4")].count("bar.sync") == 1
            # x's blocks read at once, before the group's first MMA, or each before its own
            reads = text[first:text.rfind("ldmatrix")]
            assert ("mma.sync" in reads) == by_block, by_block
        else:
            assert "st.shared" not in loop and "bar.sync" not in loop
        assert ("griddepcontrol.wait" in text) == pdl
        if pdl:
            # Before the wait only w's first group (block_k 128-256): its rows' scale words (2
            # a thread an MMA down w) and codes (packed: a 16-byte load a row; else a word a
            # row and block); at 32-64 nothing.
            before = text[:text.find("griddepcontrol.wait")]
            codes = (2 if packed else 8) * tiles
            assert before.count("ld.global") == (2 * tiles + codes if block_k >= 128 else 0), \
                (block_k, packed, warps, before.count("ld.global"))
        assert ("atom.global" in text) == (split_k != 1)
        # The E2M1 decode (an inline-PTX block of PRMT lookups) for w's words as quantised
        # and, MXFP4 x, x's too: x's scales then multiply w's (fp32) in each block's product;
        # packed w's words by masks and shifts (their bits placed), 4 bf16 multiplies each.
        # A decode a word: w's 2 rows a thread, x's 1-4 (BLOCK_M / 8) words; a loop iteration
        # takes 2 groups of 4 blocks (packed: 1; block_k < 128: a step's blocks). Packed, x's
        # group is decoded once a program, a word a thread from 8 rows, before the loop and in
        # it, and times its row's scale there (4 bf16 multiplies a word).
        looped = (4 if packed else 8) if block_k >= 128 else block_k // 32
        w_words, x_words = 2 * tiles * looped, (block_m // 8 if x_mxfp4 else 0) * looped
        if packed:
            x_words = block_m // warps if x_mxfp4 else 0
        assert text.count("prmt.b32 la") == x_words + (0 if packed else w_words), \\
            (block_m, block_k, x_mxfp4, warps, text.count("prmt.b32 la"))
        assert text.count("mul.rn.bf16x2") == (4 * (w_words + x_words) if packed else 0), \\
            (block_m, block_k, packed, text.count("mul.rn.bf16x2"))
        report, spilled = ptxas_report(text)
        assert spilled == 0, (block_m, block_k, x_mxfp4, warps, report)
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel's own tests run it")
def test_register_direct_mxfp4_kernel_compiles_for_hopper():
    """triton.w4frag (Gluon) for sm_90, bf16 and MXFP4 x: the codes straight from global memory
    into mma.sync's registers (a 32-bit load a row and block), decoded by the inline PTX, no
    shared memory or barrier in the loop (packed w: x through shared memory, by ldmatrix), on 4
    warps or 2; no spills, PDL and the splits' atomics only where configured."""
    compiles_for_hopper(W4FRAG_SCRIPT)


W4DEQ_SCRIPT = textwrap.dedent("""
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from gemmtune.kernels.triton import gemm_w4deq

    for fn, out, (bn, bk), packed in (
            (gemm_w4deq.dequant_mxfp4_kernel, "bf16", (8, 512), False),
            (gemm_w4deq.dequant_mxfp4_kernel, "fp16", (32, 128), True),
            (gemm_w4deq.dequant_mxfp4_bf16_kernel, "bf16", (8, 512), False),
            (gemm_w4deq.dequant_mxfp4_bf16_kernel, "bf16", (32, 128), True)):
        names = list(inspect.signature(fn.fn).parameters)
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                   if n.endswith("_ptr") or n in ("K", "stride_wn", "stride_on")}
        constexprs = dict(BLOCK_N=bn, BLOCK_K=bk, PACKED=packed)
        pointers = {"wq_ptr": "*u8", "ws_ptr": "*u8", "out_ptr": f"*{out}"}
        signature = {n: pointers.get(n) or ("constexpr" if n in constexprs else "i32")
                     for n in names}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                          attrs=aligned),
                                target=GPUTarget("cuda", 90, 128), options={"num_warps": 4})
        ptx = kernel.asm["ptx"]
        # The dequantised weight leaves in 16-byte stores.
        assert "st.global.v4" in ptx, (out, packed)
        if fn is gemm_w4deq.dequant_mxfp4_bf16_kernel:
            # The PTX decode: a thread's code words in vector loads, 15 instructions for 8
            # codes (packed: masks and shifts, 11, and 4 multiplies by 2^126) and 4 multiplies
            # by the scale: under 9 instructions an element in all (the Triton decode takes
            # about 27, which bounds it by issue, not bandwidth)
            assert "ld.global.v2.b32" in ptx or "ld.global.v4.b32" in ptx, packed
            assert "mul.rn.bf16x2" in ptx and ("prmt.b32" in ptx) != packed
            body = [line for line in ptx.splitlines()
                    if line.strip().endswith(";") and not line.strip().startswith(".")]
            assert len(body) * 128 < 9 * bn * bk, len(body)
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel's own tests run it")
def test_mxfp4_dequantising_kernel_compiles_for_hopper():
    """triton.w4deq's dequantising kernels build for sm_90: in Triton to bf16 and fp16, by PTX
    to bf16 in under 9 instructions an element, both layouts."""
    compiles_for_hopper(W4DEQ_SCRIPT)


W4WG_SCRIPT = PTXAS_REPORT + textwrap.dedent("""
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from gemmtune.kernels.triton import gemm_w4wg

    names = inspect.signature(gemm_w4wg.gemm_w4wg_kernel.fn).parameters
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n.endswith("_ptr") or n in ("K", "stride_wn", "stride_ym")}
    # Every tile and warp count the space admits (stages change only the ring's size)
    tiles = [(bn, bm, w) for bn in gemm_w4wg.BLOCK_NS for bm in gemm_w4wg.BLOCK_MS
             for w in gemm_w4wg.WARPS if gemm_w4wg.why_not_fits(
                 gemm_w4wg.W4WgConfig(bn, bm, w, 3), 4096, 4096, 4096, __import__("torch").bfloat16)
             is None]
    assert len(tiles) >= 8, tiles
    for i, (block_n, block_m, warps) in enumerate(tiles):
        stages = 3 + i % 2
        box = [block_m, 64]
        descs = {"x_desc": f"tensordesc<bf16{box},"
                           f"{gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)!r}>"}
        pointers = {"wq_ptr": "*u8", "ws_ptr": "*u8", "y_ptr": "*bf16", "bias_ptr": "*bf16"}
        packed = i % 3 == 1  # w in mxfp4.prepack's layout
        # the decode after each MMA, or beside it into a second set of A registers (with one
        # MMA or two in flight)
        for overlap in (0, 1, 2):
            if gemm_w4wg.why_not_fits(gemm_w4wg.W4WgConfig(block_n, block_m, warps, stages,
                                                           int(packed), overlap),
                                      4096, 4096, 4096, __import__("torch").bfloat16):
                continue
            constexprs = dict(HAS_BIAS=i % 2 == 0, BLOCK_N=block_n, BLOCK_M=block_m,
                              STAGES=stages, WARPS=warps, PACKED=packed, OVERLAP=overlap)
            signature = {n: descs.get(n) or pointers.get(n) or
                         ("constexpr" if n in constexprs else "i32") for n in names}
            kernel = triton.compile(gluon._runtime.GluonASTSource(
                fn=gemm_w4wg.gemm_w4wg_kernel, signature=signature, attrs=aligned,
                constexprs=constexprs), target=GPUTarget("cuda", 90, 128),
                options=dict(num_warps=warps))
            text = kernel.asm["ptx"]
            # x through TMA (each slot before the loop, its refill in it), w's blocks as 16-byte
            # loads of each of a thread's rows (2 blocks a step, loaded before the loop for 2
            # steps and in each step body: one, or two where overlap unrolls the loop (an odd
            # K's last step loads nothing it uses); packed, one 8-byte load of the thread's
            # words), the MMA bf16 with fp32 sums, and no shared-memory store in the loop.
            assert text.count("cp.async.bulk.tensor") >= stages + 1
            rows = block_n // (8 * warps)
            loads = (2 + (2 if overlap else 1)) * rows
            if packed:
                assert text.count("ld.global.v2.b32") == loads, text.count("ld.global.v2")
            else:
                assert text.count("ld.global.v4.b32") == 2 * loads, text.count("ld.global.v4")
            assert f"wgmma.mma_async.sync.aligned.m64n{block_m}k16.f32.bf16.bf16" in text
            loop = text[text.find("wgmma.mma_async"):text.rfind("wgmma.mma_async")]
            assert "st.shared" not in loop
            # A word's decode once before the loop and in each body (3 gathering PRMTs, 10 in the
            # decode; packed, the thread's own word decoded from its placed bits by masks and
            # shifts and multiplied by 2^126, no PRMT) and its scale
            decodes = 1 + (2 if overlap else 1)
            assert text.count("mul.rn.bf16x2") == decodes * 4 * 2 * rows * (2 if packed else 1)
            assert text.count("0x81C081C0") == (decodes * 2 * 2 * rows if packed else 0)
            assert ("prmt.b32" in text) != packed
            report, spilled = ptxas_report(text)
            assert spilled == 0, (block_n, block_m, warps, overlap, report)
            # ptxas would serialise every MMA where A's registers are written while one runs
            assert "C7513" not in report, (block_n, block_m, warps, overlap, report)
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel's own tests run it")
def test_mxfp4_warpgroup_mma_kernel_compiles_for_hopper():
    """triton.w4wg (Gluon) for sm_90: x by TMA, w's codes as 16-byte loads (packed: 8-byte)
    decoded into the warpgroup MMA's A registers, no shared-memory store in the loop, no
    spills, and no MMA serialised by ptxas, at every tile and warp count of its space."""
    compiles_for_hopper(W4WG_SCRIPT)


W4XA_SCRIPT = PTXAS_REPORT + MXFP4_WORD_COMPILE + textwrap.dedent("""
    from gemmtune.kernels.triton import _swapped, gemm_w4xa

    # (tiles, warps, split_k (negative: added), pdl, bias, MXFP4 x)
    for tiles, warps, split_k, pdl, bias, x_mxfp4 in (
            (2, 4, 4, True, False, False), (4, 4, -4, True, False, True),
            (4, 2, 1, False, True, False), (8, 1, 2, True, False, True),
            (2, 2, -9, False, True, True), (4, 1, 3, True, False, False)):
        constexprs = dict(HAS_BIAS=bias, SPLIT_K=abs(split_k), TILES=tiles, PDL=pdl,
                          PER_LOAD=_swapped.partials_per_load(abs(split_k), 8 * tiles * warps,
                                                              16, warps),
                          ADD_SPLITS=split_k < 0, X_MXFP4=x_mxfp4)
        text = compile_mxfp4_words(gemm_w4xa.gemm_w4xa_kernel, x_mxfp4, constexprs, warps)
        case = (tiles, warps, split_k, pdl, x_mxfp4)
        # A group of 4 blocks a loop iteration: x's A operand read by ldmatrix once a block
        # (16 rows x 32: two x4), multiplied with each of the warp's tiles of w (two k16
        # MMAs a tile and block, bf16, fp32 sums)
        assert text.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 8, case
        assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == \\
            8 * tiles, case
        # w's codes a 16-byte load a tile and group, first to leave the caches
        assert text.count("ld.global.L1::evict_first") >= 2 * tiles, case
        # Each word decoded by masks and shifts and multiplied by 2^126 and its block's scale
        # (8 bf16 multiplies; the scale pair made in the same asm block, one 16-bit max each);
        # MXFP4 x's words decoded by PRMT look-ups and scaled (4) as they are stored, before
        # the loop and in it: 4 x 16 rows of 4 words a program's threads
        x_words = 2 * 4 * 16 * 4 // (32 * warps) if x_mxfp4 else 0
        assert text.count("mul.rn.bf16x2") == 8 * 4 * tiles + 4 * x_words, \\
            (case, text.count("mul.rn.bf16x2"))
        assert text.count("prmt.b32 la") == x_words, case
        assert text.count("max.u16x2") == 4 * tiles, case
        assert ("griddepcontrol.wait" in text) == pdl
        if pdl:
            # before the wait only w's first group: a tile's scale word and its codes
            before = text[:text.find("griddepcontrol.wait")]
            assert before.count("ld.global") == 2 * tiles, (case, before.count("ld.global"))
        assert ("atom.global" in text) == (split_k != 1)
        report, spilled = ptxas_report(text)
        assert spilled == 0, (case, report)
    print("ok")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel's own tests run it")
def test_x_as_a_mxfp4_kernel_compiles_for_hopper():
    """triton.w4xa (Gluon) for sm_90, bf16 and MXFP4 x: x's A operand by ldmatrix once a block
    for all of a warp's tiles of w, w's packed codes in 16-byte loads decoded and scaled in one
    PTX block each, only w's loads before the PDL wait, no spills."""
    compiles_for_hopper(W4XA_SCRIPT)

"""What the GEMM families' tuners share: the Triton candidate spaces, and running, checking and
timing a candidate exactly as dispatch calls it (``kernel(x, w, bias, out_dtype, scale_a,
scale_b, out=)``, resolved from the family's registry by ``kernelName`` and checked against the
family's plain problem for the key).

A family's tuner gives its schema, registry, ``problem_of`` and ``prepare``; ``prepare`` puts a
``GemmCall`` in ``Prepared.inputs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from gemmtune.dispatch import KernelRegistry
from gemmtune.families._scaled_op import Q_DTYPES
from gemmtune.kernels.problem import GemmProblem, Scaling
from gemmtune.measure.timing import (copies_to_exceed_l2, eager_us, graph_replay_us,
                                     interleaved_graph_us)
from gemmtune.tune.family import Candidate, FamilyTuner, Prepared

class GemmCall(NamedTuple):
    """The arguments every GEMM backend is called with, ``kernel(*call, out=)``."""

    x: torch.Tensor  # (M, K)
    w: torch.Tensor  # (N, K)
    bias: torch.Tensor | None  # (N,)
    out_dtype: torch.dtype
    scale_a: torch.Tensor | None
    scale_b: torch.Tensor | None


# Up to M = 64 the split-K kernel's space holds every tile config worth timing (split 1 is a
# plain tile GEMM with one M tile); the tile kernel starts above it.
TILE_MIN_M = 65
# From M = 512 on there are enough output tiles without splitting K.
SPLITK_MAX_M = 256


def triton_tile_candidates(m: int, n: int, k: int, dtype: torch.dtype,
                           out_dtype: torch.dtype, block_scales: bool = False) -> list[Candidate]:
    if m < TILE_MIN_M:
        return []
    from gemmtune.kernels.triton._checks import why_not_block_scaled
    from gemmtune.kernels.triton.gemm_tile import TileConfig, why_not_supported

    # 64 B of K per row at least (BK 32 won no shape on H100), wide N tiles, 4-8 warps.
    bm_max = max(16, 1 << (m - 1).bit_length())
    configs = {TileConfig(bm, bn, bk, 8, warps, stages)
               for bm in (64, 128) if bm <= bm_max
               for bn in (128, 256) for bk in (64, 128)
               for warps in (4, 8) for stages in (3, 4)}
    return [Candidate(c.name, "triton") for c in sorted(configs, key=lambda c: c.name)
            if why_not_supported(c, m, n, k, dtype, out_dtype) is None
            and not (block_scales and why_not_block_scaled(c, dtype))]


# The persistent TMA kernel pays (if anywhere) where output tiles outnumber the SMs many times.
PERSISTENT_MIN_M = 512


def triton_persistent_candidates(m: int, n: int, k: int, dtype: torch.dtype,
                                 out_dtype: torch.dtype, block_scales: bool = False
                                 ) -> list[Candidate]:
    if m < PERSISTENT_MIN_M or block_scales:
        return []
    from gemmtune.kernels.triton.gemm_persistent import PersistentConfig, why_not_supported

    # 128 B of K per row (256 B for 1-byte types), the large tiles of the tile kernel's winners.
    bk = {1: 128, 2: 64, 4: 32}[dtype.itemsize]
    configs = [PersistentConfig(bm, bn, bk, 8, 8, stages)
               for bm, bn in ((128, 128), (128, 256), (256, 128)) for stages in (3, 4)]
    return [Candidate(c.name, "triton") for c in configs
            if why_not_supported(c, m, n, k, dtype, out_dtype) is None]


def triton_splitk_candidates(m: int, n: int, k: int, dtype: torch.dtype,
                             out_dtype: torch.dtype, block_scales: bool = False
                             ) -> list[Candidate]:
    if m > SPLITK_MAX_M:
        return []
    from gemmtune.kernels.triton import gemm_splitk
    from gemmtune.kernels.triton._checks import why_not_block_scaled
    from gemmtune.kernels.triton._splits import pdl_where_supported

    # With programmatic dependent launch where the GPU has it (benchmarks/splitk_sweep.py).
    pdl = pdl_where_supported()
    block_ks = (64, 128) if block_scales else None
    configs = gemm_splitk.candidates(m, n, k, dtype, pdl=pdl, block_ks=block_ks) + \
        gemm_splitk.swapped_candidates(m, n, k, dtype, pdl=pdl, block_ks=block_ks)
    found = []
    for c in configs:
        if gemm_splitk.why_not_supported(c, m, n, k, dtype, out_dtype) is not None \
                or (block_scales and why_not_block_scaled(c, dtype)):
            continue
        twin = None if block_scales else gemm_splitk.promoted_twin(c, k, dtype)
        if twin is None or gemm_splitk.why_not_supported(twin, m, n, k, dtype, out_dtype):
            found.append(Candidate(c.name, "triton", splitk=c.split_k))
        else:
            found += [Candidate(twin.name, "triton", splitk=c.split_k),
                      Candidate(c.name, "triton", splitk=c.split_k,
                                simplicity=FAST_FP8_SIMPLICITY)]
    return found


# An FP8 split-K config with fast accumulation is kept only where it is faster beyond the noise
# than its promoted twin (``gemm_splitk.promoted_twin``) and everything else
# (family.Candidate.simplicity).
FAST_FP8_SIMPLICITY = 3


def triton_gemv_candidates(m: int, n: int, k: int, dtype: torch.dtype,
                           out_dtype: torch.dtype, block_scales: bool = False
                           ) -> list[Candidate]:
    """The GEMV kernel's configs for M <= its MAX_M (none above), with PDL where the GPU has
    it, as the split-K kernel's."""
    from gemmtune.kernels.triton import gemm_gemv
    from gemmtune.kernels.triton._splits import pdl_where_supported

    if m > gemm_gemv.MAX_M:
        return []
    return [Candidate(c.name, "triton", splitk=c.split_k)
            for c in gemm_gemv.candidates(m, n, k, dtype, pdl=pdl_where_supported(),
                                          block_scales=block_scales)
            if gemm_gemv.why_not_supported(c, m, n, k, dtype, out_dtype) is None]


# What a GEMM row keeps when candidates tie within noise on the GPU, simplest first: cuBLASLt's
# own pick, then torch's row, then anything tuned. cuBLASLt's pick is mostly the algorithm
# torch's row runs, through a call that costs the host less (docs/benchmarks.md, session 12:
# an eager Hugging Face step 1.00-1.02x with it for every shape, 0.98x with torch's row).
CUBLASLT_PICK_SIMPLICITY = 0
TORCH_ROW_SIMPLICITY = 1


def cublaslt_candidates(m: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype,
                        has_bias: bool, scaling: str = "") -> list[Candidate]:
    """cuBLASLt algorithms for the shape (none without nvmath-python). ``scaling``: FP8's scale
    mode as timed (kernels.cublaslt.SCALINGS), or "" for bf16/fp16."""
    from gemmtune.kernels import cublaslt

    if cublaslt.nvmath_missing() or cublaslt.why_not_types(dtype, out_dtype, scaling):
        return []
    algos = cublaslt.enumerate_algos(m, n, k, dtype, out_dtype, has_bias, scaling=scaling)
    # The heuristic's first choice is what cuBLASLt would pick itself: kept over torch's row
    # and the tuned ones on a tie (CUBLASLT_PICK_SIMPLICITY).
    return [Candidate(a.name, "cublaslt", splitk=a.split_k,
                      simplicity=CUBLASLT_PICK_SIMPLICITY if i == 0 else 2)
            for i, a in enumerate(algos)]


# Why bf16 Triton candidates are not run in Triton's CPU interpreter: its tl.dot multiplies the
# raw bit patterns of bf16 operands (triton-lang/triton#11584; shared/notes), so every one would
# fail the gate for a reason that is not the kernel's.
INTERPRETER_BF16 = ("Triton's CPU interpreter computes bf16 dots wrongly (triton-lang/triton"
                    "#11584): bf16 Triton kernels are checked on a GPU, not here")


def triton_candidates(m: int, n: int, k: int, dtype: torch.dtype,
                      out_dtype: torch.dtype, block_scales: bool = False) -> list[Candidate]:
    dots = triton_tile_candidates(m, n, k, dtype, out_dtype, block_scales) + \
        triton_splitk_candidates(m, n, k, dtype, out_dtype, block_scales) + \
        triton_persistent_candidates(m, n, k, dtype, out_dtype, block_scales)
    gemvs = triton_gemv_candidates(m, n, k, dtype, out_dtype, block_scales)
    if torch.cuda.is_available():
        return dots + gemvs
    # On the CPU (interpreter) a few configs are enough to exercise the path. The GEMV has no
    # tl.dot, so bf16 runs right there; the one with the fewest programs, as the interpreter
    # runs programs one after another (BN1 over N = 200 took 5.5 s a call, BN16 a tenth).
    refused = INTERPRETER_BF16 if dtype == torch.bfloat16 else ""
    return [dataclasses.replace(c, refused=refused) for c in dots[:2]] + \
        sorted(gemvs, key=lambda c: _gemv_programs(c.name, n))[:1]


def gluon_candidates(p: GemmProblem, registry) -> list[Candidate]:
    """The Gluon kernels' configs (FP8: ``gemm_frag.candidates``, ``gemm_ring.candidates`` to
    M = 256 and ``gemm_wsring.candidates`` (16 <= M <= 256), with PDL where it is supported, and
    without block scales wsring's fast twins (``gemm_wsring.fast_twin``)) that ``registry``
    can run for ``p`` (it refuses them off Hopper, in the interpreter, on a layout
    the kernel does not read and, with block scales, at steps other than 128); none without a
    GPU."""
    if not torch.cuda.is_available():
        return []
    from gemmtune.kernels.triton import gemm_frag, gemm_ring, gemm_wsring
    from gemmtune.kernels.triton._splits import pdl_where_supported

    pdl = pdl_where_supported()
    wsring = gemm_wsring.candidates(p.m, p.n, p.k, p.dtype, pdl=pdl)
    configs = (gemm_frag.candidates(p.m, p.n, p.k, p.dtype, pdl=pdl)
               + gemm_ring.candidates(p.m, p.n, p.k, p.dtype, pdl=pdl) + wsring)
    found = [Candidate(cfg.name, "triton", splitk=cfg.split_k) for cfg in configs
             if registry.can_run(cfg.name, p)]
    if p.scaling == Scaling.block:
        return found
    # Fast accumulation as split-K's: kept only where faster beyond the noise.
    twins = (gemm_wsring.fast_twin(cfg, p.k) for cfg in wsring)
    return found + [Candidate(t.name, "triton", splitk=t.split_k,
                              simplicity=FAST_FP8_SIMPLICITY)
                    for t in twins if t is not None and registry.can_run(t.name, p)]


def mxfp4_candidates(p: GemmProblem, wanted: frozenset[str], baseline: str,
                     registry) -> list[Candidate]:
    """The MXFP4 families' candidates (gemm_a16w4, gemm_a4w4_blockscale): their torch
    ``baseline``, then the MXFP4 kernel's configs (``gemm_w4.candidates``, for weights as
    quantised; on the CPU two, in the interpreter, bf16 ones refused as the other families'
    are) and, on a GPU, those of the register-direct kernel (``gemm_w4frag.candidates``, with
    PDL where supported), of the x-as-A kernel (``gemm_w4xa.candidates``, 9-16 rows of x,
    packed w, with PDL where supported), of the warpgroup-MMA kernel (``gemm_w4wg.candidates``,
    prefill) and of dequantise-then-cuBLAS (``gemm_w4deq.candidates``, prefill)
    for the problem's layout that ``registry`` can run, numbered."""
    found = []
    if "torch" in wanted:
        found.append(Candidate(baseline, "torch", simplicity=TORCH_ROW_SIMPLICITY))
    if "triton" in wanted:
        from gemmtune.kernels.triton import gemm_w4

        configs = [] if p.preshuffled else [
            Candidate(c.name, "triton") for c in gemm_w4.candidates(p.m, p.n, p.k, p.dtype)]
        if not torch.cuda.is_available():
            refused = INTERPRETER_BF16 if p.dtype == torch.bfloat16 else ""
            configs = [dataclasses.replace(c, refused=refused) for c in configs[:2]]
        else:
            from gemmtune.kernels.triton import gemm_w4deq, gemm_w4frag, gemm_w4wg, gemm_w4xa
            from gemmtune.kernels.triton._splits import pdl_where_supported

            decode_configs = [c for module in (gemm_w4frag, gemm_w4xa) for c in module.candidates(
                p.m, p.n, p.k, p.dtype, pdl=pdl_where_supported(), packed=p.preshuffled)]
            configs += [Candidate(c.name, "triton", splitk=c.split_k) for c in decode_configs
                        if registry.can_run(c.name, p)]
            for module in (gemm_w4wg, gemm_w4deq):
                configs += [Candidate(c.name, "triton") for c in module.candidates(
                    p.m, p.n, p.k, p.dtype, packed=p.preshuffled) if registry.can_run(c.name, p)]
        found += configs
    return number_candidates(found)


def _gemv_programs(name: str, n: int) -> int:
    from gemmtune.kernels.triton.gemm_gemv import GemvConfig

    config = GemvConfig.from_name(name)
    return -(-n // config.block_n) * config.split_k


def eight_bit(family: str, p: GemmProblem) -> GemmProblem:
    """``p``, if its operands are FP8 or INT8 (what the per-row-scaled families tune)."""
    if p.dtype not in Q_DTYPES:
        raise ValueError(f"q_dtype_w={p.dtype}: {family} tunes "
                         f"{' and '.join(str(d) for d in Q_DTYPES)} weights")
    return p


def rowwise_scaled_inputs(p: GemmProblem, gen: torch.Generator):
    """FP8/INT8 operands of ``p`` as serving has them: activations with a few outlier tokens
    (as in LLMs: the per-token scales then differ) quantised per token, a weight per channel.
    Returns (xq, wq, x_scale (M,), w_scale (N,), the dequantised product in fp32)."""
    from gemmtune import quant
    from gemmtune.kernels.torch_ref import gemm_a8w8_ref

    device = gen.device
    per_token, per_channel = quant.token_channel_quantisers(p.dtype)
    x = torch.randn(p.m, p.k, generator=gen, device=device) \
        * (1 + 4 * torch.rand(p.m, 1, generator=gen, device=device))
    w = torch.randn(p.n, p.k, generator=gen, device=device) * p.k ** -0.5
    xq, x_scale = per_token(x)
    wq, w_scale = per_channel(w)
    x_scale, w_scale = x_scale.reshape(-1), w_scale.reshape(-1)
    return xq, wq, x_scale, w_scale, gemm_a8w8_ref(xq, wq, x_scale, w_scale, None, torch.float32)


def number_candidates(found: list[Candidate]) -> list[Candidate]:
    """Each candidate's ``solidx``: its place in the list (the seeds' column)."""
    return [dataclasses.replace(c, solidx=i) for i, c in enumerate(found)]


class GemmTuner(FamilyTuner):
    """A GEMM family's tuner: its ``registry`` and ``problem_of`` (the op's own), candidates and
    ``prepare`` from the family."""

    registry: KernelRegistry
    problem_of: Callable[[tuple], GemmProblem]

    def __init__(self):
        # Constructed in the parent too (for result rows): no CUDA work here.
        self.timing_label = "graph.coldL2" if torch.cuda.is_available() else "cpu.wall"

    def shape(self, key: tuple) -> GemmProblem:
        """The GEMM a table key describes."""
        return self.problem_of(key)

    def wanted(self, libtypes: frozenset[str]) -> frozenset[str]:
        """The backends to try: those asked for, or every backend of the family."""
        return libtypes or frozenset(t.value for t in self.registry.libtypes)

    def gemm_candidates(self, p: GemmProblem, libtypes: frozenset[str], baseline: str,
                        cublaslt_scaling: str | None = None,
                        block_scales: bool = False) -> list[Candidate]:
        """The family's torch ``baseline``, then the cuBLASLt algorithms (on a GPU, where the
        family has them: ``cublaslt_scaling`` "" for unscaled, "outer" for FP8 timed with
        per-row scales), then the Triton configs; numbered in that order."""
        wanted = self.wanted(libtypes)
        found = []
        if "torch" in wanted:
            found.append(Candidate(baseline, "torch", simplicity=TORCH_ROW_SIMPLICITY))
        if "cublaslt" in wanted and cublaslt_scaling is not None and torch.cuda.is_available():
            found += cublaslt_candidates(p.m, p.n, p.k, p.dtype, p.out_dtype, p.has_bias,
                                         scaling=cublaslt_scaling)
        if "triton" in wanted:
            found += triton_candidates(p.m, p.n, p.k, p.dtype, p.out_dtype, block_scales)
        return number_candidates(found)

    @staticmethod
    def generator(seed: int) -> torch.Generator:
        """The random source of ``prepare``: on the GPU the tuner times on, else the CPU."""
        return torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu"
                               ).manual_seed(seed)

    def _kernel(self, name: str, key: tuple):
        # KernelNameError (a ValueError) says why the kernel cannot run the shape.
        return self.registry.resolve_for(name, self.shape(key))

    def precompile(self, name: str, prepared: Prepared) -> None:
        kernel = self._kernel(name, prepared.key)
        if hasattr(kernel, "warmup"):
            kernel.warmup(*prepared.inputs)

    def run(self, name: str, prepared: Prepared) -> torch.Tensor:
        kernel = self._kernel(name, prepared.key)
        call: GemmCall = prepared.inputs
        out = torch.full((call.x.shape[0], call.w.shape[0]), float("nan"),
                         dtype=call.out_dtype, device=call.x.device)
        result = kernel(*call, out=out)
        if result.data_ptr() != out.data_ptr():
            raise RuntimeError(f"{name} did not write into the output it was given")
        return out

    def time(self, name: str, prepared: Prepared, iters: int, warmup: int) -> tuple[float, float]:
        kernel = self._kernel(name, prepared.key)
        call: GemmCall = prepared.inputs
        if not call.x.is_cuda:
            return eager_us(lambda: kernel(*call), iters, warmup)
        for _ in range(warmup):
            kernel(*call)
        return graph_replay_us(lambda operands: kernel(*call._replace(**operands._asdict())),
                               _rotating(prepared), replays=iters)

    def time_many(self, names: list[str], prepared: Prepared, iters: int,
                  warmup: int) -> list[tuple[float, float]]:
        call: GemmCall = prepared.inputs
        if not call.x.is_cuda:
            return super().time_many(names, prepared, iters, warmup)
        kernels = [self._kernel(name, prepared.key) for name in names]
        for kernel in kernels:
            for _ in range(warmup):
                kernel(*call)
        calls = [lambda operands, k=k: k(*call._replace(**operands._asdict())) for k in kernels]
        replays = 2
        return interleaved_graph_us(calls, _rotating(prepared), rounds=max(1, iters // replays),
                                    replays=replays)

    def metrics(self, key: tuple, us: float) -> tuple[float, float]:
        s = self.shape(key)
        size_in, size_out = s.dtype.itemsize, s.out_dtype.itemsize
        flops = 2.0 * s.m * s.n * s.k
        nbytes = ((s.m * s.k + s.n * s.k) * size_in + s.m * s.n * size_out
                  + (s.n * 2 if s.has_bias else 0))
        return flops / us / 1e6, nbytes / us / 1e3


class Operands(NamedTuple):
    """The operands a timed call reads from memory: one rotating copy of them."""

    x: torch.Tensor
    w: torch.Tensor
    bias: torch.Tensor | None


def _rotating(prepared: Prepared) -> list[Operands]:
    """Copies of (x, w, bias) that together exceed L2, made once per shape: each timed call then
    reads its operands from HBM, as decode does."""
    sets = prepared.extra.get("rotating")
    if sets is None:
        call: GemmCall = prepared.inputs
        first = Operands(call.x, call.w, call.bias)
        per_set = sum(t.numel() * t.element_size() for t in first if t is not None)
        sets = [Operands(*(None if t is None else t.clone() for t in first))
                for _ in range(copies_to_exceed_l2(per_set))]
        prepared.extra["rotating"] = sets
    return sets

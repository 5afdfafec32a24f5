"""``gemmtune tune fmoe``: the torch backend and the Triton stages of ``fused_moe``, screened
apart, then paired and timed end to end.

Candidates are ``torch.moe`` and, per block_m, stage-1 configs (``triton.moe1:...``) and stage-2
configs (``triton.moe2:...``). A stage is checked by running the whole op with it and a default
config of the other stage with the same block_m, against the fp32 expert-by-expert reference,
and timed alone over the same routing: stage 1 with the routing preparation (``us1``), stage 2
with the sum over slots (``us2``). ``compose`` then pairs the fastest stages of each block_m into
whole solutions (``stage1+stage2``, estimated at us1 + us2), which the engine re-times end to end
beside torch and chooses from. For few tokens the 1-stage kernel's configs
(``triton.moe_1stage:...``) and the streaming kernel's (``triton.moe_stream:...``, one launch
too) are whole solutions from the start, timed end to end as torch is; a row one of them wins
has ``run_1stage`` 1. For prefill token counts (bf16) ``triton.moe_gmm``, our steps
around torch's grouped GEMM, is a whole solution too. Routing is a seeded random top-k: uniform,
or with ``--routing zipf`` a few popular experts taking most tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import NamedTuple

import torch

from gemmtune.families.fmoe import quantised
from gemmtune.families.fmoe.inputs import (ROUTINGS, MoeCase, quantised_experts, random_inputs,
                                           rank_mask)
from gemmtune.families.fmoe.op import REGISTRY, SCHEMA, FmoeKey, expert_map_of, problem_of
from gemmtune.kernels.problem import MoeProblem, Scaling
from gemmtune.kernels.torch_ref import TORCH_MOE, fused_moe_ref
from gemmtune.kernels.triton.moe_configs import (BLOCK_MS, GROUPED_MM_NAME, ONE_LAUNCH_PREFIXES,
                                                 PAIR_BLOCK_M, STAGE1_PREFIX, STAGE2_PREFIX,
                                                 MoeOneStageConfig, MoeStage1Config,
                                                 MoeStage2Config, MoeStreamConfig,
                                                 two_stage_name)
from gemmtune.measure.accuracy import TOLERANCES
from gemmtune.measure.timing import cold_copies, eager_us, graph_replay_us, interleaved_graph_us
from gemmtune.tables.values import QuantType
from gemmtune.tune.family import Candidate, Evaluation, FamilyTuner, Prepared, Status

# How many of each stage's fastest configs per block_m are paired (4 pairs per block_m).
PAIRED_PER_STAGE = 2
# The 1-stage kernel holds every token in one tile of rows, so it is a candidate for decode's
# token counts only.
ONE_STAGE_MAX_TOKENS = 32
# The streaming kernel reads each routed pair's weights (an expert two tokens share, twice). On
# the H100 it is within a few percent of the other decode kernels at 1-2 tokens and 1.1-1.4x
# slower from 4 (docs/benchmarks.md).
STREAM_MAX_TOKENS = 2
# Our steps around torch's grouped GEMM (``triton.moe_gmm``) pay off only where the GEMMs
# dominate: prefill token counts.
GROUPED_MM_MIN_TOKENS = 256
# Persistent stages (``P1``, ``P2``) walk many tiles per SM: prefill token counts too.
PERSISTENT_MIN_TOKENS = 256
# Stage 1 quantising its own output (``QO1``) saves a launch (a few µs) at decode's and short
# batches' token counts. It won 1x128 block-scale rows on the H100 and no per-token row: its
# count's release and the re-read cost what the launch did there (docs/benchmarks.md).
QUANT_OUT_MAX_TOKENS = 256
QUANT_OUT_OFFERED = (Scaling.block,)


class Load(NamedTuple):
    """What a uniform top-k routing is expected to give this rank's experts (all of them, or
    with expert parallelism over ``ep`` ranks 1/ep of the global ones)."""

    pairs: float  # routed (token, slot) pairs to local experts
    reached: float  # local experts with at least one pair

    @classmethod
    def of(cls, problem: MoeProblem, ep: int = 1) -> "Load":
        global_experts = problem.experts * ep
        reached = problem.experts * (1 - (1 - problem.topk / global_experts) ** problem.tokens)
        return cls(problem.tokens * problem.topk / ep, reached)

    def per_expert(self, problem: MoeProblem) -> float:
        return self.pairs / max(1, problem.experts)

    def blocks(self, block_m: int) -> float:
        """Blocks of ``block_m`` rows the routing makes: the experts it reaches, each with its
        pairs rounded up to whole blocks."""
        per_reached = self.pairs / max(self.reached, 1e-9)
        return self.reached * -(-per_reached // block_m)


def _stage_space(problem: MoeProblem, gpu: bool,
                 load: Load) -> tuple[list[MoeStage1Config], list[MoeStage2Config]]:
    """The pruned configs of both stages: block_m up to twice the pairs an expert gets on
    average (a larger one only pads), 64-128 wide tiles (stage 1 also 32 at block_m 16), 4-8
    warps, split-K only where stage 2 has too few tiles to fill the GPU and inter_dim is long
    enough to split; the pair-block configs where they apply; on the CPU (the interpreter) one
    small config each."""
    if not gpu:  # (8-bit dots take K steps of 32 or more)
        bk = 16 if problem.scaling is Scaling.none else 32
        return [MoeStage1Config(16, 16, bk, 4, 1)], [MoeStage2Config(16, 16, bk, 1, 4, 1)]
    per_expert = load.per_expert(problem)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    first, second = _pair_block_space(problem, load)
    fp8 = problem.scaling is not Scaling.none
    for bm in (b for b in BLOCK_MS if b <= max(16, 2 * per_expert)):
        for bn in (32, 64, 128) if bm == 16 else (64, 128):
            for bk in (64, 128):
                for warps, stages in ((4, 3), (4, 4), (8, 3)) + (((4, 6),) if fp8 else ()):
                    first.append(MoeStage1Config(bm, bn, bk, warps, stages))
        blocks = load.blocks(bm)
        for bn in (64, 128, 256):
            for bk in (64, 128):
                tiles = blocks * -(-problem.model_dim // bn)
                for split_k in (1, 2, 4):
                    if split_k > 1 and (tiles * split_k > 4 * sms
                                        or problem.inter_dim < 2 * split_k * bk):
                        continue
                    for warps, stages in ((4, 3), (8, 3)):
                        second.append(MoeStage2Config(bm, bn, bk, split_k, warps, stages))
    first += _quant_out_variants(problem, [c for c in first if not c.pair_blocks], (3, 4))
    persistent_first, persistent_second = _persistent_space(problem, load)
    return first + persistent_first, second + persistent_second


def _quant_out_variants(problem: MoeProblem, configs: list[MoeStage1Config],
                        stages: tuple[int, ...]) -> list[MoeStage1Config]:
    """Stage-1 configs (4 warps, ``stages`` deep) quantising their own output, where it is
    offered (QUANT_OUT_OFFERED, up to QUANT_OUT_MAX_TOKENS tokens)."""
    if problem.scaling not in QUANT_OUT_OFFERED or problem.tokens > QUANT_OUT_MAX_TOKENS:
        return []
    return [dataclasses.replace(c, quant_out=1) for c in configs
            if c.num_warps == 4 and c.num_stages in stages]


def _persistent_space(problem: MoeProblem, load: Load) -> tuple[list[MoeStage1Config],
                                                                list[MoeStage2Config]]:
    """Persistent stage configs from PERSISTENT_MIN_TOKENS tokens: 64-128 row blocks (up to
    twice an expert's pairs), wide tiles (128x256 of output at stage 2, gate and up 128x128 at
    stage 1), 8 warps, 3-4 stages of 64-wide steps (FP8: also 128-wide, the same bytes), the
    tile loop as written or flattened (each wins some shapes on the H100: docs/benchmarks.md)."""
    if problem.tokens < PERSISTENT_MIN_TOKENS:
        return [], []
    block_ms = [bm for bm in (64, 128) if bm <= max(64, 2 * load.per_expert(problem))]
    block_ks = (64,) if problem.scaling is Scaling.none else (64, 128)
    first = [MoeStage1Config(bm, bn, bk, 8, stages, persistent=kind)
             for bm in block_ms for bn in (64, 128) for bk in block_ks for stages in (3, 4)
             for kind in (1, 2)]
    second = [MoeStage2Config(bm, bn, bk, 1, 8, stages, persistent=kind)
              for bm in block_ms for bn in (128, 256) for bk in block_ks for stages in (3, 4)
              for kind in (1, 2)]
    return first, second


def _pair_block_space(problem: MoeProblem, load: Load) -> tuple[list[MoeStage1Config],
                                                                list[MoeStage2Config]]:
    """Stage configs over pair blocks, where there are no more pairs than experts (decode: the
    routing preparation would make one block per pair anyway, at the cost of a launch). Narrow
    tiles too: a few pairs must still spread over every SM."""
    if load.pairs > problem.experts:
        return [], []
    # FP8 steps carry half the bytes: deeper pipelines keep as many in flight, and model_dim
    # split in parts spreads decode's few pairs over more SMs.
    fp8 = problem.scaling is not Scaling.none
    depths = (3, 4, 6, 8) if fp8 else (3, 4)
    first = [MoeStage1Config(PAIR_BLOCK_M, bn, bk, 4, stages, pair_blocks=1, split_k=split_k)
             for bn in (16, 32, 64, 128) for bk in (64, 128, 256) for stages in depths
             for split_k in ((1, 2, 4) if fp8 and stages == 4 else (1,))
             if split_k == 1 or bn <= 64]
    second = [MoeStage2Config(PAIR_BLOCK_M, bn, bk, split_k, 4, 3, pair_blocks=1)
              for bn in (32, 64, 128) for bk in (64, 128, 256) for split_k in (1, 2)
              if problem.inter_dim >= 2 * split_k * bk]
    return first + _quant_out_variants(problem, first, (3, 4, 6)), second


def _one_stage_space(problem: MoeProblem, gpu: bool) -> list[MoeOneStageConfig]:
    """1-stage configs for up to ONE_STAGE_MAX_TOKENS tokens: stage-1 tiles of 16-32
    intermediate columns (decode's few experts must still cover every SM), stage-2 tiles of
    64-128 output columns in steps of 64-128, 3-4 stages; on the CPU one small config. (Narrower
    stage-2 tiles, 8 warps, and holding w2 through the wait lost everywhere on the H100:
    docs/benchmarks.md.)"""
    if problem.tokens > ONE_STAGE_MAX_TOKENS:
        return []
    if not gpu:
        return [MoeOneStageConfig(16, 16, 16, 16, 4, 1)]
    return [MoeOneStageConfig(bn, 128, bd, bi, 4, stages) for bn in (16, 32)
            for bd in (64, 128) for bi in (64, 128) for stages in (3, 4)]


def _stream_space(problem: MoeProblem, gpu: bool) -> list[MoeStreamConfig]:
    """Streaming configs for up to STREAM_MAX_TOKENS tokens: stage-1 programs of 4-16
    intermediate columns of a pair in steps of 256-512 along model_dim, stage-2 programs of 4-16
    output columns of a token in steps of 64-128 along inter_dim, 4 warps; on the CPU one small
    config. (2-column programs, steps of 1024 along model_dim or 256 along inter_dim, and 8
    warps never came within 3% of the best on the H100: docs/benchmarks.md.)"""
    if problem.tokens > STREAM_MAX_TOKENS:
        return []
    if not gpu:
        return [MoeStreamConfig(16, 16, 16, 16, 4)]
    return [MoeStreamConfig(bn, bk, bd, bi, 4) for bn in (4, 8, 16) for bk in (256, 512)
            for bd in (4, 8, 16) for bi in (64, 128)]


class FmoeTuner(FamilyTuner):
    schema = SCHEMA
    # The seed's default for fmoe; the bound on ||out - ref|| / ||ref|| is the dtype's as ever.
    default_err_ratio = 0.5

    def __init__(self, routing: str = "uniform", ep: int = 1):
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r}: expected one of {', '.join(ROUTINGS)}")
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(f"--ep {ep!r}: expected a positive number of expert-parallel ranks")
        self.routing = routing
        self.ep = ep
        self.timing_label = "graph.coldL2" if torch.cuda.is_available() else "cpu.wall"
        # (key, stage name) -> its screen result, kept in the parent for the row's columns.
        self._screened: dict[tuple, Evaluation] = {}
        self._lock = threading.Lock()

    @classmethod
    def factory_from_args(cls, args):
        ep = getattr(args, "ep", None)
        return functools.partial(cls, routing=getattr(args, "routing", None) or "uniform",
                                 ep=1 if ep is None else ep)

    def inputs_note(self, seed: int) -> str:
        ep = f"ep={self.ep};" if self.ep > 1 else ""
        return f"routing={self.routing};{ep}seed={seed}"

    def shape(self, key: FmoeKey) -> MoeProblem:
        return problem_of(key)

    # ----------------------------------------------------------------------- candidates
    def candidates(self, key: FmoeKey, libtypes: frozenset[str]) -> list[Candidate]:
        problem = self.shape(key)
        wanted = libtypes or frozenset({"torch", "triton"})
        found = []
        if "torch" in wanted:
            found.append(Candidate(TORCH_MOE, "torch", simplicity=0))
        if "triton" in wanted:
            first, second = _stage_space(problem, torch.cuda.is_available(),
                                         Load.of(problem, self.ep))
            kernel = REGISTRY.resolve
            for config in first + second:
                partner = _partner(config)
                name = _whole(config, partner)
                if kernel(name).check(problem) is None:
                    found.append(Candidate(config.name, "triton"))
            for config in (_one_stage_space(problem, torch.cuda.is_available())
                           + _stream_space(problem, torch.cuda.is_available())):
                if kernel(config.name).check(problem) is None:
                    found.append(Candidate(config.name, "triton"))
            if (problem.tokens >= GROUPED_MM_MIN_TOKENS
                    and kernel(GROUPED_MM_NAME).check(problem) is None):
                found.append(Candidate(GROUPED_MM_NAME, "triton"))
        return [Candidate(c.name, c.libtype, c.simplicity, solidx=i) for i, c in enumerate(found)]

    # --------------------------------------------------------------------------- inputs
    def prepare(self, key: FmoeKey, seed: int) -> Prepared:
        p = self.shape(key)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        gen = torch.Generator(device=device).manual_seed(seed)
        hidden, w1, w2, topk_weight, topk_ids = random_inputs(p, gen, self.routing,
                                                              p.experts * self.ep)
        expert_map = expert_map_of(rank_mask(p.experts, self.ep, hidden.device), p.experts,
                                   hidden.device)
        if p.scaling is Scaling.none:
            case = MoeCase(hidden, w1, w2, topk_weight, topk_ids, expert_map, p)
            ref = fused_moe_ref(hidden, w1, w2, topk_weight, topk_ids, expert_map, p.activation,
                                p.doweight_stage1)
            return Prepared(key, seed, case, ref)
        # FP8 experts: the errors are against the dequantised experts with exact activations.
        quant_type = QuantType.from_str(key.q_type)
        w1q, w2q, scales = quantised_experts(w1, w2, quant_type)
        del w1, w2
        if hidden.is_cuda:  # the bf16 experts' memory back for the other workers on the GPU
            torch.cuda.empty_cache()
        case = MoeCase(hidden, w1q, w2q, topk_weight, topk_ids, expert_map, p, scales)
        ref = quantised.reference(hidden, w1q, w2q, topk_weight, topk_ids, expert_map,
                                  quant_type, scales, p.activation, p.doweight_stage1)
        return Prepared(key, seed, case, ref)

    def tolerance(self, key: FmoeKey) -> tuple[float, float, float]:
        p = self.shape(key)
        return TOLERANCES[p.dtype] if p.scaling is Scaling.none else quantised.FP8_TOLERANCE

    # ---------------------------------------------------------------------- run and time
    def _kernel(self, name: str, problem: MoeProblem):
        """The whole op a candidate name stands for: a stage is run with the other stage's
        default config of its block_m."""
        if name.startswith((STAGE1_PREFIX + ":", STAGE2_PREFIX + ":")) and "+" not in name:
            name = _whole(_config(name), _partner(_config(name)))
        return REGISTRY.resolve_for(name, problem)

    def precompile(self, name: str, prepared: Prepared) -> None:
        case: MoeCase = prepared.inputs
        kernel = self._kernel(name, case.problem)
        if hasattr(kernel, "warmup"):
            kernel.warmup(*case.args(), **case.kwargs())

    def run(self, name: str, prepared: Prepared) -> torch.Tensor:
        case: MoeCase = prepared.inputs
        out = torch.full_like(case.hidden, float("nan"))
        result = case.run(self._kernel(name, case.problem), out=out)
        if result.data_ptr() != out.data_ptr():
            raise RuntimeError(f"{name} did not write into the output it was given")
        return out

    def time(self, name: str, prepared: Prepared, iters: int, warmup: int) -> tuple[float, float]:
        return self.time_many([name], prepared, iters, warmup)[0]

    def time_many(self, names: list[str], prepared: Prepared, iters: int,
                  warmup: int) -> list[tuple[float, float]]:
        if not prepared.inputs.hidden.is_cuda:
            return [eager_us(lambda n=name: self.run(n, prepared), iters, warmup)
                    for name in names]
        # Every candidate, torch's pipeline too, is captured in a CUDA graph and replayed: where
        # one does not capture, the batch fails and the engine times each alone, so only that
        # candidate fails (with the capture's error).
        calls = [self._timed_call(name, prepared) for name in names]
        for call in calls:
            for _ in range(warmup):
                call(_rotating(prepared)[0])
        if len(calls) == 1:
            return [graph_replay_us(calls[0], _rotating(prepared), iters)]
        replays = 2
        return interleaved_graph_us(calls, _rotating(prepared), rounds=max(1, iters // replays),
                                    replays=replays)

    def _timed_call(self, name: str, prepared: Prepared):
        """What a timing of ``name`` launches, over one rotating copy of the weights: a stage 1
        config with the routing preparation; a stage 2 config with the sum over slots, over a
        routing and intermediate made once; a whole solution (``stage1+stage2``, a 1-stage
        config, torch) end to end."""
        from gemmtune.kernels.triton import moe_stages
        from gemmtune.kernels.triton.fused_moe import ACT_CODES, route

        case: MoeCase = prepared.inputs
        hidden, _, _, topk_weight, topk_ids, expert_map, problem, scales = case
        act = ACT_CODES[problem.activation]
        experts = problem.experts
        if "+" in name or not name.startswith((STAGE1_PREFIX + ":", STAGE2_PREFIX + ":")):
            kernel = self._kernel(name, problem)
            return lambda copy: case.run(kernel, copy)
        config = _config(name)
        if isinstance(config, MoeStage1Config):
            def stage1(copy):
                routing = route(config, topk_ids, expert_map, experts)
                moe_stages.run_stage1(hidden, copy[0], topk_weight, topk_ids, expert_map,
                                      routing, act, problem.doweight_stage1, config,
                                      scales=scales, scaling=problem.scaling)
            return stage1
        routing = route(config, topk_ids, expert_map, experts)
        inter = moe_stages.run_stage1(hidden, case.w1, topk_weight, topk_ids, expert_map,
                                      routing, act, problem.doweight_stage1, _partner(config),
                                      scales=scales, scaling=problem.scaling)

        def stage2(copy):
            moe_stages.run_stage2(inter, copy[1], topk_weight, topk_ids, expert_map, routing,
                                  problem.doweight_stage1, config, hidden.shape[0], hidden.dtype,
                                  scales=scales)
        return stage2

    # ---------------------------------------------------------------------- the pairing
    def compose(self, key: tuple, candidates: list[Candidate], passing: list[Evaluation]
                ) -> tuple[list[Candidate], list[Evaluation]]:
        """Whole solutions from the screened stages: per block_m (and pair blocks or not), the
        PAIRED_PER_STAGE fastest of each stage, estimated at us1 + us2; beside them what passed
        whole (torch, the 1-stage kernel)."""
        stages = {1: {}, 2: {}}
        whole_candidates, whole = [], []
        by_name = {c.name: c for c in candidates}
        for ev in passing:
            if ev.name.startswith(STAGE1_PREFIX + ":") or ev.name.startswith(STAGE2_PREFIX + ":"):
                stage = 1 if ev.name.startswith(STAGE1_PREFIX) else 2
                stages[stage].setdefault(_blocks(_config(ev.name)), []).append(ev)
                with self._lock:
                    self._screened[(key, ev.name)] = ev
            else:
                whole_candidates.append(by_name[ev.name])
                whole.append(ev)
        for blocks in sorted(set(stages[1]) & set(stages[2])):
            firsts = sorted(stages[1][blocks], key=lambda e: e.us)[:PAIRED_PER_STAGE]
            seconds = sorted(stages[2][blocks], key=lambda e: e.us)[:PAIRED_PER_STAGE]
            for one in firsts:
                for two in seconds:
                    name = f"{one.name}+{two.name}"
                    whole_candidates.append(Candidate(name, "triton", parts=(one.name, two.name),
                                                      splitk=_config(two.name).split_k))
                    whole.append(Evaluation(name, Status.ok, max(one.err_ratio, two.err_ratio),
                                            max(one.rel_err, two.rel_err), one.us + two.us,
                                            max(one.spread, two.spread)))
        return whole_candidates, whole

    def result_fields(self, key: tuple, candidate: Candidate, evaluation: Evaluation,
                      env: str) -> dict:
        """The seed's fmoe columns: a Triton pair fills both stages' names, times and errors;
        the 1-stage kernel (``run_1stage`` 1) and torch are kernelName1 alone, their whole time
        as us1."""
        tflops, bw = self.metrics(key, evaluation.us)
        fields = {"block_m": 0, "ksplit": 0, "us1": round(evaluation.us, 4),
                  "kernelName1": candidate.name, "err1": round(evaluation.err_ratio, 6),
                  "us2": 0.0, "kernelName2": "", "err2": 0.0}
        if candidate.parts:
            with self._lock:
                one, two = (self._screened[(key, part)] for part in candidate.parts)
            fields = {"block_m": _config(one.name).block_m, "ksplit": _config(two.name).split_k,
                      "us1": round(one.us, 4), "kernelName1": one.name,
                      "err1": round(one.err_ratio, 6), "us2": round(two.us, 4),
                      "kernelName2": two.name, "err2": round(two.err_ratio, 6)}
        one_stage = candidate.name.startswith(tuple(p + ":" for p in ONE_LAUNCH_PREFIXES))
        return {**fields, "us": round(evaluation.us, 4), "run_1stage": int(one_stage),
                "tflops": round(tflops, 2), "bw": round(bw, 2), "timing": self.timing_label,
                "spread": round(evaluation.spread, 4), "env": env}

    def metrics(self, key: FmoeKey, us: float) -> tuple[float, float]:
        """(TFLOP/s, GB/s): the FLOPs of every routed pair's three projections, and the bytes
        of the experts uniform routing is expected to reach plus activations in and out."""
        p = self.shape(key)
        load = Load.of(p, self.ep)
        flops = 2.0 * load.pairs * 3 * p.inter_dim * p.model_dim
        weight_bytes = p.dtype.itemsize if p.scaling is Scaling.none else 1  # FP8 experts
        nbytes = load.reached * 3 * p.inter_dim * p.model_dim * weight_bytes \
            + 2 * p.tokens * p.model_dim * p.dtype.itemsize
        return flops / us / 1e6, nbytes / us / 1e3


def _config(name: str) -> MoeStage1Config | MoeStage2Config:
    if name.startswith(STAGE1_PREFIX + ":"):
        return MoeStage1Config.from_name(name)
    return MoeStage2Config.from_name(name)


def _blocks(config: MoeStage1Config | MoeStage2Config) -> tuple[int, int]:
    """What a stage config runs over: (block_m, pair_blocks); only stages that agree pair."""
    return config.block_m, config.pair_blocks


def _partner(config: MoeStage1Config | MoeStage2Config):
    """The other stage's default config over the same blocks (block_m and pair blocks): what a
    stage is checked with."""
    if isinstance(config, MoeStage1Config):
        return MoeStage2Config(config.block_m, 64, 64, 1, 4, 3, config.pair_blocks)
    return MoeStage1Config(config.block_m, 64, 64, 4, 3, config.pair_blocks)


def _whole(config, partner) -> str:
    first, second = (config, partner) if isinstance(config, MoeStage1Config) else \
        (partner, config)
    return two_stage_name(first, second)


def _rotating(prepared: Prepared) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of (w1, w2) that together exceed L2, made once per shape: each timed call reads
    its experts from HBM."""
    sets = prepared.extra.get("rotating")
    if sets is None:
        sets = prepared.extra["rotating"] = cold_copies((prepared.inputs.w1,
                                                         prepared.inputs.w2))
    return sets

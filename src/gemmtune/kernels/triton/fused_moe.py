"""A fused MoE as dispatch runs it from a table row (imported on first use, like every
``@triton.jit`` module): either the routing preparation (``moe_routing``) then the two stages
(``moe_stages``), named as one solution ``triton.moe1:<stage 1>+triton.moe2:<stage 2>`` (both
with the same block_m, the routing's), or the 1-stage kernel (``moe_one_stage``), named
``triton.moe_1stage:...``, or decode's streaming kernel (``moe_stream``), named
``triton.moe_stream:...``, or (many tokens, bf16) ``triton.moe_gmm``: our routing and
elementwise steps around torch's grouped GEMM. Stage configs with ``PB1`` run over pair blocks:
no routing preparation, a block per routed pair; with ``P1`` a stage is persistent, through TMA.

Called as every MoE backend is: ``kernel(hidden, w1, w2, topk_weight, topk_ids, expert_map,
problem)`` with hidden (T, D), w1 (E, 2I, D), w2 (E, D, I), topk_weight (T, topk) fp32,
topk_ids (T, topk) int32 global expert ids, expert_map (E_global,) int32 (-1: another rank's).
"""

from __future__ import annotations

import torch

from gemmtune.kernels.problem import Activation, MoeProblem, MoeScales, Scaling
from gemmtune.kernels.triton import _checks
from gemmtune.kernels.triton.moe_common import GELU, SILU
from gemmtune.kernels.triton.moe_configs import (GROUPED_MM_NAME, STAGE1_PREFIX, STAGE2_PREFIX,
                                                 MoeOneStageConfig, MoeStage1Config,
                                                 MoeStage2Config, MoeStreamConfig,
                                                 two_stage_name)
from gemmtune.kernels.triton.moe_grouped_mm import moe_grouped_mm, why_not_grouped_mm
from gemmtune.kernels.triton.moe_one_stage import moe_one_stage, why_not_one_stage
from gemmtune.kernels.triton.moe_persistent import why_not_tma
from gemmtune.kernels.triton.moe_routing import moe_routing, pair_blocks
from gemmtune.kernels.triton.moe_stages import (moe_stages, why_not_quant_out, why_not_stage1,
                                                why_not_stage2)
from gemmtune.kernels.triton.moe_stream import moe_stream, why_not_stream

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACT_CODES = {Activation.silu: SILU, Activation.gelu: GELU}
def route(config: MoeStage1Config | MoeStage2Config, topk_ids, expert_map, experts: int,
          warmup: bool = False):
    """The blocks a stage config runs over: pair blocks (nothing to prepare), or the routing
    preparation at its block_m."""
    if config.pair_blocks:
        return pair_blocks(topk_ids)
    return moe_routing(topk_ids, expert_map, experts, config.block_m, warmup=warmup)


def _why_not_fp8(solution: "TritonTwoStageMoe", problem: MoeProblem) -> str | None:
    """What the two-stage kernels take of FP8 experts: every scheme (per token, per tensor,
    per 1x128 block; block scales need K steps inside one block)."""
    if problem.scaling is Scaling.block and any(128 % stage.block_k
                                                for stage in (solution.stage1, solution.stage2)):
        return (f"block_k={solution.stage1.block_k}/{solution.stage2.block_k}: with 128x128 "
                f"block scales each K step must lie in one block (block_k divides 128)")
    if problem.dtype not in DTYPES:
        return f"{problem.dtype} activations: the Triton MoE kernels take {DTYPES}"
    return None


def _why_not_dtype(problem: MoeProblem) -> str | None:
    if problem.scaling is not Scaling.none:
        return (f"FP8 experts ({problem.scaling.value} scales): the Triton MoE kernels take "
                f"{DTYPES} experts only so far")
    if problem.dtype not in DTYPES:
        return f"{problem.dtype} experts: the Triton MoE kernels take {DTYPES}"
    return None


class TritonTwoStageMoe:
    """``triton.moe1:...+triton.moe2:...``: the routing and both stages of one table row."""

    def __init__(self, name: str):
        first, plus, second = name.partition("+")
        if not plus:
            raise ValueError(f"{name!r}: a two-stage MoE kernel names both stages, "
                             f"{STAGE1_PREFIX}:...+{STAGE2_PREFIX}:...")
        self.stage1 = MoeStage1Config.from_name(first)
        self.stage2 = MoeStage2Config.from_name(second)
        self.name = two_stage_name(self.stage1, self.stage2)

    def __repr__(self) -> str:
        return f"TritonTwoStageMoe({self.name!r})"

    def check(self, problem: MoeProblem) -> str | None:
        fp8 = problem.scaling is not Scaling.none
        problem_dtype = _why_not_fp8(self, problem) if fp8 else _why_not_dtype(problem)
        if problem_dtype:
            return problem_dtype
        operands = torch.float8_e4m3fn if fp8 else problem.dtype
        if (self.stage1.block_m, self.stage1.pair_blocks) != (self.stage2.block_m,
                                                                self.stage2.pair_blocks):
            return (f"stage 1 has block_m={self.stage1.block_m}, pair_blocks="
                    f"{self.stage1.pair_blocks} and stage 2 block_m={self.stage2.block_m}, "
                    f"pair_blocks={self.stage2.pair_blocks}: both run over one routing, so they "
                    f"must agree")
        quant_out = why_not_quant_out(self.stage1, problem.scaling)
        if quant_out:
            return quant_out
        if self.stage1.split_k > 1 and problem.doweight_stage1:
            return (f"split_k={self.stage1.split_k}: a split stage 1 leaves the activation to "
                    f"the quantiser, which does not apply the routing weight (doweight_stage1)")
        return (why_not_stage1(self.stage1, operands, problem.model_dim)
                or why_not_stage2(self.stage2, operands, problem.inter_dim)
                or _checks.why_not_dot_k(self.stage1, operands)
                or _checks.why_not_dot_k(self.stage2, operands)
                or why_not_tma(self.stage1, operands, problem.model_dim)
                or why_not_tma(self.stage2, operands, problem.inter_dim))

    def warmup(self, hidden, w1, w2, topk_weight, topk_ids, expert_map, problem: MoeProblem,
               scales: MoeScales | None = None) -> None:
        """Compile every kernel of this solution for these arguments, launching none (the
        interpreter has nothing to compile)."""
        if hidden.shape[0] and not _checks.interpreted():
            routing = route(self.stage1, topk_ids, expert_map, w1.shape[0], warmup=True)
            moe_stages(hidden, w1, w2, topk_weight, topk_ids, expert_map, routing,
                       ACT_CODES[problem.activation], problem.doweight_stage1, self.stage1,
                       self.stage2, warmup=True, scales=scales, scaling=problem.scaling)

    def __call__(self, hidden, w1, w2, topk_weight, topk_ids, expert_map, problem: MoeProblem,
                 out=None, scales: MoeScales | None = None):
        if hidden.shape[0] == 0:
            return torch.empty_like(hidden) if out is None else out
        routing = route(self.stage1, topk_ids, expert_map, w1.shape[0])
        return moe_stages(hidden, w1, w2, topk_weight, topk_ids, expert_map, routing,
                          ACT_CODES[problem.activation], problem.doweight_stage1, self.stage1,
                          self.stage2, out=out, scales=scales, scaling=problem.scaling)


class _OneLaunchMoe:
    """A solution that runs the whole MoE in one launch from its config (``CONFIG``), the
    routing read as it comes: ``launch`` is the kernel module's launcher."""

    CONFIG: type

    def __init__(self, name: str):
        self.config = self.CONFIG.from_name(name)
        self.name = self.config.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def launch(self, *args, **kwargs):
        raise NotImplementedError

    def warmup(self, hidden, w1, w2, topk_weight, topk_ids, expert_map,
               problem: MoeProblem) -> None:
        """Compile the kernel for these arguments, launching nothing."""
        if hidden.shape[0] and not _checks.interpreted():
            self.launch(hidden, w1, w2, topk_weight, topk_ids, expert_map,
                        ACT_CODES[problem.activation], problem.doweight_stage1, self.config,
                        warmup=True)

    def __call__(self, hidden, w1, w2, topk_weight, topk_ids, expert_map, problem: MoeProblem,
                 out=None):
        if hidden.shape[0] == 0:
            return torch.empty_like(hidden) if out is None else out
        return self.launch(hidden, w1, w2, topk_weight, topk_ids, expert_map,
                           ACT_CODES[problem.activation], problem.doweight_stage1, self.config,
                           out=out)


class TritonOneStageMoe(_OneLaunchMoe):
    """``triton.moe_1stage:...``: both GEMMs and the activation of every routed pair in one
    launch, on tensor cores, stage 2 of an expert waiting for its stage 1 (for few tokens)."""

    CONFIG = MoeOneStageConfig
    launch = staticmethod(moe_one_stage)

    def check(self, problem: MoeProblem) -> str | None:
        return _why_not_dtype(problem) or why_not_one_stage(self.config, problem.tokens,
                                                            problem.dtype)


class TritonStreamMoe(_OneLaunchMoe):
    """``triton.moe_stream:...``: decode's matrix-vector products in one streaming launch,
    persistent programs taking small chunks from one queue (``moe_stream``)."""

    CONFIG = MoeStreamConfig
    launch = staticmethod(moe_stream)

    def check(self, problem: MoeProblem) -> str | None:
        return _why_not_dtype(problem) or why_not_stream(self.config, problem.topk)


class TritonGroupedMmMoe:
    """``triton.moe_gmm``: our routing, gather, activation and combine around torch's grouped
    GEMM (for many tokens; bf16)."""

    name = GROUPED_MM_NAME

    def __repr__(self) -> str:
        return "TritonGroupedMmMoe()"

    def check(self, problem: MoeProblem) -> str | None:
        return _why_not_dtype(problem) or why_not_grouped_mm(problem.dtype, problem.model_dim,
                                                             problem.inter_dim)

    def warmup(self, hidden, w1, w2, topk_weight, topk_ids, expert_map,
               problem: MoeProblem) -> None:
        """Compile the Triton steps for these arguments, launching nothing."""
        if hidden.shape[0] and not _checks.interpreted():
            moe_grouped_mm(hidden, w1, w2, topk_weight, topk_ids, expert_map,
                           ACT_CODES[problem.activation], problem.doweight_stage1, warmup=True)

    def __call__(self, hidden, w1, w2, topk_weight, topk_ids, expert_map, problem: MoeProblem,
                 out=None):
        if hidden.shape[0] == 0:
            return torch.empty_like(hidden) if out is None else out
        return moe_grouped_mm(hidden, w1, w2, topk_weight, topk_ids, expert_map,
                              ACT_CODES[problem.activation], problem.doweight_stage1, out=out)

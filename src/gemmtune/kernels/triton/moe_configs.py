"""The configs of the fused-MoE Triton kernels and their names, apart from the kernels: a family
imports this module at load, while the ``@triton.jit`` modules are imported on first use (the
interpreter setting is read when a kernel is decorated, and tuner workers set it after they
import the families).
"""

from __future__ import annotations

from dataclasses import dataclass

from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.problem import MoeProblem

STAGE1_PREFIX = "triton.moe1"
STAGE2_PREFIX = "triton.moe2"
ONE_STAGE_PREFIX = "triton.moe_1stage"
STREAM_PREFIX = "triton.moe_stream"
# The solutions that run the whole MoE in one launch (a row they win has run_1stage 1).
ONE_LAUNCH_PREFIXES = (ONE_STAGE_PREFIX, STREAM_PREFIX)
# Our routing and elementwise steps around torch's grouped GEMM (moe_grouped_mm): no config.
GROUPED_MM_NAME = "triton.moe_gmm"
BLOCK_MS = (16, 32, 64, 128)  # the block_m a routing may use (the seed's choices)
# With pair blocks (``PB1``: decode's few pairs, most experts getting one) each block holds one
# routed pair, read straight from topk_ids, and no routing preparation runs; its block_m is the
# smallest tile tl.dot takes, of which one row is real.
PAIR_BLOCK_M = 16
# A stage config's ``persistent`` (``P1``): one persistent program per SM walking its tiles,
# the weights (and stage 2's intermediate) read through TMA descriptors, for prefill's many
# tiles; ``P2``: the same with the tile loop flattened into the K loop.
PERSISTENT, FLATTENED = 1, 2


@dataclass(frozen=True)
class MoeStage1Config(NamedConfig):
    """``triton.moe1:BM32.BN64.BK64.W4.S3[.PB<0|1>[.P<1|2>[.SK<n>[.QO1]]]]``: one
    stage-1 launch (fields are positional: a persistent config names ``PB0`` too, a split one
    ``PB.. P0``). ``split_k`` parts of model_dim add their sums into fp32 (FP8 experts, whose
    intermediate gets a pass of its own anyway: the activation moves there). ``quant_out``
    (FP8 experts scaled per token or per block): that pass is no launch of its own; the last
    program to finish a block's tiles quantises the block's rows."""

    NAME_CODEC = NameCodec("MoE stage-1 config", STAGE1_PREFIX, (
        Field("BM", "block_m"), Field("BN", "block_n"), Field("BK", "block_k"),
        Field("W", "num_warps"), Field("S", "num_stages"), Field("PB", "pair_blocks", default=0),
        Field("P", "persistent", default=0), Field("SK", "split_k", default=1),
        Field("QO", "quant_out", default=0)))

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    pair_blocks: int = 0  # 1: a block per routed pair, no routing preparation (PAIR_BLOCK_M)
    persistent: int = 0  # 1: a persistent TMA program per SM; 2: its tile loop flattened
    split_k: int = 1
    quant_out: int = 0  # 1: the block's last program quantises its rows (FP8 rows or blocks)


@dataclass(frozen=True)
class MoeStage2Config(NamedConfig):
    """``triton.moe2:BM32.BN64.BK64.SK1.W4.S3[.PB<0|1>[.P<1|2>]]``: one stage-2 launch,
    ``split_k`` parts of inter_dim."""

    NAME_CODEC = NameCodec("MoE stage-2 config", STAGE2_PREFIX, (
        Field("BM", "block_m"), Field("BN", "block_n"), Field("BK", "block_k"),
        Field("SK", "split_k"), Field("W", "num_warps"), Field("S", "num_stages"),
        Field("PB", "pair_blocks", default=0), Field("P", "persistent", default=0)))

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    pair_blocks: int = 0
    persistent: int = 0


@dataclass(frozen=True)
class MoeOneStageConfig(NamedConfig):
    """``triton.moe_1stage:BN32.BK128.BD64.BI256.W4.S3``: the 1-stage kernel; stage 1 in tiles of
    ``block_n`` intermediate columns, model_dim in steps of ``block_k``; stage 2 in tiles of
    ``block_d`` output columns, inter_dim in steps of ``block_i``."""

    NAME_CODEC = NameCodec("MoE 1-stage config", ONE_STAGE_PREFIX, (
        Field("BN", "block_n"), Field("BK", "block_k"), Field("BD", "block_d"),
        Field("BI", "block_i"), Field("W", "num_warps"), Field("S", "num_stages")))

    block_n: int
    block_k: int
    block_d: int
    block_i: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeStreamConfig(NamedConfig):
    """``triton.moe_stream:BN8.BK512.BD8.BI128.W4``: the streaming decode kernel; a stage-1
    program takes ``block_n`` intermediate columns of one routed pair, read in steps of
    ``block_k`` along model_dim; a stage-2 program ``block_d`` output columns of one token,
    inter_dim in steps of ``block_i``."""

    NAME_CODEC = NameCodec("MoE streaming config", STREAM_PREFIX, (
        Field("BN", "block_n"), Field("BK", "block_k"), Field("BD", "block_d"),
        Field("BI", "block_i"), Field("W", "num_warps")))

    block_n: int
    block_k: int
    block_d: int
    block_i: int
    num_warps: int


def two_stage_name(stage1: MoeStage1Config, stage2: MoeStage2Config) -> str:
    """The kernelName of a two-stage solution: both configs, ``stage1+stage2``."""
    return f"{stage1.name}+{stage2.name}"


def default_two_stage(problem: MoeProblem) -> str:
    """A pair of configs that runs any problem reasonably without tuning: block_m near the
    tokens an expert gets on average, 64-wide tiles."""
    per_expert = max(1, problem.tokens * problem.topk // max(1, problem.experts))
    block_m = next((b for b in (16, 32, 64) if per_expert <= b), 64)
    return two_stage_name(MoeStage1Config(block_m, 64, 64, 4, 3),
                          MoeStage2Config(block_m, 64, 64, 1, 4, 3))

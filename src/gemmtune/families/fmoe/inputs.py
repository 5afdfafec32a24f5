"""Random inputs of a fused MoE, as the tuner and the bench make them: fresh values (never
zeros), weights scaled so that outputs stay O(1), and a seeded top-k routing, uniform or with a
few popular experts (``zipf``)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from gemmtune.kernels.problem import MoeProblem

ROUTINGS = ("uniform", "zipf")
ZIPF_EXPONENT = 1.2  # expert popularity ~ 1 / rank^1.2


class MoeInputs(NamedTuple):
    hidden: torch.Tensor  # (T, D)
    w1: torch.Tensor  # (E, 2I, D)
    w2: torch.Tensor  # (E, D, I)
    topk_weight: torch.Tensor  # (T, topk) fp32
    topk_ids: torch.Tensor  # (T, topk) int32


def random_inputs(p: MoeProblem, gen: torch.Generator, routing: str = "uniform") -> MoeInputs:
    """Inputs of ``p`` on ``gen``'s device, drawn from ``gen``."""
    device = gen.device

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(p.dtype)

    hidden = randn(p.tokens, p.model_dim)
    w1 = randn(p.experts, 2 * p.inter_dim, p.model_dim, scale=p.model_dim ** -0.5)
    w2 = randn(p.experts, p.model_dim, p.inter_dim, scale=p.inter_dim ** -0.5)
    topk_ids = route(p, routing, gen)
    topk_weight = torch.rand(p.tokens, p.topk, generator=gen, device=device) + 0.1
    return MoeInputs(hidden, w1, w2, topk_weight, topk_ids)


def route(p: MoeProblem, routing: str, gen: torch.Generator) -> torch.Tensor:
    """(T, topk) int32 distinct experts per token: uniform, or Zipf-popular experts (the expert
    of popularity rank r drawn with weight 1 / r^ZIPF_EXPONENT, ranks a seeded permutation)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}: expected one of {', '.join(ROUTINGS)}")
    if routing == "uniform":
        scores = torch.rand(p.tokens, p.experts, generator=gen, device=gen.device)
        return scores.topk(p.topk, dim=1).indices.to(torch.int32)
    rank = torch.randperm(p.experts, generator=gen, device=gen.device) + 1
    popularity = rank.double() ** -ZIPF_EXPONENT
    picks = torch.multinomial(popularity.expand(p.tokens, -1), p.topk, replacement=False,
                              generator=gen)
    return picks.to(torch.int32)

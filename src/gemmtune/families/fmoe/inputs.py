"""Random inputs of a fused MoE, as the tuner and the bench make them: fresh values (never
zeros), weights scaled so that outputs stay O(1), and a seeded top-k routing, uniform or with a
few popular experts (``zipf``)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from gemmtune import quant
from gemmtune.kernels.problem import MoeProblem, MoeScales

ROUTINGS = ("uniform", "zipf")
ZIPF_EXPONENT = 1.2  # expert popularity ~ 1 / rank^1.2


class MoeInputs(NamedTuple):
    hidden: torch.Tensor  # (T, D)
    w1: torch.Tensor  # (E, 2I, D)
    w2: torch.Tensor  # (E, D, I)
    topk_weight: torch.Tensor  # (T, topk) fp32
    topk_ids: torch.Tensor  # (T, topk) int32


def random_inputs(p: MoeProblem, gen: torch.Generator, routing: str = "uniform",
                  global_experts: Optional[int] = None) -> MoeInputs:
    """Inputs of ``p`` on ``gen``'s device, drawn from ``gen``; tokens routed over
    ``global_experts`` (expert parallelism: more than ``p.experts``, the local ones, which are
    the first; at least one pair goes to them)."""
    device = gen.device

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(p.dtype)

    def experts(*shape, scale):  # one expert at a time: no fp32 copy of them all at once
        return torch.stack([randn(*shape, scale=scale) for _ in range(p.experts)])

    hidden = randn(p.tokens, p.model_dim)
    w1 = experts(2 * p.inter_dim, p.model_dim, scale=p.model_dim ** -0.5)
    w2 = experts(p.model_dim, p.inter_dim, scale=p.inter_dim ** -0.5)
    topk_ids = route(p, routing, gen, global_experts or p.experts)
    if global_experts and not bool((topk_ids < p.experts).any()):
        # Expert parallelism (this rank's experts the first ones): at decode a rank may get no
        # pair at all, which leaves nothing to time; give the first token's first slot one.
        topk_ids[0, 0] = 0
    topk_weight = torch.rand(p.tokens, p.topk, generator=gen, device=device) + 0.1
    return MoeInputs(hidden, w1, w2, topk_weight, topk_ids)


def route(p: MoeProblem, routing: str, gen: torch.Generator,
          experts: Optional[int] = None) -> torch.Tensor:
    """(T, topk) int32 distinct experts per token out of ``experts`` (default ``p.experts``):
    uniform, or Zipf-popular experts (the expert of popularity rank r drawn with weight
    1 / r^ZIPF_EXPONENT, ranks a seeded permutation)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing={routing!r}: expected one of {', '.join(ROUTINGS)}")
    experts = experts or p.experts
    if routing == "uniform":
        scores = torch.rand(p.tokens, experts, generator=gen, device=gen.device)
        return scores.topk(p.topk, dim=1).indices.to(torch.int32)
    rank = torch.randperm(experts, generator=gen, device=gen.device) + 1
    popularity = rank.double() ** -ZIPF_EXPONENT
    picks = torch.multinomial(popularity.expand(p.tokens, -1), p.topk, replacement=False,
                              generator=gen)
    return picks.to(torch.int32)


def rank_mask(experts: int, ep: int, device) -> Optional[torch.Tensor]:
    """``fused_moe``'s expert_mask of the expert-parallel rank ``random_inputs`` routes for: the
    first ``experts`` of ``experts * ep`` global ones (None without expert parallelism)."""
    if ep == 1:
        return None
    return torch.arange(experts * ep, device=device) < experts


class MoeCase(NamedTuple):
    """One call of a fused MoE backend, as the tuner and the bench make them: the arguments every
    backend takes (w1 and w2 FP8 with ``scales`` for quantised experts)."""

    hidden: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    topk_weight: torch.Tensor
    topk_ids: torch.Tensor
    expert_map: torch.Tensor
    problem: MoeProblem
    scales: Optional[MoeScales] = None

    def args(self, experts: Optional[tuple] = None) -> tuple:
        """The positional arguments, with ``experts`` (w1, w2) in place of the case's own (a
        rotating copy) if given."""
        w1, w2 = experts if experts is not None else (self.w1, self.w2)
        return (self.hidden, w1, w2, self.topk_weight, self.topk_ids, self.expert_map,
                self.problem)

    def kwargs(self) -> dict:
        """The keyword arguments: FP8 experts' scales."""
        return {} if self.scales is None else {"scales": self.scales}

    def run(self, kernel, experts: Optional[tuple] = None, out: Optional[torch.Tensor] = None):
        """``kernel`` on this case (``experts`` as in ``args``)."""
        return kernel(*self.args(experts), out=out, **self.kwargs())


def quantised_experts(w1: torch.Tensor, w2: torch.Tensor,
                      quant_type) -> tuple[torch.Tensor, torch.Tensor, MoeScales]:
    """(w1, w2) as FP8 experts of ``quant_type`` (``gemmtune.quant.quantize_experts``), with
    their scales; quantised one expert at a time (its fp32 temporaries stay small)."""
    def quantised(w):
        parts = [quant.quantize_experts(w[e:e + 1], quant_type) for e in range(w.shape[0])]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])

    (w1q, s1), (w2q, s2) = quantised(w1), quantised(w2)
    return w1q, w2q, MoeScales(s1, s2)

"""The router: which experts each token goes to, with what weight, and which of those
assignments an expert too full must drop.

- `score="softmax"` (Switch, Fedus et al. 2021; GShard, Lepikhin et al. 2020): the
  probabilities of a softmax over the experts; the chosen experts' probabilities are the
  combine weights, not renormalised (what Switch and GShard's top-2 do).
- `score="sigmoid"` (DeepSeek-V3, 2024, sec. 2.1.2): each expert's affinity a sigmoid of
  its own logit; the chosen experts' affinities, normalised to sum to 1, are the weights.

Capacity (`capacity_factor`): an expert takes at most ceil(factor x N x k / E) of the N
tokens' k assignments; first choices come first, then second choices, each in token order
(GShard's priority), and what overflows is dropped: that assignment adds nothing to the
token's output (its residual carries it on) and is counted. `None`: dropless, every
assignment kept.

Balancing:
- the auxiliary loss (Switch, eq. 4): E x sum_e f_e P_e, f_e the share of assignments
  expert e received, P_e the mean probability the router gave it; smallest when both are
  uniform. Its gradient reaches the router through P_e.
- the router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): mean of logsumexp(logits)^2; keeps
  the logits small.
- auxiliary-loss-free (DeepSeek-V3 sec. 2.1.2, Wang et al. 2024): a bias per expert,
  added to the scores only to choose experts (the weights use the unbiased scores), moved
  by `bias_rate` after each optimizer step: up for an expert that received fewer tokens
  than the mean, down for one that received more. The counts are summed over every
  forward since the last update (`tokens_seen`), so k accumulated microbatches move it
  as one batch of the same tokens does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

Score = Literal["softmax", "sigmoid"]
SCORES: tuple[str, ...] = ("softmax", "sigmoid")


@dataclass
class Routing:
    """One forward's routing of N tokens to k experts each."""

    experts: torch.Tensor  # (N, k) int64: the chosen experts, first choice first
    weights: torch.Tensor  # (N, k): combine weights, 0 where dropped (autograd to the router)
    kept: torch.Tensor  # (N, k) bool: False where the expert was already full
    counts: torch.Tensor  # (E,) int64: assignments each expert was chosen for (before drops)
    aux_loss: torch.Tensor  # () Switch's load-balancing loss
    z_loss: torch.Tensor  # () the router z-loss

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())


def capacity(tokens: int, experts: int, top_k: int, factor: float | None) -> int | None:
    """The most assignments one expert takes: ceil(factor x tokens x top_k / experts)
    (None: no limit)."""
    if factor is None:
        return None
    return math.ceil(factor * tokens * top_k / experts)


def keep_within(experts: torch.Tensor, n_experts: int, limit: int | None) -> torch.Tensor:
    """(N, k) bool: which assignments fit their expert's `limit`, first choices before
    second ones, each in token order (GShard's priority)."""
    if limit is None:
        return torch.ones_like(experts, dtype=torch.bool)
    by_choice = experts.t().reshape(-1)  # (k N): all first choices, then all second ones
    one_hot = nn.functional.one_hot(by_choice, n_experts)  # (k N, E)
    place = (one_hot.cumsum(0) * one_hot).sum(1) - 1  # each assignment's place in its queue
    return (place < limit).view(experts.shape[1], -1).t()


class Router(nn.Module):
    """Scores tokens (N, C) against `experts` and routes each to its `top_k`; see the
    module's docstring for `score`, `capacity_factor` and `bias_rate`."""

    bias: torch.Tensor  # (E,) buffers, registered in __init__
    tokens_seen: torch.Tensor  # (E,)

    def __init__(
        self,
        d_model: int,
        experts: int,
        top_k: int = 2,
        score: Score = "softmax",
        capacity_factor: float | None = None,
        bias_rate: float = 0.0,
    ) -> None:
        super().__init__()
        check_routing(experts, top_k, score, capacity_factor, bias_rate)
        self.experts, self.top_k, self.score = experts, top_k, score
        self.capacity_factor, self.bias_rate = capacity_factor, bias_rate
        self.gate = nn.Linear(d_model, experts, bias=False)
        self.register_buffer("bias", torch.zeros(experts))  # chooses, never weighs
        self.register_buffer(
            "tokens_seen", torch.zeros(experts, dtype=torch.int64), persistent=False
        )

    def forward(self, x: torch.Tensor) -> Routing:  # x: (N, C)
        logits = self.gate(x)  # (N, E), the router in fp32 at least: a bf16 or fp16
        if logits.dtype in (torch.float16, torch.bfloat16):  # model's ties and rounding
            logits = logits.float()  # would pick its experts; fp64 stays fp64
        if self.score == "softmax":
            scores = probs = logits.softmax(-1)
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(-1, keepdim=True)
        chosen = (scores.detach() + self.bias).topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, chosen)
        if self.score == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.experts)
        if self.training and self.bias_rate:
            self.tokens_seen += counts.to(self.tokens_seen.device)
        kept = keep_within(
            chosen,
            self.experts,
            capacity(x.shape[0], self.experts, self.top_k, self.capacity_factor),
        )
        share = counts.to(probs.dtype) / chosen.numel()  # f_e
        aux = self.experts * (share * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        return Routing(chosen, weights * kept, kept, counts, aux, z)

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor | None = None) -> None:
        """Auxiliary-loss-free balancing's step: bias += rate x sign(mean - count), from
        `counts` (default: the tokens seen since the last update, then forgotten)."""
        counts = self.tokens_seen if counts is None else counts
        load = counts.to(self.bias.dtype)
        self.bias += self.bias_rate * torch.sign(load.mean() - load)
        self.tokens_seen.zero_()


def check_routing(
    experts: int, top_k: int, score: str, capacity_factor: float | None, bias_rate: float
) -> None:
    """One line for each setting a router cannot take."""
    if experts < 1:
        raise ValueError(f"experts must be >= 1, got {experts}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be between 1 and the {experts} experts, got {top_k}")
    if score not in SCORES:
        raise ValueError(f"unknown router score {score!r}; choose one of {', '.join(SCORES)}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None: dropless), got {capacity_factor}")
    if bias_rate < 0:
        raise ValueError(f"bias_rate must be >= 0, got {bias_rate}")

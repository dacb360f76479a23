"""A mixture-of-experts MLP: a router and E expert MLPs, each token through its top k.

The experts' weights are stacked, expert first: `up_weight` (E, C, H), `up_bias` (E, H),
`down_weight` (E, H, C), `down_bias` (E, C), so that a rank of an expert-parallel group
keeps a slice of them (`expert_parallel`) and a batched product runs them all at once.

Three ways to run the same layer, tested equal:
- `mode="loop"`: the readable one: for each expert, the tokens routed to it, its MLP, the
  outputs added back, weighted.
- `mode="batched"`: the assignments sorted by expert (`permute`), padded to the busiest
  expert's count and run as one batched matrix product per Linear (`torch.bmm`), then put
  back (`unpermute`).
- expert parallel (`expert_parallel` sets `comm`): the sorted assignments dispatched to the
  rank holding their expert by an all-to-all, run there batched, combined back by the
  inverse all-to-all (parallel.py).

The balancing losses: `aux_loss` x Switch's loss + `z_loss` x the router z-loss are added
to whatever loss the training computes, through their gradient: the layer's output is
passed through `AddAuxLoss`, which adds their gradient in backward (Megatron-LM's
MoEAuxLossAutoScaler), so a pipeline's middle stage or any training loop trains them
without carrying a second loss. `aux_scale` weighs them like the training's own loss is
weighed (1/k for a loss averaged over k microbatches; the 3D step sets it). `last` keeps
the last forward's routing (counts, drops, the two losses' values) for plots and logs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from parcourse.experts.routing import Router, Routing, Score

Mode = Literal["loop", "batched"]
MODES: tuple[str, ...] = ("loop", "batched")


@dataclass
class Sorted:
    """N tokens' kept assignments, sorted by expert (stable: token order within one)."""

    tokens: torch.Tensor  # (A,) the token each sorted assignment belongs to
    slots: torch.Tensor  # (A,) its place in that token's top k
    counts: list[int]  # assignments per expert, E of them


def permute(routing: Routing, n_experts: int) -> Sorted:
    """The kept assignments in expert order: what a dispatch sends, expert by expert."""
    tokens, slots = routing.kept.nonzero(as_tuple=True)  # token-major
    experts = routing.experts[tokens, slots]
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=n_experts).tolist()
    return Sorted(tokens[order], slots[order], counts)


def unpermute(y: torch.Tensor, sort: Sorted, routing: Routing, n_tokens: int) -> torch.Tensor:
    """Each sorted assignment's output (A, C), weighted and added to its token's (N, C)."""
    weights = routing.weights[sort.tokens, sort.slots].to(y.dtype)
    out = y.new_zeros(n_tokens, y.shape[-1])
    return out.index_add(0, sort.tokens, y * weights[:, None])


class AddAuxLoss(torch.autograd.Function):
    """Forward: `out` unchanged. Backward: `out`'s gradient, and `scale` as the gradient of
    `loss` (so loss x scale is trained as if it were part of the objective)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.like = scale, loss
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, torch.full_like(ctx.like, ctx.scale), None


class MoE(nn.Module):
    """A router and `experts` MLPs (C -> `hidden` -> C, GELU), each token through its
    `top_k`. Input (B, T, C) or (N, C); output the same shape."""

    def __init__(
        self,
        d_model: int,
        experts: int,
        top_k: int = 2,
        hidden: int | None = None,
        score: Score = "softmax",
        capacity_factor: float | None = None,
        aux_loss: float = 0.0,
        z_loss: float = 0.0,
        bias_rate: float = 0.0,
        mode: Mode = "batched",
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if aux_loss < 0 or z_loss < 0:
            raise ValueError(f"aux_loss and z_loss must be >= 0, got {aux_loss}, {z_loss}")
        hidden = 4 * d_model if hidden is None else hidden
        self.router = Router(d_model, experts, top_k, score, capacity_factor, bias_rate)
        self.experts, self.mode = experts, mode
        self.aux_coef, self.z_coef, self.aux_scale = aux_loss, z_loss, 1.0
        self.up_weight = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.up_bias = nn.Parameter(torch.zeros(experts, hidden))
        self.down_weight = nn.Parameter(torch.empty(experts, hidden, d_model))
        self.down_bias = nn.Parameter(torch.zeros(experts, d_model))
        for w in (self.up_weight, self.down_weight):
            nn.init.normal_(w, std=0.02)
        # expert parallel (parallel.py sets both): the ep group's Comm, and the forward
        # that dispatches to it (given, not imported: the layer knows no distribution)
        self.comm: Any = None
        self.run_parallel: Callable[[MoE, torch.Tensor, Routing], torch.Tensor] | None = None
        self.first = 0  # the first expert this module holds
        self.last: Routing | None = None

    @property
    def local_experts(self) -> int:
        return self.up_weight.shape[0]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP (e counted among the experts this module holds) on x (n, C)."""
        h = F.gelu(x @ self.up_weight[e] + self.up_bias[e])  # (n, H)
        return h @ self.down_weight[e] + self.down_bias[e]  # (n, C)

    def experts_batched(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every held expert on its rows of x (sorted by expert, `counts` each): padded
        to the busiest expert's count, one `bmm` per Linear."""
        E, most = len(counts), max(counts, default=0)
        if most == 0:  # no row here: still through autograd (x), so that every rank of an
            return self.expert(0, x)  # ep group runs the all-to-alls' backward alike
        at = torch.repeat_interleave(
            torch.arange(E, device=x.device), torch.tensor(counts, device=x.device)
        )
        starts = torch.tensor([0, *counts[:-1]], device=x.device).cumsum(0)
        row = torch.arange(x.shape[0], device=x.device) - starts[at]  # place within expert
        padded = x.new_zeros(E, most, x.shape[-1])
        padded = padded.index_put((at, row), x)  # (E, M, C)
        h = F.gelu(torch.bmm(padded, self.up_weight) + self.up_bias[:, None])  # (E, M, H)
        y = torch.bmm(h, self.down_weight) + self.down_bias[:, None]  # (E, M, C)
        return y[at, row]  # (A, C), the sorted order again

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.device.type == "meta":  # a pipeline asking for the output's shape only
            return torch.empty_like(x)
        flat = x.reshape(-1, shape[-1])  # (N, C)
        routing = self.router(flat)
        self.last = routing
        if self.run_parallel is not None:
            out = self.run_parallel(self, flat, routing)
        elif self.mode == "loop":
            out = self._loop(flat, routing)
        else:
            sort = permute(routing, self.experts)
            out = unpermute(
                self.experts_batched(flat[sort.tokens], sort.counts), sort, routing, flat.shape[0]
            )
        loss = self.aux_coef * routing.aux_loss + self.z_coef * routing.z_loss
        if torch.is_grad_enabled() and (self.aux_coef or self.z_coef):
            out = AddAuxLoss.apply(out, loss, self.aux_scale)
        return out.view(shape)

    def _loop(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The readable version: each expert, the tokens it kept, its MLP, added back."""
        out = torch.zeros_like(flat)
        for e in range(self.experts):
            tokens, slots = ((routing.experts == e) & routing.kept).nonzero(as_tuple=True)
            if len(tokens):
                y = self.expert(e, flat[tokens])  # (n, C)
                out = out.index_add(0, tokens, y * routing.weights[tokens, slots, None])
        return out


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE layer of `model`, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


EXPERT_NAMES = ("up_weight", "up_bias", "down_weight", "down_bias")


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The experts' own weights (what expert parallelism shards): every MoE's stacked
    `up_*` and `down_*`; the router and the rest of the model are not."""
    return [getattr(m, n) for m in moe_layers(model) for n in EXPERT_NAMES]


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """Weigh every MoE layer's balancing losses by `scale` (1/k for a loss averaged over
    k microbatches, as the training's own loss is)."""
    for m in moe_layers(model):
        m.aux_scale = scale


@torch.no_grad()
def update_bias(model: nn.Module, comm: Any = None) -> None:
    """Auxiliary-loss-free balancing's step for every router: the tokens each expert was
    chosen for since the last update, summed over `comm`'s ranks (every data-parallel
    replica then moves its bias alike), before the optimizer's step."""
    for m in moe_layers(model):
        if not m.router.bias_rate:
            continue
        counts = m.router.tokens_seen.clone()
        if comm is not None and comm.size > 1:
            counts = comm.all_reduce(counts.to(torch.float64)).to(torch.int64)
        m.router.update_bias(counts)

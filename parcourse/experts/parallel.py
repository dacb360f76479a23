"""Expert parallelism: the experts of each MoE layer cut over an `ep` group, every token's
assignments sent to the rank holding their expert and the outputs sent back.

A layer's forward on a rank of the ep group (GShard's dispatch and combine, Lepikhin et al.
2020; Megatron-LM's token dispatcher):
1. route this rank's tokens (its own router, its own tokens: as one process would);
2. sort the kept assignments by expert (`permute`); rank r holds experts r E/P to
   (r + 1) E/P - 1, so the sorted rows are already grouped by destination;
3. exchange counts: each rank tells each other how many rows it will send for each of its
   experts (an all-to-all of E/P integers a peer), so every receiver knows its split sizes;
4. dispatch: the rows by an all-to-all with those variable sizes;
5. regroup what arrived (source by source) expert by expert, run the held experts batched,
   and put the outputs back in arrival order;
6. combine: the inverse all-to-all, and each output weighted and added to its token.
Backward runs the same way back: a dispatch's backward is a combine, a combine's a
dispatch (`AllToAll`).

Which ranks: ep folds into the data-parallel ranks (Megatron-LM's "parallel folding",
DeepSeek-V3's ep inside its dp): an ep group is ep consecutive data-parallel ranks, each with
its own tokens. Every rank then runs the whole model but 1/ep of each MoE layer's experts;
no rank idles for want of tokens, and the dense layers stay replicated as before. An expert's
copies live on the dp / ep ranks that hold the same place in their ep groups (the
expert-data-parallel group): its gradient is summed over them, the rest over all dp.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm import AllToAll, Comm, all_to_all
from parcourse.experts.layer import MoE, expert_parameters, moe_layers, permute, unpermute
from parcourse.trace import SpanKind
from parcourse.trace_backward import BackwardSpan

if TYPE_CHECKING:
    from parcourse.experts.routing import Routing


def expert_parallel(model: nn.Module, comm: Comm) -> nn.Module:
    """Cut every MoE layer's experts over `comm`'s ranks: rank r keeps experts r E/P to
    (r + 1) E/P - 1 (a slice of the stacked weights, the model built the same on every
    rank); the router and the dense layers stay whole. Returns the model, changed in
    place."""
    layers = moe_layers(model)
    if not layers:
        raise ValueError("expert_parallel: the model has no MoE layer (GPTConfig(experts=...))")
    for m in layers:
        check_ep(m.experts, comm.size)
        if m.comm is not None:
            raise ValueError("expert_parallel: this model's experts are already cut")
        held = m.experts // comm.size
        m.first = comm.rank * held
        for name in ("up_weight", "up_bias", "down_weight", "down_bias"):
            whole = getattr(m, name)
            setattr(m, name, nn.Parameter(whole.detach()[m.first : m.first + held].clone()))
        m.comm, m.run_parallel = comm, run_expert_parallel
    return model


def check_ep(experts: int, ep: int) -> None:
    """One line (ValueError) for an ep that cannot cut `experts` experts evenly."""
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    if experts % ep:
        raise ValueError(
            f"{experts} experts do not divide by ep {ep}: every rank of the ep "
            "group holds the same number of experts"
        )


def run_expert_parallel(m: MoE, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The layer's experts on `flat` (N, C) routed by `routing`, over `m.comm`."""
    comm, held = m.comm, m.local_experts
    size = comm.size
    sort = permute(routing, m.experts)  # every expert's rows, in expert (so rank) order
    sends = [sum(sort.counts[r * held : (r + 1) * held]) for r in range(size)]
    counts = torch.tensor(sort.counts, dtype=torch.int64, device=flat.device)
    with _traced(comm, "counts", "comm", op="all-to-all", group=comm.ranks, label="counts"):
        arriving = all_to_all(comm, counts, [held] * size, [held] * size).view(size, held).cpu()
    receives = arriving.sum(1).tolist()  # rows from each source
    got = AllToAll.apply(flat[sort.tokens], comm, sends, receives, "dispatch")  # by source
    order = _expert_major(arriving)
    # the experts' compute on a timeline, forward and (autograd's, later) backward
    grads = BackwardSpan(comm.tracer, "backward: experts", label="experts")
    (got,) = grads.enter(got)
    with _traced(comm, "forward: experts", "compute", label="experts"):
        y = grads.leave(m.experts_batched(got[order], arriving.sum(0).tolist()))
    back = torch.empty_like(order).scatter_(0, order, torch.arange(len(order)))
    out = AllToAll.apply(y[back], comm, receives, sends, "combine")  # each row home, sorted
    return unpermute(out, sort, routing, flat.shape[0])


def _traced(comm: Comm, name: str, kind: SpanKind, **meta: Any) -> AbstractContextManager[Any]:
    """A span on `comm`'s tracer, or nothing without one."""
    return comm.tracer.span(name, kind, **meta) if comm.tracer is not None else nullcontext()


def _expert_major(arriving: torch.Tensor) -> torch.Tensor:
    """Rows that arrived source by source (each source's sorted by expert, `arriving[s, e]`
    of them) -> their order expert by expert (sources in rank order within one)."""
    size, held = arriving.shape
    start = torch.cat([torch.zeros(1, dtype=torch.int64), arriving.flatten().cumsum(0)[:-1]])
    start = start.view(size, held)
    parts = [
        torch.arange(int(start[s, e]), int(start[s, e] + arriving[s, e]))
        for e in range(held)
        for s in range(size)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def expert_groups(
    ep: int, group: dist.ProcessGroup | None = None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's ep group (ep consecutive ranks of `group`) and its expert-data-parallel
    group (the ranks holding the same experts: one in each ep group). Every rank of
    `group` must call it (new_group is collective), with the same ep."""
    size = dist.get_world_size(group)
    if ep < 1 or size % ep:
        raise ValueError(f"ep {ep} does not divide the {size} data-parallel ranks")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    me = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for first in range(0, size, ep):
        members = ranks[first : first + ep]
        made = dist.new_group(members)
        if me in members:
            mine["ep"] = made
    for place in range(ep):
        members = ranks[place::ep]
        made = dist.new_group(members)
        if me in members:
            mine["edp"] = made
    return mine["ep"], mine["edp"]


def reduce_gradients(model: nn.Module, data: Comm, experts: Comm | None = None) -> None:
    """Data parallelism with experts cut over ep: the dense parameters' gradients averaged
    over the `data` ranks (every replica's loss a mean over its own tokens); each expert's
    gradient, which already holds every token of its ep group that chose it, summed over
    the `experts` ranks (its copies in the other ep groups; None: ep = dp, no copies) and
    divided by the data-parallel size, so that it is the same average."""
    held = {id(p) for p in expert_parameters(model)}
    for p in model.parameters():
        if id(p) not in held:
            if p.grad is not None:
                data.all_reduce(p.grad, "avg")
            continue
        if p.grad is None:  # no token chose these experts here: the others still reduce
            p.grad = torch.zeros_like(p)
        if experts is not None and experts.size > 1:
            experts.all_reduce(p.grad, "sum")
        p.grad.div_(data.size)

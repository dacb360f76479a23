"""What lesson 11's second part (experts) runs: a router's choices token by token, the
dispatch exercise, the expert-parallel layer measured beside one process and the theory's
bytes, the tokens each expert receives over training under each balancing method, and the
GPT trained with its experts cut over ep."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parcourse.comm import Comm
from parcourse.experiments.exercises import ask, whole_numbers
from parcourse.experts import MoE, expert_parallel, moe_layers, permute, update_bias
from parcourse.launch import RankContext
from parcourse.models import GPTConfig, gpt

DispatchFn = Callable[[list[list[int]], int, int], Any]


def routing_example(tokens: int = 12, experts: int = 8, top_k: int = 2,
                    score: str = "softmax", capacity_factor: float | None = None,
                    seed: int = 0) -> dict[str, Any]:
    """One MoE layer's routing of `tokens` random tokens: each token's experts, weights
    and which were kept (a capacity drops the rest), and the assignments per expert."""
    torch.manual_seed(seed)
    layer = MoE(16, experts, top_k, score=score,  # type: ignore[arg-type]
                capacity_factor=capacity_factor)
    with torch.no_grad():
        layer(torch.randn(tokens, 16))
    r = layer.last
    assert r is not None
    return {"experts": r.experts.tolist(), "weights": r.weights.tolist(),
            "kept": r.kept.tolist(), "counts": r.counts.tolist(), "dropped": r.dropped}


def dispatch_plan(chosen: list[list[int]], experts: int, ranks: int
                  ) -> tuple[list[int], list[int]]:
    """The solution of the exercise: for tokens' chosen experts (`chosen[t]`: token t's k
    experts), the rows sent to each rank (rank r holds experts r E/P to (r + 1) E/P - 1)
    and the order of the assignments (t k + slot) sorted by expert, token order within one
    expert: what `permute` computes."""
    k = len(chosen[0]) if chosen else 0
    flat = [(e, t * k + s) for t, row in enumerate(chosen) for s, e in enumerate(row)]
    order = [i for _, i in sorted(flat, key=lambda pair: pair[0])]  # stable: token order
    held = experts // ranks
    counts = [sum(1 for e, _ in flat if e // held == r) for r in range(ranks)]
    return counts, order


def check_dispatch(fn: DispatchFn) -> bool:
    """Lesson 11's second exercise: `fn(chosen, experts, ranks)` returns (the rows each
    rank receives, the assignments in dispatch order) for a routing. Checked on a small
    routing the lesson prints and on a larger random one; prints one short verdict, naming
    the mistake when it is a common one."""
    g = torch.Generator().manual_seed(3)
    cases = [([[2, 0], [1, 2], [3, 0], [0, 3], [2, 1]], 4, 2),
             (torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(16)]).tolist(),
              8, 4)]
    for chosen, experts, ranks in cases:
        ok, got = ask(fn, [list(row) for row in chosen], experts, ranks)
        if not ok:
            return False
        want_counts, want_order = dispatch_plan(chosen, experts, ranks)
        if not (isinstance(got, tuple | list) and len(got) == 2):
            print(f"Not yet: return two lists, (rows per rank, order); got "
                  f"{type(got).__name__}." + (" Hint: a missing `return`?" if got is None
                                              else ""))
            return False
        counts, order = (whole_numbers(x) for x in got)
        if counts is None or order is None:
            print("Not yet: both parts should be lists of whole numbers (rows per rank, and "
                  "the assignments' numbers t x k + slot).")
            return False
        per_expert = [sum(row.count(e) for row in chosen) for e in range(experts)]
        if counts != want_counts:
            if counts == per_expert:
                hint = (f"those are rows per expert; a rank holds {experts // ranks} experts: "
                        "add up the counts of the experts each rank holds")
            elif sum(counts) != sum(want_counts):
                hint = (f"every token sends one row per chosen expert: {sum(want_counts)} "
                        f"rows in all, your counts add up to {sum(counts)}")
            elif counts == want_counts[::-1]:
                hint = "the ranks are reversed: rank 0 holds the first experts"
            else:
                hint = f"rank r holds experts r x {experts // ranks} to (r + 1) x " \
                       f"{experts // ranks} - 1"
            print(f"Not yet (rows per rank): {hint}. Expected {want_counts}, got {counts}.")
            return False
        if order != want_order:
            flat = [e for row in chosen for e in row]
            if order == list(range(len(flat))):
                hint = "that is the routing's own order: sort the assignments by expert"
            elif sorted(order) != list(range(len(flat))):
                hint = (f"the order should name each assignment (t x k + slot, 0 to "
                        f"{len(flat) - 1}) once")
            elif [flat[i] for i in order] == sorted(flat):
                hint = ("sorted by expert, but within one expert keep the token order (a "
                        "stable sort): the receiver's rows must match the combine's")
            else:
                hint = "sort the assignment numbers by their expert, ties by token"
            print(f"Not yet (order): {hint}.")
            return False
    print("Correct: the rows each rank receives, and the order they leave in, grouped by "
          "expert (so by rank) with the tokens in order within each.")
    return True


def ep_layer(ctx: RankContext, tokens: int = 64, experts: int = 8, top_k: int = 2,
             capacity_factor: float | None = None, score: str = "softmax",
             width: int = 32) -> dict[str, Any]:
    """One forward and backward of an MoE layer with its experts cut over these ranks,
    every message through a traced `Comm` (dispatch, experts, combine on the timeline),
    beside the whole layer in this process on this rank's tokens: the largest difference
    (output, input gradient), the bytes sent forward and backward, the tokens each expert
    received here, the assignments dropped."""
    if experts % ctx.world_size:
        raise ValueError(f"{experts} experts do not divide by {ctx.world_size} ranks")

    def layer() -> MoE:
        torch.manual_seed(0)
        return MoE(width, experts, top_k, score=score,  # type: ignore[arg-type]
                   capacity_factor=capacity_factor)

    g = torch.Generator().manual_seed(ctx.rank)
    x, up = torch.randn(tokens, width, generator=g), torch.randn(tokens, width, generator=g)
    whole = layer()
    ref_x = x.clone().requires_grad_()
    ref = whole(ref_x)
    ref.backward(up)
    comm = Comm(ctx.group, tracer=ctx.tracer, algorithm="auto")
    mine = expert_parallel(layer(), comm)
    counted = len(ctx.tracer.data().counters)
    ctx.tracer.set_status(f"{tokens} tokens to {experts} experts")
    dist.barrier(group=ctx.group)
    here = x.clone().requires_grad_()
    out = mine(here)
    sent = sum(c.value for c in ctx.tracer.data().counters[counted:] if c.name == "bytes_sent")
    out.backward(up)
    every = sum(c.value for c in ctx.tracer.data().counters[counted:]
                if c.name == "bytes_sent")
    routing = mine.last
    assert routing is not None and here.grad is not None and ref_x.grad is not None
    sort = permute(routing, experts)
    return {"error": float(max((out - ref).detach().abs().max(),
                               (here.grad - ref_x.grad).abs().max())),
            "forward": sent, "backward": every - sent, "counts": sort.counts,
            "dropped": routing.dropped, "held": list(range(mine.first,
                                                           mine.first + mine.local_experts))}


def imbalance(method: str = "none", steps: int = 60, experts: int = 8,
              seed: int = 0) -> list[list[int]]:
    """A small GPT with `experts` experts (top 2) trained `steps` steps in one process on
    the course's counting sequences, balanced by `method` ("none", "aux loss" or "bias"):
    the tokens each expert received at each step (every block's router, summed)."""
    settings = {"none": {"aux_loss": 0.0}, "aux loss": {"aux_loss": 0.05},
                "bias": {"aux_loss": 0.0, "bias_rate": 0.01}}
    if method not in settings:
        raise ValueError(f"unknown balancing {method!r}; choose one of "
                         f"{', '.join(settings)}")
    from parcourse.data import progressions

    config = GPTConfig(vocab=64, block_size=16, n_layers=2, n_heads=4, d_model=32,
                       experts=experts, top_k=2, **settings[method])  # type: ignore[arg-type]
    model = gpt(config, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = progressions(32, config.block_size, config.vocab)
    per_step = []
    for _ in range(steps):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        update_bias(model)
        opt.step()
        opt.zero_grad()
        per_step.append([sum(int(m.last.counts[e]) for m in moe_layers(model)  # type: ignore[union-attr]
                             ) for e in range(experts)])
    return per_step


def ep_training(ctx: RankContext, experts: int = 4, steps: int = 3) -> dict[str, Any]:
    """The course's GPT with `experts` experts in every block trained `steps` Adam steps on
    a mesh of ep = world size (`Hybrid`: each rank its rows and 1/ep of the experts), and
    the same microbatches in one process: both runs' losses and the largest difference of
    their weights."""
    from parcourse.data import progressions
    from parcourse.experts import set_aux_scale
    from parcourse.hybrid import Hybrid
    from parcourse.mesh import Mesh

    config = GPTConfig(vocab=64, block_size=16, n_layers=2, n_heads=4, d_model=32,
                       experts=experts, top_k=2)
    model = Hybrid(gpt(config), Mesh({"ep": ctx.world_size}, ctx.group), microbatches=1,
                   optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2))
    one = gpt(config)
    set_aux_scale(one, 1 / ctx.world_size)
    opt = torch.optim.Adam(one.parameters(), lr=1e-2)
    x, y = progressions(4 * ctx.world_size, config.block_size, config.vocab)  # 4 rows a rank
    ours, theirs = [], []
    for step in range(steps):
        ctx.tracer.set_status(f"step {step + 1} of {steps}")
        ours.append(model.step(x, y))
        loss = sum(F.cross_entropy(one(a).flatten(0, 1), b.flatten()) / ctx.world_size
                   for a, b in zip(x.chunk(ctx.world_size), y.chunk(ctx.world_size)))
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        theirs.append(loss.item())  # type: ignore[union-attr]
    whole = model.full_state_dict()
    diff = max(float((whole[k] - v).abs().max()) for k, v in one.state_dict().items())
    return {"losses": ours, "one_process": theirs, "weights_diff": diff,
            "memory": model.memory()}

"""Lesson 05's own runs: a matrix multiply split both ways, Megatron's MLP, shapes and
memory by TP size, traced steps over a simulated link, and the exercise's check
(Megatron's g)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parcourse.comm import Comm, SimulatedLink
from parcourse.experiments.exercises import run_exercise
from parcourse.experiments.tensor_parallel.training import (
    batch_for,
    collectives_in,
    shared_comm,
    theory_for,
)
from parcourse.launch import Pool, RankContext
from parcourse.memory import SavedActivations, live_bytes
from parcourse.models import MLP, TINY, GPTConfig, gpt
from parcourse.tensor_parallel import (
    GPT_PLAN,
    MLP_PLAN,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from parcourse.tensor_parallel.comm import TPComm
from parcourse.theory import (
    tp_activation_bytes,
    tp_parameter_bytes,
)
from parcourse.trace import Span, Tracer

# --------------------------------------------------------------------------- lesson 05


def split_matmul(
    ctx: RankContext,
    how: Literal["column", "row"],
    tokens: int = 4,
    features: int | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Y = X A on the ranks, with A (features x features) split by columns or by rows
    as `ColumnParallelLinear` and `RowParallelLinear` split it (nn.Linear keeps A
    transposed, as its weight). `features`: 12 when the ranks divide it, else 3 per rank.

    Returns what this rank holds and computes, in X A's orientation: "x" (its input: all
    of X by columns; its columns of X by rows), "a" (its shard of A), "mine" (X_r A_r:
    some columns of Y by columns; a partial sum of all of Y by rows), "y" (after the
    layer's collective: all-gather by columns, all-reduce by rows) and "expected" (X A
    in one process).
    """
    n = ctx.world_size
    features = features or (12 if 12 % n == 0 else 3 * n)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (tokens, features), generator=g).float()  # small integers
    linear = nn.Linear(features, features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randint(-2, 3, (features, features), generator=g))
    comm = TPComm(Comm(ctx.group, tracer=ctx.tracer))
    layer: nn.Module
    if how == "column":
        layer = ColumnParallelLinear(linear, comm, gather_output=True)
        mine_x = x
    elif how == "row":
        layer = RowParallelLinear(linear, comm, input_is_parallel=False)
        mine_x = x.chunk(n, dim=-1)[ctx.rank]
    else:
        raise ValueError(f"unknown split {how!r}; choose 'column' or 'row'")
    a = layer.weight.detach().T  # (in, out / N) by columns, (in / N, out) by rows
    with torch.no_grad():
        return {"x": mine_x, "a": a, "mine": mine_x @ a, "y": layer(x), "expected": linear(x)}


def split_mlp(
    ctx: RankContext, d_model: int = 24, tokens: int = 6, seed: int = 0
) -> dict[str, Any]:
    """Megatron's MLP (up column-parallel, GELU, down row-parallel) on the ranks against
    one process: its collectives, forward and backward, in order, and the largest
    difference of the output and of the input's gradient."""
    config = GPTConfig(d_model=d_model, n_heads=1)
    reference = _seeded(lambda: MLP(config), seed)
    split = apply_tensor_parallel(
        _seeded(lambda: MLP(config), seed), MLP_PLAN, ctx.group, tracer=ctx.tracer
    )
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, tokens, d_model, generator=g)
    upstream = torch.randn(1, tokens, d_model, generator=g)  # d loss / d output
    outputs: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for model in (reference, split):
        leaf = x.clone().requires_grad_()
        y = model(leaf)
        (y * upstream).sum().backward()
        assert leaf.grad is not None  # a leaf that requires grad, and y depends on it
        outputs.append(y.detach())
        grads.append(leaf.grad)
    events = [e for e in ctx.tracer.data().counters if e.name == "tp_collective"]
    return {
        "collectives": [(e.meta["op"], e.meta["phase"], e.meta["where"]) for e in events],
        "output_error": float((outputs[0] - outputs[1]).abs().max()),
        "grad_error": float((grads[0] - grads[1]).abs().max()),
    }


def _seeded(make: Any, seed: int) -> Any:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def split_shapes(
    ctx: RankContext, config: GPTConfig = TINY, sequence_parallel: bool = False
) -> list[tuple[str, tuple[int, ...], tuple[int, ...], str]]:
    """Every parameter of the GPT once split by GPT_PLAN: (name, whole shape, shape on
    this rank, style: column, row, vocab or replicate)."""
    whole = {name: tuple(p.shape) for name, p in gpt(config).named_parameters()}
    model = apply_tensor_parallel(
        gpt(config), GPT_PLAN, ctx.group, sequence_parallel=sequence_parallel
    )
    styles = {
        ColumnParallelLinear: "column",
        RowParallelLinear: "row",
        VocabParallelEmbedding: "vocab",
    }
    out = []
    for module_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False, prefix=module_name):
            if p_name not in whole:
                continue
            style = styles.get(type(module), "replicate")
            if isinstance(module, ColumnParallelLinear) and module.vocab:
                style = "vocab"
            if isinstance(module, RowParallelLinear) and p_name.endswith("bias"):
                style = "replicate"  # added once, after the sum
            out.append((p_name, whole.pop(p_name), tuple(p.shape), style))
    return out


def memory_by_tp_size(
    ctx: RankContext, config: GPTConfig = TINY, batch: int = 8, sizes: Iterable[int] | None = None
) -> dict[tuple[int, bool], Any]:
    """Parameter bytes and bytes kept for backward (one forward to the logits) on this rank
    for each tensor-parallel size in `sizes` (default: every size up to the world size
    that divides the heads and the sequence, as tensor and sequence parallelism need),
    without and with sequence parallelism, beside the formulas. TP size k runs on ranks
    0 .. k-1 (a group of their own); the other ranks sit it out.

    Returns {(k, sequence_parallel): {"param_bytes", "activation_bytes", "theory": {...}}}
    on the ranks that took part in each.
    """
    sizes = list(
        sizes
        or (
            k
            for k in range(1, ctx.world_size + 1)
            if config.n_heads % k == 0 and config.block_size % k == 0
        )
    )
    out: dict[tuple[int, bool], Any] = {}
    x, _ = batch_for(0, batch, config)
    made = []  # groups of ranks 0 .. k-1 this rank is in, destroyed at the end: a pool's
    # ranks live on between runs, and a gloo group keeps its threads and sockets until then
    for k in sizes:
        # Every rank creates every group (torch.distributed asks it), members or not.
        group = ctx.group if k == ctx.world_size else dist.new_group(list(range(k)))
        if ctx.rank >= k:
            continue
        if group is not ctx.group:
            made.append(group)
        for sp in (False, True):
            model = apply_tensor_parallel(gpt(config), GPT_PLAN, group, sequence_parallel=sp)
            acts = SavedActivations()
            with acts:
                logits = model(x)  # noqa: F841 - alive while its saved tensors are counted
            measured = live_bytes(model, activations=acts)
            out[k, sp] = {
                "param_bytes": measured["params"],
                "activation_bytes": measured["activations"],
                "theory": {
                    "param_bytes": tp_parameter_bytes(config, k)["total"],
                    "activation_bytes": tp_activation_bytes(
                        config, batch, config.block_size, k, sp
                    )["total"],
                },
            }
    dist.barrier(group=ctx.group)  # every rank done with every group before any goes
    for group in made:
        dist.destroy_process_group(group)
    return out


def label_of(where: str, model: nn.Module) -> str:
    """What a collective is, from where it ran: "f" before a column-parallel layer (and
    the head), "g" after a row-parallel one (and the vocab-parallel embedding), "loss"
    (the vocab-parallel cross-entropy), "grads" (replicated gradients summed under
    sequence parallelism)."""
    module = dict(model.named_modules()).get(where)
    if isinstance(module, ColumnParallelLinear):
        return "f"
    if isinstance(module, (RowParallelLinear, VocabParallelEmbedding)):
        return "g"
    return {"cross entropy": "loss", "replicated grads": "grads"}.get(where, where)


def tp_step(
    ctx: RankContext,
    config: GPTConfig = TINY,
    batch: int = 8,
    steps: int = 2,
    *,
    sequence_parallel: bool = False,
    link: SimulatedLink | None = None,
    ring: bool = False,
    lr: float = 3e-3,
) -> dict[str, Any]:
    """`steps` traced training steps (Adam) of the GPT split over the group, after an
    untraced warm-up step; then one more forward whose bytes are sampled.

    The trace has spans forward, loss, backward and optimizer, one communication span
    per collective, labelled f, g, loss or grads (`label_of`; the ring's own steps
    inside them are left out), and the memory sample "after forward" (for
    plots.memory). With `link` (or `ring=True`) the collectives run on the course's
    ring over that link (a `Comm` with it), else on torch.distributed's.

    Returns per traced step the seconds it took ("step_s", after a barrier) and those
    spent in collectives ("comm_s"); the last step's collectives (as `collectives_in`);
    this rank's parameter bytes and bytes kept for backward, each with its formula;
    and the losses. Each step is `_traced_step`, its spans labelled by
    `_label_collectives`; the bytes are `_sampled_forward`'s.
    """
    n, tracer = ctx.world_size, ctx.tracer
    tracer.set_status("building the model")
    on_ring = n > 1 and (link is not None or ring)
    model = apply_tensor_parallel(
        gpt(config),
        GPT_PLAN,
        ctx.group,
        sequence_parallel=sequence_parallel,
        tracer=tracer,
        comm=Comm(ctx.group, tracer=tracer, link=link, algorithm="ring") if on_ring else None,
    )
    comm = shared_comm(model)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    spans, counters = tracer.data().spans, tracer.data().counters
    step_s: list[float] = []
    comm_s: list[float] = []
    losses: list[float] = []
    collectives: list[Any] = []
    for step in range(steps + 1):
        x, y = batch_for(step, batch, config)
        dist.barrier(group=ctx.group)
        first_span, first_event = len(spans), len(counters)
        seconds, loss = _traced_step(ctx, model, comm, opt, x, y, config.vocab)
        step_s.append(seconds)
        losses.append(loss)
        if step == 0:  # the warm-up: not part of the trace
            del spans[first_span:], counters[first_event:]
            continue
        comm_s.append(_label_collectives(spans, first_span, model))
        collectives = collectives_in(counters[first_event:], n)
    memory = _sampled_forward(tracer, model, x)
    return {
        "step_s": step_s[1:],
        "comm_s": comm_s,
        "losses": losses,
        "collectives": collectives,
        "param_bytes": memory["params"],
        "activation_bytes": memory["activations"],
        "theory": theory_for(config, batch, n, sequence_parallel),
    }


def _traced_step(
    ctx: RankContext,
    model: nn.Module,
    comm: Any,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    vocab: int,
) -> tuple[float, float]:
    """One training step in the spans forward, loss, backward and optimizer; its seconds
    and its loss."""
    tracer = ctx.tracer
    t0 = time.perf_counter()
    with tracer.span("forward"):
        logits = model(x)  # (B, T, vocab / N)
    with tracer.span("loss", label="loss"):
        loss = vocab_parallel_cross_entropy(logits, y, ctx.group, vocab, comm=comm)
    with tracer.span("backward"):
        loss.backward()
    with tracer.span("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, loss.item()


def _label_collectives(spans: list[Span], first: int, model: nn.Module) -> float:
    """The spans from `first` on without the ring's own steps, each collective labelled
    f, g, loss or grads (`label_of`); returns the seconds spent in collectives."""
    kept = [s for s in spans[first:] if "segment" not in s.meta]  # not the ring's
    for s in kept:
        if "where" in s.meta:
            s.meta["label"] = label_of(s.meta["where"], model)
    spans[first:] = kept
    return sum(s.duration_s for s in kept if "where" in s.meta)


def _sampled_forward(tracer: Tracer, model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Bytes per rank: one more forward, sampled ("after forward"), its spans and
    collectives left out of the trace."""
    spans, counters = tracer.data().spans, tracer.data().counters
    first_span, first_event = len(spans), len(counters)
    acts = SavedActivations()
    with acts:
        logits = model(x)  # noqa: F841 - alive while its saved tensors are counted
    memory = tracer.memory("after forward", model, activations=acts).bytes
    del spans[first_span:], counters[first_event:]
    return memory


# --------------------------------------------------------------------------- the exercise


def _g_in_an_mlp(
    ctx: RankContext, g: type[torch.autograd.Function], d_model: int = 24, seed: int = 0
) -> dict[str, float] | dict[str, tuple[int, ...] | str]:
    """Megatron's MLP with the learner's `g` after the row-parallel layer (the library's
    f before the column-parallel one), against one process: the largest difference of
    the output and the norm of each gradient over one process's; {"shape": what g
    returned} instead when it is no tensor of its input's shape."""
    n = ctx.world_size
    config = GPTConfig(d_model=d_model, n_heads=1)
    reference = _seeded(lambda: MLP(config), seed)
    comm = TPComm(Comm(ctx.group))
    up = ColumnParallelLinear(reference.up, comm)  # f, then this rank's hidden features
    down = nn.Parameter(reference.down.weight.detach().chunk(n, dim=1)[ctx.rank].clone())
    g_rand = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 5, d_model, generator=g_rand)
    upstream = torch.randn(2, 5, d_model, generator=g_rand)  # d loss / d output
    x_ref, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = reference(x_ref)
    (y_ref * upstream).sum().backward()
    assert x_ref.grad is not None  # a leaf that requires grad, and y_ref depends on it
    partial = F.linear(F.gelu(up(x_split)), down)  # (B, T, C): this rank's partial sum
    y = g.apply(partial, ctx.group)
    if not isinstance(y, torch.Tensor) or y.shape != y_ref.shape:
        shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        return {"shape": shape}
    y = y + reference.down.bias
    (y * upstream).sum().backward()
    ref_down = reference.down.weight.grad.chunk(n, dim=1)[ctx.rank]
    ref_up = reference.up.weight.grad.chunk(n, dim=0)[ctx.rank]
    ratio: dict[str, float] = {}
    for name, got, want in (
        ("input", x_split.grad, x_ref.grad),
        ("mlp.up", up.weight.grad, ref_up),
        ("mlp.down", down.grad, ref_down),
    ):
        ratio[name] = math.nan if got is None else float(got.norm() / want.norm())
        if got is not None and torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            ratio[name] = 1.0
    return {"output_error": float((y.detach() - y_ref.detach()).abs().max()), **ratio}


def check_g(g: type[torch.autograd.Function], pool: Pool) -> bool:
    """Lesson 05's exercise: `g`, an autograd Function called as `g.apply(x, group)`, is
    Megatron's g: given each rank's partial sum it returns the whole sum on every rank,
    and its backward passes the gradient through. It is run in Megatron's MLP on the
    ranks of `pool` (on 2 when the pool has 1: one rank cannot tell a wrong backward),
    against one process: the output, then every gradient. Prints one short verdict."""
    if pool.world_size > 1:
        run = run_exercise(pool, _g_in_an_mlp, g)
        n = pool.world_size
    else:
        with Pool(2) as two:
            run = run_exercise(two, _g_in_an_mlp, g)
        n = 2
    if run is None:
        return False
    for r in run.results:
        if "shape" in r:
            print(
                f"Not quite: g returned {r['shape']}, expected a tensor the shape of its input. "
                "Hint: forward returns the sum over ranks of its input."
            )
            return False
        if not r["output_error"] <= 1e-4:
            print(
                f"Not quite: with {n} ranks g's output differs from one process's by up to "
                f"{r['output_error']:.3g}. Hint: in forward each rank holds a partial sum of "
                "the output; g adds them up, on every rank (all-reduce)."
            )
            return False
        wrong = {k: v for k, v in r.items() if k != "output_error" and v != 1.0}
        if wrong:
            name, ratio = next(iter(wrong.items()))
            what = {
                "input": "the MLP's input",
                "mlp.up": "mlp.up's weight",
                "mlp.down": "mlp.down's weight",
            }[name]
            got = "is missing" if math.isnan(ratio) else f"is {ratio:.3g} x one process's"
            print(
                f"Not quite: the output is right, but the gradient of {what} {got} "
                "(expected 1 x). Hint: g's output is the same on every rank, and so is its "
                "gradient: backward hands it on unchanged (one gradient per input of "
                "forward, None for the group)."
            )
            return False
    print(
        f"Correct: g sums the partial sums forward and passes the gradient through "
        f"backward; Megatron's MLP on {n} ranks equals one process."
    )
    return True

"""Rank functions for the 3D tests (importable by name in the ranks)."""

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from parcourse.data import progressions
from parcourse.hybrid import Hybrid
from parcourse.mesh import Mesh
from parcourse.models import GPTConfig, gpt

CONFIG = GPTConfig(vocab=30, block_size=12, n_layers=4, n_heads=12, d_model=24)  # tp 1-4
BATCH = 24  # divisible by every dp x microbatches used below


def train(ctx, shape, schedule="1f1b", microbatches=2, steps=2, order="megatron", **kwargs):
    """`steps` Adam steps of the GPT on a mesh of `shape`; the weights before and after,
    gathered whole, and the losses."""
    config = kwargs.pop("config", CONFIG)
    mesh = Mesh(shape, ctx.group, order=order)
    model = Hybrid(
        gpt(config),
        mesh,
        schedule=schedule,
        microbatches=microbatches,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
        **kwargs,
    )
    before = model.full_state_dict()
    x, y = progressions(BATCH, config.block_size, config.vocab)
    losses, norms = [], []
    for _ in range(steps):
        losses.append(model.step(x, y))
        norms.append(model.grad_norm)
    return before, model.full_state_dict(), losses, norms


def one_process(steps=2, config=CONFIG, max_norm=None):
    """The same training in one process: the weights before and after, and the losses."""
    model = gpt(config)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = progressions(BATCH, config.block_size, config.vocab)
    losses, norms = [], []
    for _ in range(steps):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return (before, {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms)


def traced_step(ctx, shape):
    """One traced step: bytes sent per axis, this rank's parameter bytes, span axes, and
    how many weights it holds."""
    from parcourse.hybrid import bytes_by_axis

    mesh = Mesh(shape, ctx.group)
    model = Hybrid(gpt(CONFIG), mesh, microbatches=2, tracer=ctx.tracer)
    x, y = progressions(BATCH, CONFIG.block_size, CONFIG.vocab)
    model.step(x, y)
    data = ctx.tracer.data()
    return (
        bytes_by_axis(data.counters),
        sum(p.numel() * 4 for p in model.params),
        {s.meta.get("axis") for s in data.spans if s.kind == "comm"},
        len(model.params),
    )


def memory_after_a_step(ctx, shape, zero, config=CONFIG):
    """What this rank holds after one step (`Hybrid.memory`)."""
    mesh = Mesh(shape, ctx.group)
    model = Hybrid(gpt(config), mesh, microbatches=2, zero=zero)
    x, y = progressions(BATCH, config.block_size, config.vocab)
    model.step(x, y)
    return model.memory(), len(model.params)


def reductions(ctx, shape, config=CONFIG, **kwargs):
    """`reductions(model)` on this rank (lesson 09's table), the model built as asked."""
    from parcourse.experiments.hybrid import reductions

    return reductions(Hybrid(gpt(config), Mesh(shape, ctx.group), **kwargs))


def dp_bytes_by_zero(ctx, shape, zero, microbatches):
    """Bytes this rank sent over dp in one traced step, and its units' padded sizes
    (the stages' first, the tied weights' last)."""
    from parcourse.hybrid import bytes_by_axis

    model = Hybrid(
        gpt(CONFIG), Mesh(shape, ctx.group), microbatches=microbatches, zero=zero, tracer=ctx.tracer
    )
    x, y = progressions(BATCH, CONFIG.block_size, CONFIG.vocab)
    model.step(x, y)
    units = [u.padded for u in model.sharded.units]
    tied = model.sharded.tied_unit.padded if model.sharded.tied_unit is not None else 0
    return bytes_by_axis(ctx.tracer.data().counters)["dp"], units, tied


def padded_spans(ctx, shape, compute, link):
    """One traced step with `compute` simulated: each compute span of this rank (its
    stage, kind, microbatch, seconds), the seconds of tp's collectives inside it (their
    spans), how many there are, when the first began (from the span's start), the
    seconds they blocked by tp's own clock (`Comm.blocked_s`, what padding leaves on
    top) and the least the link lets them block: a ring all-reduce of 2 ranks waits at
    least two latencies from its start (its second message leaves once the first has
    arrived); an all-gather or a reduce-scatter, one message, may meet it arrived."""
    mesh = Mesh(shape, ctx.group)
    model = Hybrid(gpt(CONFIG), mesh, microbatches=2, tracer=ctx.tracer, compute=compute, link=link)
    x, y = progressions(BATCH, CONFIG.block_size, CONFIG.vocab)
    comm, span, blocked = model.tp_comm.comm, ctx.tracer.span, []

    @contextmanager
    def counting(name, kind="compute", **meta):  # the runtime's spans: tp's clock across
        before = comm.blocked_s  # each action, in the order they end
        with span(name, kind, **meta):
            yield
        if kind == "compute" and "action" in meta:
            blocked.append(comm.blocked_s - before)

    ctx.tracer.span = counting
    try:
        model.step(x, y)
    finally:
        del ctx.tracer.span
    spans = ctx.tracer.data().spans
    tp = [
        s
        for s in spans
        if s.kind == "comm"
        and s.meta.get("axis") == "tp"
        and s.meta.get("phase") in ("forward", "backward")
    ]  # TPComm's, not the ring's
    actions = [s for s in spans if s.kind == "compute" and "action" in s.meta]
    assert len(actions) == len(blocked)
    out = []
    for s, apart in zip(actions, blocked):
        inside = [t for t in tp if s.start_ns <= t.start_ns and t.end_ns <= s.end_ns]
        least = sum(2 for t in inside if t.meta["op"] == "all_reduce") * link.latency_s
        out.append(
            (
                s.meta["stage"],
                s.meta["action"],
                s.meta["microbatch"],
                s.duration_s,
                sum(t.duration_s for t in inside),
                len(inside),
                (min(t.start_ns for t in inside) - s.start_ns) / 1e9,
                apart,
                least,
            )
        )
    return out


def dropout_masks(ctx, shape):
    """The masks every dropout of this rank draws in one step (dropout 0.5), by module
    name, with this rank's mesh coordinates."""
    from parcourse.tensor_parallel.random import TrackedDropout

    config = GPTConfig(**{**CONFIG.__dict__, "dropout": 0.5})
    mesh = Mesh(shape, ctx.group)
    model = Hybrid(
        gpt(config), mesh, microbatches=2, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0)
    )
    names = {id(m): n for n, m in model.model.named_modules()}
    drawn = []

    def record(module, inputs, out):
        if out.device.type != "meta":
            drawn.append((names[id(module)], (out == 0) & (inputs[0] != 0)))

    for m in model.model.modules():
        if isinstance(m, TrackedDropout):
            m.register_forward_hook(record)
    model.step(*progressions(BATCH, config.block_size, config.vocab))
    return {a: mesh.coordinate(a) for a in ("dp", "pp", "tp")}, drawn


def thawed_after_hybrid(ctx, shape=None):
    """tp 2 with sequence parallelism (or `shape`): ln_f frozen when Hybrid is built,
    unfrozen after, then a step."""
    model = gpt(CONFIG)
    model.ln_f.requires_grad_(False)
    hybrid = Hybrid(
        model, Mesh(shape or {"tp": 2}, ctx.group), microbatches=2, sequence_parallel=shape is None
    )
    hybrid.model.ln_f.requires_grad_(True)
    hybrid.step(*progressions(BATCH, CONFIG.block_size, CONFIG.vocab))


def bad_sizes(ctx):
    """What Hybrid says to three shapes the GPT cannot take, caught on every rank (each is
    refused alike everywhere before any message), so one run answers all three."""
    said = []
    for shape, microbatches in (
        ({"dp": 1, "tp": 8, "pp": 1}, 2),
        ({"dp": 1, "tp": 1, "pp": 8}, 2),
        ({"dp": 4, "tp": 2, "pp": 1}, 4),
    ):
        try:
            train(ctx, shape, microbatches=microbatches, steps=1)
        except ValueError as e:
            said.append(str(e))
        else:
            said.append("trained")
    return said


def memory_by_zero(ctx, zero):
    """What this rank holds after one step on dp 2 x pp 2 under ZeRO `zero`: its memory by
    category, and Adam's state alone."""
    from parcourse.memory import storage_bytes, tensors_in

    model = Hybrid(gpt(CONFIG), Mesh({"dp": 2, "pp": 2}, ctx.group), microbatches=2, zero=zero)
    x, y = progressions(BATCH, CONFIG.block_size, CONFIG.vocab)
    model.step(x, y)
    memory = model.memory()
    memory["adam"] = storage_bytes(tensors_in(list(model.optimizer.state.values())))
    return memory


EXPERTS = GPTConfig(
    vocab=30,
    block_size=12,
    n_layers=4,
    n_heads=12,
    d_model=24,
    experts=4,
    top_k=2,
    aux_loss=0.01,
    z_loss=0.001,
)


def one_process_by_microbatch(replicas, microbatches, config, steps=2, max_norm=None):
    """One process, each replica's microbatches run in turn (a GPT with experts routes,
    caps and weighs its balancing losses per microbatch of a replica): the weights before
    and after, the losses and the clipped norms."""
    from parcourse.experts import set_aux_scale, update_bias

    model = gpt(config)
    parts = replicas * microbatches
    set_aux_scale(model, 1 / parts)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = progressions(BATCH, config.block_size, config.vocab)
    losses, norms = [], []
    for _ in range(steps):
        total = 0.0
        for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
            loss = F.cross_entropy(model(xs).flatten(0, 1), ys.flatten())
            (loss / parts).backward()
            total += loss.item() / parts
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        update_bias(model)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return (before, {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms)


def train_fp64(ctx, *args, **kwargs):
    """`train` with every tensor fp64 (the rank's default dtype, for this call only: the
    pool's ranks run other tests after it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return train(ctx, *args, **kwargs)
    finally:
        torch.set_default_dtype(before)

"""Rank functions for the 3D tests (importable by name in the ranks)."""

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from zero_fns import FP16_SCALER  # overflows at first: skips

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


def dp_bytes_by_zero(ctx, shape, zero, microbatches, **kwargs):
    """Bytes this rank sent over dp in one traced step, and its units' padded sizes
    (the stages' first, the tied weights' last)."""
    from parcourse.hybrid import bytes_by_axis

    model = Hybrid(
        gpt(CONFIG),
        Mesh(shape, ctx.group),
        microbatches=microbatches,
        zero=zero,
        tracer=ctx.tracer,
        **kwargs,
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


def memory_by_zero(ctx, zero, **kwargs):
    """What this rank holds after one step on dp 2 x pp 2 under ZeRO `zero`: its memory by
    category, and Adam's state alone."""
    from parcourse.memory import storage_bytes, tensors_in

    mesh = Mesh({"dp": 2, "pp": 2}, ctx.group)
    model = Hybrid(gpt(CONFIG), mesh, microbatches=2, zero=zero, **kwargs)
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


# --- fp16 with loss scaling in the 3D step (torch's ShardedGradScaler over every rank)

FP16_LR = 0.1


def _sgd(params):
    return torch.optim.SGD(params, lr=FP16_LR)


def train_fp16(ctx, shape, steps, plant=None, microbatches=2, **kwargs):
    """`steps` SGD steps of the GPT on a mesh of `shape` computing in fp16, stepped through
    torch's ShardedGradScaler over every rank. `plant`: (step, rank) whose first weight's
    gradient gets an inf in backward. Returns the fp32 masters whole, the scale before
    each step and after the last, the steps skipped and the losses."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mesh = Mesh(shape, ctx.group)
    scaler = ShardedGradScaler("cpu", process_group=ctx.group, **FP16_SCALER)
    kwargs.setdefault("zero", 1)
    model = Hybrid(
        gpt(CONFIG),
        mesh,
        microbatches=microbatches,
        optimizer=_sgd,
        compute_dtype=torch.float16,
        scaler=scaler,
        **kwargs,
    )
    now = {"step": -1}
    if plant is not None and plant[1] == ctx.rank:
        model.params[0].register_hook(lambda g: _inf_at(g) if now["step"] == plant[0] else g)
    x, y = progressions(BATCH, CONFIG.block_size, CONFIG.vocab)
    scales, losses = [], []
    for step in range(steps):
        now["step"] = step
        scales.append(scaler.get_scale())
        losses.append(model.step(x, y))
    skipped = model.precision.skipped_steps
    return model.full_state_dict(), [*scales, scaler.get_scale()], skipped, losses


def _inf_at(grad):
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


def one_process_fp16(
    steps, replicas, microbatches=2, plant_step=None, add_in="fp16", tied=None, max_norm=None
):
    """What fp16 with loss scaling means in one process, with a plain torch.amp.GradScaler:
    fp32 masters; each replica's microbatches run forward and backward on the masters
    cast to fp16 (the loss in fp32, scaled); the replicas' fp16 gradients summed and
    divided in fp16, as a reduce-scatter does, then cast to fp32; the scaler unscales,
    (clips to `max_norm`,) skips on an inf, steps and updates.
    `add_in`: where the microbatches' gradients are added up: "fp16" (in .grad, before
    the reduction: ZeRO-1) or "fp32" (each microbatch's reduced, then added in fp32:
    ZeRO-2 and 3, as FSDP2 adds its sharded gradients in the weights' dtype); `tied`:
    a weight added in fp16 whatever `add_in` says (the tied embedding across stages,
    which the pipeline adds up after the schedule). Returns the masters, the scale
    before each step and after the last, the largest unscaled |gradient| and the losses."""
    import copy

    master = gpt(CONFIG)
    opt = _sgd(master.parameters())
    scaler = torch.amp.GradScaler("cpu", **FP16_SCALER)
    x, y = progressions(BATCH, CONFIG.block_size, CONFIG.vocab)
    rows = list(zip(x.chunk(replicas), y.chunk(replicas)))  # replica r's rows
    scales, largest, losses = [], 0.0, []
    for step in range(steps):
        scales.append(scaler.get_scale())
        grads: dict = {}  # name -> [microbatch][replica] fp16 gradient
        total = 0.0
        half = copy.deepcopy(master).half()
        for m in range(microbatches):
            for xr, yr in rows:
                xs, ys = xr.chunk(microbatches)[m], yr.chunk(microbatches)[m]
                loss = F.cross_entropy(half(xs).float().flatten(0, 1), ys.flatten())
                scaler.scale(loss / microbatches).backward()
                total += loss.item() / (replicas * microbatches)
                for n, p in half.named_parameters():
                    grads.setdefault(n, []).append(p.grad)
                half.zero_grad()
        for n, p in master.named_parameters():
            each = grads[n]  # microbatch-major: m * replicas + r
            if add_in == "fp16" or n == tied:
                per_replica = [sum(each[r::replicas]) for r in range(replicas)]
                p.grad = (sum(per_replica) / replicas).float()
            else:
                reduced = [
                    sum(each[m * replicas : (m + 1) * replicas]) / replicas
                    for m in range(microbatches)
                ]
                p.grad = sum(g.float() for g in reduced)
        if plant_step == step:
            next(master.parameters()).grad.view(-1)[0] = float("inf")
        found = [p.grad for p in master.parameters()]
        if all(torch.isfinite(g).all() for g in found):
            largest = max(largest, max(float(g.abs().max()) for g in found) / scales[-1])
        scaler.unscale_(opt)  # then clip: GradScaler's documented order
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(master.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(total)
    scales.append(scaler.get_scale())
    return {k: v.detach() for k, v in master.state_dict().items()}, scales, largest, losses


def fp16_refusals(ctx):
    """What the 3D step says to mixed precision it cannot keep: each message."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mesh = Mesh({"dp": 2}, ctx.group)
    tries = [
        {"compute_dtype": torch.float16},  # no ZeRO: no masters
        {"zero": 1, "compute_dtype": torch.bfloat16, "scaler": ShardedGradScaler("cpu")},
        {"zero": 1, "compute_dtype": torch.float16, "scaler": torch.amp.GradScaler("cpu")},
    ]
    said = []
    for kwargs in tries:
        try:
            Hybrid(gpt(CONFIG), mesh, microbatches=2, **kwargs)
        except ValueError as e:
            said.append(str(e))
    return said


def fp16_frozen(ctx, steps=3):
    """fp16 under ZeRO-1 on dp 2 with the position embedding frozen before building: the
    losses, and the frozen weight and one trained weight before and after."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = gpt(CONFIG)
    model.pos_emb.weight.requires_grad_(False)
    scaler = ShardedGradScaler("cpu", process_group=ctx.group, init_scale=2.0**10)
    hybrid = Hybrid(
        model, Mesh({"dp": 2}, ctx.group), microbatches=2, zero=1, optimizer=_sgd,
        compute_dtype=torch.float16, scaler=scaler,
    )  # fmt: skip
    before = hybrid.full_state_dict()
    x, y = progressions(BATCH, CONFIG.block_size, CONFIG.vocab)
    losses = [hybrid.step(x, y) for _ in range(steps)]
    after = hybrid.full_state_dict()
    names = ("pos_emb.weight", "blocks.0.mlp.up.weight")
    return losses, [(before[n], after[n]) for n in names]

"""ZeRO runs that lessons 03-04, the CLI and benchmarks/zero.py launch: bytes per rank by
category, bytes sent, step times against torch's own, a traced stage-3 step."""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from parcourse.data import local_regression
from parcourse.data_parallel import BucketedDataParallel
from parcourse.experiments.data_parallel import alternate_steps
from parcourse.experiments.exercises import ask
from parcourse.experiments.timing import take_turns
from parcourse.launch import RankContext
from parcourse.memory import SavedActivations
from parcourse.models import mlp
from parcourse.theory import zero_bytes, zero_checked_at
from parcourse.trace import MemorySample, Trace, Tracer
from parcourse.zero import shard as zero_shard
from parcourse.zero.layout import FlatUnit, row_chunk


def mlp_for(params: int, depth: int = 4) -> tuple[int, int]:
    """(width, depth) of a square MLP with about `params` parameters."""
    width = max(8, round((params / depth) ** 0.5))
    return width, depth


def memory_by_stage(
    ctx: RankContext,
    stage: Literal[0, 1, 2, 3],
    params: int = 1_000_000,
    depth: int = 4,
    batch: int = 32,
    bucket_mb: float = 1.0,
    mixed_precision: str | None = None,
) -> dict[str, Any]:
    """Two Adam steps under ZeRO `stage` (0 = plain data parallel); memory samples
    ("after forward", "peak in backward", "after step") go into the trace.
    `mixed_precision`: "bfloat16" or "float16" (stages 1-3).

    Returns the parameter count, the theory for this rank, the sample at which each
    category is checked against it, and the bytes this rank sent in the second step,
    counted message by message (stages 1-3, whose collectives are the ring's).

    In phases: the model wrapped for its stage (`_wrapped`), a first step that creates
    Adam's state (`_plain_step`), a second one sampled (`_sampled_step`), the formulas.
    """
    dtype = getattr(torch, mixed_precision) if mixed_precision else None
    if dtype is not None and stage == 0:
        raise ValueError("mixed precision is measured here for ZeRO stages 1-3 only")
    width, depth = mlp_for(params, depth)
    ctx.tracer.set_status("building the model")
    model = mlp(width, width, width, depth=depth)
    n_params = sum(p.numel() for p in model.parameters())
    zmodel, opt = _wrapped(ctx, model, stage, bucket_mb, dtype)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size)
    _plain_step(zmodel, opt, x, y)  # the first step creates Adam's state
    sent = _sampled_step(ctx.tracer, model, zmodel, opt, x, y)
    theory = zero_bytes(n_params, ctx.world_size, stage, dtype or torch.float32)
    # After the step, stage 1 has reduce-scattered its full gradient and keeps its
    # shard, as stage 2 does: W + G + O at that point.
    kept = zero_bytes(n_params, ctx.world_size, 2 if stage == 1 else stage, dtype or torch.float32)
    return {
        "params": n_params,
        "theory": theory,
        "checked_at": zero_checked_at(stage),
        "after_step_total": sum(kept.values()),
        "bytes_sent": sent if stage else None,
    }


def _wrapped(
    ctx: RankContext,
    model: nn.Module,
    stage: Literal[0, 1, 2, 3],
    bucket_mb: float,
    dtype: torch.dtype | None,
) -> tuple[nn.Module, Any]:
    """`model` and its Adam under ZeRO `stage`, or plain data parallelism for stage 0."""
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
    if stage == 0:
        zmodel: nn.Module = BucketedDataParallel(model, ctx.group, bucket_mb=bucket_mb)
        return zmodel, adam(zmodel.parameters())
    return zero_shard(
        model,
        adam,
        stage=stage,
        group=ctx.group,
        bucket_mb=bucket_mb,
        mixed_precision=dtype,
        tracer=ctx.tracer,
    )


def _plain_step(zmodel: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step, its saved activations counted (as in the sampled step) but not sampled."""
    acts = SavedActivations()
    with acts:
        loss = nn.functional.mse_loss(zmodel(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def _sampled_step(
    tracer: Tracer, model: nn.Module, zmodel: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor
) -> float:
    """One step with memory samples "after forward", "in backward" (after each of
    `model`'s gradients, of which only the largest stays, relabelled "peak in backward")
    and "after step"; returns the bytes this rank sent in it."""
    peak: dict[str, MemorySample] = {}

    def sample_in_backward(_: torch.Tensor) -> None:
        s = tracer.memory("in backward", zmodel, opt, acts)
        if not peak or s.total > peak["sample"].total:
            peak["sample"] = s

    sent_before = tracer.total("bytes_sent")
    acts = SavedActivations()
    with acts:
        loss = nn.functional.mse_loss(zmodel(x), y)
    tracer.memory("after forward", zmodel, opt, acts)
    hooks = [p.register_post_accumulate_grad_hook(sample_in_backward) for p in model.parameters()]
    loss.backward()
    opt.step()
    for h in hooks:
        h.remove()
    tracer.memory("after step", zmodel, opt)
    sent = tracer.total("bytes_sent") - sent_before
    opt.zero_grad()
    # Keep only the largest backward sample, relabelled.
    data = tracer.data()
    data.memory = [m for m in data.memory if m.label != "in backward"]
    if peak:
        s = peak["sample"]
        data.memory.insert(1, type(s)(s.rank, "peak in backward", s.t_ns, s.bytes, s.cuda))
    return sent


def measured_over_formula(run: Any) -> dict[str, tuple[float, float]]:
    """For a `memory_by_stage` run: per category, (mean over ranks, largest rank) of
    measured bytes / formula, each at the sample where the formula holds. Ranks differ
    a little: each parameter's rows split as evenly as they can (the first ranks get
    one row more)."""
    result = run.results[0]
    ratios = {}
    for category, label in result["checked_at"].items():
        measured = [s.bytes[category] for s in run.trace.memory_at(label).values()]
        theory = result["theory"][category]
        ratios[category] = (sum(measured) / len(measured) / theory, max(measured) / theory)
    return ratios


def step_times(
    ctx: RankContext,
    configs: dict[str, dict[str, Any]],
    steps: int = 10,
    *,
    params: int = 4_000_000,
    depth: int = 4,
    batch: int = 64,
) -> dict[str, list[float]]:
    """Step times of ZeRO stages and torch's ZeroRedundancyOptimizer / FSDP2, alternating.

    configs: name -> {"kind": "zero", "stage": s} | {"kind": "zero_redundancy"} |
    {"kind": "fsdp2"} | {"kind": "ddp"}.
    """
    width, depth = mlp_for(params, depth)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size, ctx.device)
    runs = {}
    ctx.tracer.set_status("building the models")
    for name, cfg in configs.items():
        model = mlp(width, width, width, depth=depth).to(ctx.device)
        runs[name] = _build(cfg, model, ctx)
    return alternate_steps(ctx, runs, x, y, steps)


def _build(cfg: dict[str, Any], model: nn.Sequential, ctx: RankContext) -> tuple[Any, Any]:
    kind = cfg["kind"]
    if kind == "zero":
        return zero_shard(
            model,
            lambda ps: torch.optim.Adam(ps, lr=1e-3),
            stage=cfg["stage"],
            group=ctx.group,
            bucket_mb=cfg.get("bucket_mb", 25.0),
            algorithm=cfg.get("algorithm", "auto"),
        )
    if kind == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, process_group=ctx.group)
        return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3)
    if kind == "zero_redundancy":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model, process_group=ctx.group)
        return ddp, ZeroRedundancyOptimizer(
            ddp.parameters(), torch.optim.Adam, process_group=ctx.group, lr=1e-3
        )
    if kind == "fsdp2":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(ctx.group, ctx.device.type)
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    raise ValueError(f"unknown kind {kind!r}")


def peak_memory(
    ctx: RankContext, cfg: dict[str, Any], params: int = 4_000_000, depth: int = 4, batch: int = 64
) -> dict[str, int]:
    """Peak bytes by category in one training step, measured by torch's own MemTracker
    (so that ours and torch's implementations are measured by the same tool)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    width, depth = mlp_for(params, depth)
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size, ctx.device)
    ctx.tracer.set_status("building the model")
    model, opt = _build(cfg, mlp(width, width, width, depth=depth).to(ctx.device), ctx)
    nn.functional.mse_loss(model(x), y).backward()  # a first step creates the optimizer state
    opt.step()
    opt.zero_grad()
    tracker = MemTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns about parameters without gradients
        tracker.track_external(model, getattr(opt, "optimizer", opt))
        with tracker:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    peak = tracker.get_tracker_snapshot("peak")
    device = next(iter(peak))
    return {str(k).split(".")[-1].lower(): int(v) for k, v in peak[device].items()}


def zero3_step(
    ctx: RankContext,
    prefetch: bool = True,
    params: int = 2_000_000,
    depth: int = 6,
    batch: int = 64,
    stage: Literal[1, 2, 3] = 3,
) -> dict[str, Any]:
    """Two traced training steps under ZeRO (stage 3 by default): forward and optimizer
    spans here; backward and one span per all-gather and reduce-scatter of each layer
    from the model.

    Returns the parameter bytes, the collectives' sizes this rank issued in the
    second step (by kind), and the bytes it sent in that step, counted message by
    message.
    """
    width, depth = mlp_for(params, depth)
    ctx.tracer.set_status("building the model")
    model = mlp(width, width, width, depth=depth)
    zmodel, opt = zero_shard(
        model,
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
        stage=stage,
        group=ctx.group,
        prefetch=prefetch,
        bucket_mb=1.0,
        tracer=ctx.tracer,
    )
    x, y = local_regression(batch, width, width, ctx.rank, ctx.world_size)
    tracer = ctx.tracer
    for step in range(2):
        dist.barrier(group=ctx.group)  # a common start, for the timeline
        if step == 1:
            first = len(tracer.data().spans)
            sent_before = tracer.total("bytes_sent")
        with tracer.span("forward", step=step):
            loss = nn.functional.mse_loss(zmodel(x), y)
        loss.backward()  # the model traces backward and each layer's collectives
        with tracer.span("optimizer", step=step):
            opt.step()
            opt.zero_grad()
    volume: dict[str, int] = {}
    for s in tracer.data().spans[first:]:
        if s.kind == "comm" and "size" in s.meta:
            volume[s.name] = volume.get(s.name, 0) + s.meta["size"]
    n_params = sum(u.numel for u in zmodel.units)
    return {
        "param_bytes": n_params * 4,
        "volume": volume,
        "params": n_params,
        "bytes_sent": tracer.total("bytes_sent") - sent_before,
    }


def per_layer(trace: Trace) -> Trace:
    """`trace` with each layer's all-gather and reduce-scatter one bar (labelled with its
    unit, `label_key="unit"`), the ring's steps inside them left out: a timeline where each
    layer's gather, compute and free can be counted."""
    return Trace(
        trace.world_size,
        [s for s in trace.spans if "phase" not in s.meta],
        trace.counters,
        trace.memory,
    )


def gather_scatter_times(ctx: RankContext, nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Median seconds of one all-gather and one reduce-scatter of `nbytes` (the whole
    buffer), by torch.distributed (what FSDP2 calls) and by this course's ring (what
    ZeroModel runs on gloo), beside torch's all-reduce of the same buffer."""
    from parcourse._compat import all_gather_single, reduce_scatter_single
    from parcourse.comm import ring_all_gather, ring_reduce_scatter

    n = ctx.world_size
    numel = max(n, nbytes // 4 // n * n)
    whole = torch.ones(numel, device=ctx.device)
    part = torch.ones(numel // n, device=ctx.device)
    ops: dict[str, Callable[[int], object]] = {  # each given the round, which it ignores
        "torch all_reduce": lambda _: dist.all_reduce(whole, group=ctx.group),
        "torch all_gather": lambda _: all_gather_single(whole, part, group=ctx.group),
        "torch reduce_scatter": lambda _: reduce_scatter_single(part, whole, group=ctx.group),
        "ring all_gather": lambda _: ring_all_gather(part, ctx.group, out=whole),
        "ring reduce_scatter": lambda _: ring_reduce_scatter(whole, ctx.group),
    }
    times = take_turns(ctx.group, ops, repeats, warmup=0)
    return {name: statistics.median(ts) for name, ts in times.items()}


# --------------------------------------------------------------------------- exercises


def check_rows(fn: Callable[[torch.Tensor, int, int], torch.Tensor]) -> bool:
    """Lesson 03's exercise: `fn(param, rank, world_size)` returns the rows of `param`
    that `rank` keeps, as `ZeroModel` cuts them. Prints one short verdict."""
    g = torch.Generator().manual_seed(0)
    for shape in [(13, 7), (8, 2), (5,), (2, 3)]:
        param = torch.randn(shape, generator=g)
        for world_size in range(1, 6):
            for rank in range(world_size):
                start, end = row_chunk(shape[0], rank, world_size)
                expected = param[start:end]
                answered, got = ask(
                    fn,
                    param,
                    rank,
                    world_size,
                    where=f"with shape {shape}, rank {rank} of {world_size}, ",
                )
                if not answered:
                    return False
                if not (
                    torch.is_tensor(got)
                    and got.shape == expected.shape
                    and torch.equal(got, expected)
                ):
                    seen = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
                    print(
                        f"Not quite: a parameter of shape {shape} on rank {rank} of "
                        f"{world_size} should keep rows {start}..{end - 1} (shape "
                        f"{tuple(expected.shape)}), got {seen}. Hint: every rank but the "
                        "last ones gets ceil(rows / world_size) rows."
                    )
                    return False
                if (
                    got.numel()
                    and got.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
                ):
                    print(
                        "Not quite: the rows are right, but a copy (.clone(), torch.cat, "
                        "...): return a slice of `param`, a view of its storage, as "
                        "ZeroModel keeps a view into its flat buffer (a copy would hold "
                        "those rows twice)."
                    )
                    return False
    print("Correct: every rank keeps ceil(rows / N) rows; the last ones fewer, or none.")
    return True


def check_unpack(
    fn: Callable[[torch.Tensor, list[tuple[int, ...]], int], list[torch.Tensor]],
) -> bool:
    """Lesson 04's exercise: `fn(parts, shapes, world_size)` rebuilds the parameters from
    what an all-gather returned (one row of `parts` per rank), as `ZeroModel` does before
    a layer runs. Checked against the library's own packing. Prints one short verdict."""
    g = torch.Generator().manual_seed(0)
    cases: list[list[tuple[int, ...]]] = [
        [(6, 4)],
        [(13, 7), (13,), (5, 13), (5,)],
        [(3, 2), (1, 4)],
    ]
    for shapes in cases:
        for world_size in (1, 2, 3, 4):
            params = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
            expected = [p.detach().clone() for p in params]
            unit = FlatUnit(0, params, 0, world_size)
            parts = torch.zeros(world_size, unit.part_numel)
            unit.pack(expected, parts)
            answered, got = ask(
                fn,
                parts,
                [tuple(s) for s in shapes],
                world_size,
                where=f"with shapes {shapes} on {world_size} ranks, ",
            )
            if not answered:
                return False
            if not isinstance(got, (list, tuple)):
                print(
                    f"Not quite: expected a list of tensors, one per parameter, got "
                    f"{type(got).__name__}{' (is a return missing?)' * (got is None)}."
                )
                return False
            for shape, e, o in zip(shapes, expected, list(got) + [None] * len(shapes)):
                if not (torch.is_tensor(o) and o.shape == e.shape and torch.equal(o, e)):
                    seen = tuple(o.shape) if torch.is_tensor(o) else type(o).__name__
                    ranks = f"{world_size} rank{'s' * (world_size != 1)}"
                    print(
                        f"Not quite: with {ranks}, the parameter of shape {shape} "
                        f"came back as {seen}, or with other values. Hint: each rank's row "
                        "holds ceil(rows / N) rows of every parameter, padding included; "
                        "stack the ranks' chunks, then drop the padding rows."
                    )
                    return False
    print("Correct: gathered, unpadded and reshaped, every parameter is whole again.")
    return True

"""Tensor-parallel runs that the CLI, benchmarks/tensor_parallel.py and lesson 05 share:
the tiny GPT trained split over ranks, its bytes per rank and its collectives against
the formulas, and step times against PyTorch's own tensor parallelism (DTensor) and
over simulated links."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parcourse.comm import Algorithm, Comm, SimulatedLink
from parcourse.data import progressions
from parcourse.experiments.timing import take_turns
from parcourse.launch import RankContext
from parcourse.memory import SavedActivations, live_bytes
from parcourse.models import GPT, TINY, GPTConfig, gpt
from parcourse.tensor_parallel import (
    GPT_PLAN,
    apply_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from parcourse.tensor_parallel.comm import TPComm
from parcourse.theory import (
    TPCollective,
    tp_activation_bytes,
    tp_collectives,
    tp_parameter_bytes,
)
from parcourse.trace import CounterEvent

Impl = Literal["ours", "torch"]


def theory_for(
    config: GPTConfig, batch: int, world_size: int, sequence_parallel: bool
) -> dict[str, Any]:
    """What the formulas give for one rank: parameter and activation bytes, collectives."""
    return {
        "param_bytes": tp_parameter_bytes(config, world_size)["total"],
        "activation_bytes": tp_activation_bytes(
            config, batch, config.block_size, world_size, sequence_parallel
        )["total"],
        "collectives": tp_collectives(
            config, batch, config.block_size, world_size, sequence_parallel
        ),
    }


def batch_for(step: int, batch: int, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `step`: the same on every rank (tensor-parallel ranks share their data)."""
    return progressions(batch, config.block_size, config.vocab, seed=step)


def collectives_in(events: Iterable[CounterEvent], world_size: int) -> list[TPCollective]:
    """The tracer's "tp_collective" events as (op, phase, where, bytes), sorted, to compare
    with `parcourse.theory.tp_collectives`. None on one rank: f and g skip theirs there,
    and the loss's three all-reduces on a group of one move nothing."""
    if world_size == 1:
        return []
    return sorted(
        (e.meta["op"], e.meta["phase"], e.meta["where"], e.meta["size"])
        for e in events
        if e.name == "tp_collective"
    )


def train(
    ctx: RankContext,
    config: GPTConfig = TINY,
    steps: int = 5,
    batch: int = 8,
    *,
    sequence_parallel: bool = False,
    lr: float = 3e-3,
    seed: int = 0,
    algorithm: Algorithm = "ring",
) -> dict[str, Any]:
    """`steps` Adam steps of the GPT split over the group by GPT_PLAN.

    Returns the losses; the parameter bytes of this rank; the bytes kept for backward
    in the first step's forward; the collectives of the last step and the bytes this
    rank sent in it (counted message by message: on the ring, the default here); and
    the formulas for each.
    """
    n = ctx.world_size
    ctx.tracer.set_status("building the model")
    model = gpt(config, seed=seed)
    apply_tensor_parallel(
        model,
        GPT_PLAN,
        ctx.group,
        sequence_parallel=sequence_parallel,
        tracer=ctx.tracer,
        algorithm=algorithm,
        seed=seed,
    )
    comm = shared_comm(model)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, tracer = [], ctx.tracer
    for step in range(steps):
        x, y = batch_for(step, batch, config)
        first_event = len(tracer.data().counters)
        sent_before = tracer.total("bytes_sent")
        acts = SavedActivations()
        with acts:
            logits = model(x)  # (B, T, vocab / N)
        if step == 0:
            activation_bytes = live_bytes(model, activations=acts)["activations"]
        with tracer.span("loss", step=step):
            loss = vocab_parallel_cross_entropy(logits, y, ctx.group, config.vocab, comm=comm)
        with tracer.span("backward", step=step):
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    collectives = collectives_in(tracer.data().counters[first_event:], n)
    return {
        "losses": losses,
        "param_bytes": live_bytes(model)["params"],
        "activation_bytes": activation_bytes,
        "collectives": collectives,
        "bytes_sent": tracer.total("bytes_sent") - sent_before,
        "algorithm": comm.algorithm,
        "theory": theory_for(config, batch, n, sequence_parallel),
    }


def one_process_losses(
    config: GPTConfig = TINY, steps: int = 5, batch: int = 8, *, lr: float = 3e-3, seed: int = 0
) -> list[float]:
    """The same training in one process (no ranks): what `train` must reproduce."""
    model = gpt(config, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch_for(step, batch, config)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# --------------------------------------------------------------------------- against torch


def torch_tensor_parallel(
    model: GPT, group: dist.ProcessGroup, sequence_parallel: bool = False
) -> GPT:
    """The GPT split by PyTorch's own tensor parallelism (DTensor `parallelize_module`),
    the same plan as GPT_PLAN: embedding and head split along the vocabulary, qkv and
    mlp.up column-wise, attn.proj and mlp.down row-wise; with sequence parallelism,
    LayerNorms as `SequenceParallel` and the activations between them Shard(1).

    The position embedding gets `SequenceParallel(sequence_dim=0)` behind a hook that
    hands it this rank's positions (torch's style takes a plain input as already
    split), so that it adds the rows of this rank's tokens, as ours does.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
    tied = model.head.weight is model.tok_emb.weight
    seq = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel(use_local_output=True)  # plain tensors between modules, as ours
    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),  # for loss_parallel
    }
    for i in range(len(model.blocks)):
        plan |= {
            f"blocks.{i}.attn.qkv": ColwiseParallel(input_layouts=seq),
            f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=seq),
            f"blocks.{i}.mlp.up": ColwiseParallel(input_layouts=seq),
            f"blocks.{i}.mlp.down": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan |= {f"blocks.{i}.ln1": norm, f"blocks.{i}.ln2": norm}
    if sequence_parallel:
        rank, size = group.rank(), group.size()
        model.pos_emb.register_forward_pre_hook(
            lambda _, args: (args[0].chunk(size, dim=-1)[rank],)
        )
        plan |= {"ln_f": norm, "pos_emb": SequenceParallel(sequence_dim=0, use_local_output=True)}
    parallelize_module(model, mesh, plan)
    if tied:  # both were split alike (rows over ranks); parallelize_module made two copies
        model.head.weight = model.tok_emb.weight
    return model


def _step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    impl: Impl,
    x: torch.Tensor,
    y: torch.Tensor,
    config: GPTConfig,
    comm: TPComm | None,
) -> float:
    if impl == "ours":
        assert comm is not None  # ours always runs with its TPComm
        loss = vocab_parallel_cross_entropy(model(x), y, comm.group, config.vocab, comm=comm)
        loss.backward()
    else:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    value = loss.detach()  # a DTensor under torch's loss_parallel
    return float(value.full_tensor() if hasattr(value, "full_tensor") else value.item())


def step_times(
    ctx: RankContext,
    steps: int = 10,
    config: GPTConfig = TINY,
    batch: int = 8,
    *,
    sequence_parallel: bool = False,
    impls: tuple[Impl, ...] = ("ours", "torch"),
) -> dict[str, Any]:
    """Seconds per training step (Adam) of ours and of torch's tensor parallelism on the
    same GPT and plan, alternating step by step (the order swaps every step; the first
    step of each is a warm-up). Also each one's losses, which should agree."""
    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer, TPComm | None, Impl]] = {}
    for impl in impls:
        if impl == "ours":
            model = apply_tensor_parallel(
                gpt(config), GPT_PLAN, ctx.group, sequence_parallel=sequence_parallel
            )
            comm = shared_comm(model)
        else:
            model, comm = torch_tensor_parallel(gpt(config), ctx.group, sequence_parallel), None
        runs[impl] = (model, torch.optim.Adam(model.parameters(), lr=3e-3), comm, impl)
    times, losses = _take_turns(ctx, runs, steps, batch, config)
    return {"times": times, "losses": losses}


def _take_turns(
    ctx: RankContext,
    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer, TPComm | None, Impl]],
    steps: int,
    batch: int,
    config: GPTConfig,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Train every run on the same batches, taking turns step by step
    (`timing.take_turns`; the first step of each is a warm-up): seconds per step, and
    losses (the warm-up's included)."""
    losses: dict[str, list[float]] = {name: [] for name in runs}

    def step(name: str) -> Callable[[int], None]:
        model, opt, comm, impl = runs[name]

        def run(i: int) -> None:
            x, y = batch_for(i, batch, config)
            losses[name].append(_step(model, opt, impl, x, y, config, comm))

        return run

    times = take_turns(ctx.group, {name: step(name) for name in runs}, steps)
    return times, losses


def shared_comm(model: nn.Module) -> TPComm:
    """The one `TPComm` that `apply_tensor_parallel` gave every split layer of `model`."""
    comms = {id(c): c for m in model.modules() if isinstance(c := getattr(m, "comm", None), TPComm)}
    if len(comms) != 1:
        raise ValueError(f"expected one TPComm shared by the split layers, found {len(comms)}")
    return next(iter(comms.values()))


def link_step_times(
    ctx: RankContext,
    links: dict[str, SimulatedLink],
    config: GPTConfig = TINY,
    batch: int = 8,
    steps: int = 5,
) -> dict[str, list[float]]:
    """Seconds per training step (Adam) of the GPT split over the group, its collectives
    on the course's ring over each of `links` (a `Comm` with it), the links taking turns
    step by step (the order swaps every step; the first step of each is a warm-up)."""
    runs: dict[str, tuple[nn.Module, torch.optim.Optimizer, TPComm | None, Impl]] = {}
    for name, link in links.items():
        model = apply_tensor_parallel(
            gpt(config), GPT_PLAN, ctx.group, comm=Comm(ctx.group, link=link, algorithm="ring")
        )
        runs[name] = (
            model,
            torch.optim.Adam(model.parameters(), lr=3e-3),
            shared_comm(model),
            "ours",
        )
    return _take_turns(ctx, runs, steps, batch, config)[0]

"""Three-dimensional parallelism on a mesh: the course's GPT split by the tensor-parallel
plan over `tp`, cut into pipeline stages over `pp` (any schedule of lessons 06-07),
and replicated over `dp`, each rank holding one piece.

    mesh = Mesh({"pp": 2, "dp": 2, "tp": 2})          # on 8 ranks
    model = Hybrid(gpt(config), mesh, schedule="1f1b", microbatches=4)
    loss = model.step(tokens, targets)                  # the global batch, every rank
    state = model.full_state_dict()                     # the unsplit model's weights

The pieces are the course's own: `apply_tensor_parallel` on the whole model (so the
embedding and the head are vocabulary-parallel, and stay tied), `gpt_layers` and
`partition` for the stages, `PipelineRuntime` over the pp group (it sends each
activation to the rank of the next stage with the same tp coordinate, and adds the tied
embedding's and head's gradients over the first and last stage), and the gradients
averaged over the dp group. Every communication goes through the group the mesh gives
for its axis; nothing is global. With a tracer, every span and counter of the
communication says its axis (`meta["axis"]`: "tp", "pp" or "dp"), so a step's time and
bytes can be read per axis (`bytes_by_axis`).

Gradient finalisation happens in one place (`finalize_gradients`), in Megatron-LM's
order (`finalize_model_grads`): under sequence parallelism the replicated (LayerNorm)
gradients were already summed over tp in backward (`ReplicatedGradSync`), and the tied
embedding and head summed over the embedding group by the pipeline runtime at the end
of its schedule; then the data-parallel mean (ZeRO-1: a reduce-scatter), then, if
asked, the global gradient norm over tp and pp (and dp under ZeRO-1) and clipping.
The loss is the mean over the global
batch: each replica's microbatches are equal, so the mean of the replicas' means is it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parcourse.comm import Comm, Network
from parcourse.data import shard as shard_rows
from parcourse.memory import storage_bytes, tensors_in
from parcourse.mesh import Mesh
from parcourse.models import GPT, gpt_layers
from parcourse.pipeline.partition import partition
from parcourse.ranges import chunk_bounds
from parcourse.pipeline.runtime import PipelineRuntime
from parcourse.pipeline.schedule import schedule_by_name
from parcourse.tensor_parallel import GPT_PLAN, apply_tensor_parallel
from parcourse.tensor_parallel.comm import TPComm
from parcourse.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from parcourse.tensor_parallel.state_dict import split_dims, whole_parameters
from parcourse.trace import Tracer

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _stages_tied(stages: list[nn.Module]) -> list[dict[int, str]]:
    """Weights more than one stage uses (the embedding and the head), as PipelineRuntime's
    `tied`: {stage: the weight's name in that stage}."""
    where: dict[int, dict[int, str]] = {}
    for s, module in enumerate(stages):
        for name, p in module.named_parameters():
            where.setdefault(id(p), {})[s] = name
    return [group for group in where.values() if len(group) > 1]


class _ShardedOptimizer:
    """ZeRO-1 over the data-parallel group, for one rank's parameters as a flat buffer:
    its slice of the buffer (`chunk_bounds`) is the one parameter its optimizer steps."""

    def __init__(self, params: list[nn.Parameter], comm: Comm, factory: OptimizerFactory
                 ) -> None:
        self.comm = comm
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // comm.size) * comm.size  # the ring cuts N equal parts
        start, end = chunk_bounds(self.padded, comm.size)[comm.rank]
        flat = self._flat([p.detach() for p in params])
        self.start, self.end = start, end
        self.shard = nn.Parameter(flat[start:end].clone())
        self.optimizer = factory([self.shard])

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=tensors[0].dtype, device=tensors[0].device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:self.numel])
        return flat

    def mine(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's slice of `tensors` laid out as the parameters are."""
        return self._flat(tensors)[self.start:self.end]

    @torch.no_grad()
    def reduce(self, params: list[nn.Parameter]) -> None:
        """The gradients averaged over dp, this rank's slice only (`shard.grad`); the full
        gradients go."""
        grads = self._flat([p.grad if p.grad is not None else torch.zeros_like(p)
                            for p in params])
        for p in params:
            p.grad = None
        self.shard.grad = self.comm.reduce_scatter(grads).div_(self.comm.size)

    @torch.no_grad()
    def step(self, params: list[nn.Parameter]) -> None:
        """Step this rank's slice, then all-gather every slice into the parameters."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        whole = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        self.comm.all_gather(self.shard.detach(), whole)
        offset = 0
        for p in params:
            p.copy_(whole[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class Hybrid:
    """The GPT on a `Mesh` of dp x tp x pp ranks; one per rank, all built alike.

    `schedule`: a name of `parcourse.pipeline.SCHEDULES`; `microbatches` per replica (each
    replica's share of the global batch is cut into them); `chunks`: stages per rank for
    interleaved 1F1B. `optimizer`: builds this rank's optimizer from its parameters (Adam,
    lr 1e-3, by default). `recompute`: activation checkpointing of each stage (GPipe's).
    `zero=1`: ZeRO-1 over dp: each replica keeps the optimizer state of 1/dp of this
    rank's parameters (one flat buffer, as the ZeRO paper's P_os), gradients are
    reduce-scattered instead of all-reduced, and the updated slices all-gathered; the
    optimizer then sees one flat parameter, so per-parameter groups do not apply.
    `max_norm`: clip the gradients by their global norm (over every axis that splits
    them), as `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` in one
    process; the norm before clipping is `grad_norm` after each step.
    `link`: a `SimulatedLink` or a two-level `Topology` (fast inside a node, slow between
    nodes) for every message of every axis.
    """

    def __init__(self, model: GPT, mesh: Mesh, *, schedule: str = "1f1b",
                 microbatches: int = 4, chunks: int = 2, sequence_parallel: bool = False,
                 recompute: bool = False, optimizer: OptimizerFactory | None = None,
                 zero: Literal[0, 1] = 0, max_norm: float | None = None,
                 link: Network | None = None, tracer: Tracer | None = None) -> None:
        config = model.config
        self.mesh, self.config, self.microbatches = mesh, config, microbatches
        self.sequence_parallel = sequence_parallel
        tp, pp = mesh.size("tp"), mesh.size("pp")
        if config.n_heads % tp:
            raise ValueError(f"tp ({tp}) must divide the {config.n_heads} heads")
        if sequence_parallel and config.block_size % tp:
            raise ValueError(f"tp ({tp}) must divide the block size ({config.block_size}) "
                             "under sequence parallelism")
        self.plan = schedule_by_name(schedule, pp, microbatches, chunks)
        layers = config.n_layers + 2  # embedding, blocks, head
        if self.plan.stages > layers:
            raise ValueError(f"{self.plan.name} on pp {pp} has {self.plan.stages} stages; the "
                             f"GPT's {layers} layers (embedding, {config.n_layers} blocks, "
                             "head) cannot fill them")
        def on(axis: str) -> Tracer | None:  # what each axis records says which axis
            return tracer.tagged(axis=axis) if tracer is not None else None

        # On a simulated network every axis runs the course's ring, which the link slows;
        # dp's gradients go over the ring on gloo anyway (it counts the bytes it sends).
        self.tp_comm = TPComm(Comm(mesh.group("tp"), tracer=on("tp"), link=link,
                                   algorithm="ring" if link is not None else "torch"))
        self.dp_comm = Comm(mesh.group("dp"), tracer=on("dp"), link=link, algorithm="auto")
        self.model = apply_tensor_parallel(model, GPT_PLAN, mesh.group("tp"),
                                           sequence_parallel=sequence_parallel,
                                           comm=self.tp_comm.comm)
        cut = partition(gpt_layers(self.model), self.plan.stages)
        stage = mesh.coordinate("pp")
        mine = {s: cut[s] for s, r in enumerate(self.plan.stage_rank) if r == stage}
        self.runtime = PipelineRuntime(self.plan, mine, None, self._loss, tracer=tracer,
                                       recompute=recompute, tied=_stages_tied(cut),
                                       comm=Comm(mesh.group("pp"), tracer=on("pp"), link=link,
                                                 algorithm="auto"))
        self.first = self.plan.stage_rank[0] == stage
        self.last = self.plan.stage_rank[-1] == stage
        self.params = list({id(p): p for m in mine.values() for p in m.parameters()}.values())
        if zero not in (0, 1):
            raise ValueError(f"zero must be 0 (replicated optimizer) or 1 (its state sharded "
                             f"over dp), got {zero!r}")
        factory = optimizer or (lambda ps: torch.optim.Adam(ps, lr=1e-3))
        self.sharded = _ShardedOptimizer(self.params, self.dp_comm, factory) if zero else None
        self.optimizer = self.sharded.optimizer if self.sharded else factory(self.params)
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        self.max_norm, self.grad_norm, self.grad_bytes = max_norm, None, 0
        if max_norm is not None:
            # Each gradient element counted once over the mesh: a weight left whole on
            # every tp rank only on tp rank 0, a tied weight only on its first stage.
            split = split_dims(self.model)
            tied_owner = {id(cut[min(g)].get_parameter(g[min(g)])): min(g)
                          for g in _stages_tied(cut)}
            self._counted = [
                float((id(p) in split or mesh.coordinate("tp") == 0)
                      and tied_owner.get(id(p), min(mine)) in mine)
                for p in self.params]
            # The norm's group: the ranks whose gradients differ (Megatron's model-parallel
            # group), and dp too when each replica holds a different slice.
            self._norm_group = mesh.group(*(("dp", "tp", "pp") if zero else ("tp", "pp")))

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross entropy from this rank's vocabulary shard of the logits (the same value on
        every tp rank), as one process computes it from the whole logits."""
        if self.tp_comm.size == 1:
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return vocab_parallel_cross_entropy(logits, targets, self.tp_comm.group,
                                            self.config.vocab, comm=self.tp_comm)

    # -- one training step

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """One optimizer step on the global batch (the same tensors on every rank; each
        replica takes its rows). Returns the global batch's mean loss on the ranks of the
        last stage, None elsewhere."""
        dp, replica = self.mesh.size("dp"), self.mesh.coordinate("dp")
        if inputs.shape[0] % (dp * self.microbatches):
            raise ValueError(f"a global batch of {inputs.shape[0]} cannot be cut into dp "
                             f"({dp}) x microbatches ({self.microbatches}) equal parts")
        x = shard_rows(inputs, replica, dp) if self.first else None
        y = shard_rows(targets, replica, dp) if self.last else None
        loss = self.runtime.step(x, y)  # and the tied weights' gradients added up
        self.finalize_gradients()
        if self.sharded is not None:
            self.sharded.step(self.params)  # step this rank's slice, all-gather the slices
        else:
            self.optimizer.step()
        for p in self.params:
            p.grad = None
        if loss is None:
            return None
        mean = torch.tensor([loss / dp])
        dist.all_reduce(mean, group=self.dp_comm.group)  # the replicas' losses, averaged
        return mean.item()

    def finalize_gradients(self) -> None:
        """What happens to the gradients between the schedule and the optimizer, in
        Megatron-LM's order (`finalize_model_grads`). Before it: under sequence parallelism
        the replicated (LayerNorm) gradients were summed over tp in backward, and the
        pipeline runtime added up the tied embedding's and head's gradients over the first
        and last stage at the end of its schedule. Here:

        1. dp: every gradient averaged over the data-parallel group, as one flat
           all-reduce in parameter order (the same on every replica); under ZeRO-1 a
           reduce-scatter instead, each replica keeping its slice.
        2. if `max_norm`: the global gradient norm over tp and pp (and dp under ZeRO), and
           every gradient scaled by min(1, max_norm / norm), as
           `torch.nn.utils.clip_grad_norm_` does in one process (`self.grad_norm`).
        """
        self.grad_bytes = storage_bytes(p.grad for p in self.params if p.grad is not None)
        if self.sharded is not None:
            self.sharded.reduce(self.params)
        elif self.mesh.size("dp") > 1:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                     for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.dp_comm.all_reduce(flat).div_(self.mesh.size("dp"))
            offset = 0
            for p, g in zip(self.params, grads):
                p.grad = flat[offset:offset + g.numel()].view_as(p).clone()
                offset += g.numel()
        if self.max_norm is not None:
            self.grad_norm = self._clip(self.max_norm)

    @torch.no_grad()
    def _clip(self, max_norm: float) -> float:
        """Scale every gradient so that their norm over the whole model is at most
        `max_norm`; the norm before. The squares are summed in float64, each element once
        (`_counted`), then over the norm's group."""
        if self.sharded is not None:
            weights = self.sharded.mine([torch.full_like(p, w)
                                         for p, w in zip(self.params, self._counted)])
            grads = [self.sharded.shard.grad]
            local = (grads[0].double().square() * weights).sum()
        else:
            grads = [p.grad for p in self.params if p.grad is not None]
            local = torch.zeros((), dtype=torch.float64, device=self.params[0].device)
            for p, w in zip(self.params, self._counted):
                if p.grad is not None and w:
                    local += p.grad.double().square().sum()
        total = local.reshape(1)
        dist.all_reduce(total, group=self._norm_group)
        norm = float(total.sqrt())
        scale = min(1.0, max_norm / (norm + 1e-6))  # torch's clip_grad_norm_ coefficient
        if scale < 1:
            for g in grads:
                g.mul_(scale)
        return norm

    def reductions(self) -> list[dict[str, Any]]:
        """What each group of this rank does to the numbers in one step, in the order it
        happens, as this model is built (sequence parallel or not, ZeRO-1 or not,
        clipping or not, the tied weights cut apart or not): rows of {"when", "what",
        "axis", "op", "ranks"} (`ranks`: this rank's group). Lesson 09's table."""
        sp, zero = self.sequence_parallel, self.sharded is not None
        tp, pp, dp = (self.mesh.ranks(a) for a in ("tp", "pp", "dp"))
        rows = []

        def row(when: str, what: str, axis: str, op: str, ranks: list[int]) -> None:
            if len(ranks) > 1:
                rows.append({"when": when, "what": what, "axis": axis, "op": op,
                             "ranks": ranks})

        row("forward", "the token embedding's vocabulary shards", "tp", "all-reduce (sum)"
            if not sp else "reduce-scatter (sum) along the sequence", tp)
        row("forward", "the row-parallel layers' partial outputs (attention out, MLP down)",
            "tp", "reduce-scatter (sum) along the sequence" if sp else "all-reduce (sum)", tp)
        if sp:
            row("forward", "the sequence chunks entering attention and the MLP", "tp",
                "all-gather", tp)
        row("forward", "activations, stage to stage", "pp", "send / recv (no sum)", pp)
        row("loss", "the logits' max, sum of exps and target logit (vocabulary-parallel "
            "cross entropy)", "tp", "all-reduce (max, sum)", tp)
        row("backward", "the column-parallel layers' input gradients (qkv, MLP up)", "tp",
            "reduce-scatter (sum) along the sequence" if sp else "all-reduce (sum)", tp)
        if sp:
            row("backward", "the LayerNorm weights' gradients (each rank saw its chunk)",
                "tp", "all-reduce (sum)", tp)
        row("backward", "activations' gradients, stage to stage", "pp",
            "send / recv (no sum)", pp)
        if self.runtime.tied:
            embedding = next((g for g in self.mesh.layout.embedding_groups()
                              if self.mesh.local_rank in g), [])
            row("end of schedule", "the tied embedding's and head's gradients", "embedding",
                "sum over the first and last stage", embedding)
        if zero:
            row("finalize 1", "every gradient", "dp", "reduce-scatter (mean): a slice each",
                dp)
        else:
            row("finalize 1", "every gradient", "dp", "all-reduce (mean)", dp)
        if self.max_norm is not None:
            axes = ("dp", "tp", "pp") if zero else ("tp", "pp")
            row("finalize 2", "the squared gradient norm (each element once)",
                "-".join(axes), "all-reduce (sum)", self.mesh.ranks(*axes))
        if zero:
            row("after the step", "the updated slices of the parameters", "dp",
                "all-gather", dp)
        row("report", "the replicas' losses", "dp", "all-reduce (mean)", dp)
        return rows

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, by category: its parameters, its gradients as the
        schedule left them (their peak, before the dp reduction; `grad_bytes`, 0 before
        the first step) and the optimizer's state (under ZeRO-1 with the slice it steps).
        Comparable with `theory.mesh_bytes`."""
        optimizer = storage_bytes(tensors_in(list(self.optimizer.state.values())))
        if self.sharded is not None:
            optimizer += storage_bytes([self.sharded.shard])
        return {"params": storage_bytes(self.params), "grads": self.grad_bytes,
                "optimizer": optimizer}

    # -- export

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit GPT's state dict (same keys, fp32 values), on every rank: each
        stage's parameters gathered over tp, then every stage's over pp (replicas are
        equal)."""
        mine = whole_parameters(self.model, self.tp_comm.group, only=self.params)
        stages: list[Any] = [None] * self.mesh.size("pp")
        dist.all_gather_object(stages, {k: v.cpu() for k, v in mine.items()},
                               group=self.mesh.group("pp"))
        state: dict[str, torch.Tensor] = {}
        for part in stages:
            state.update(part)
        buffers = {name: b.detach().cpu().clone() for name, b in self.model.named_buffers()}
        return {k: state[k] if k in state else buffers[k] for k in self.model.state_dict()}


def bytes_by_axis(counters: Any) -> dict[str, float]:
    """Bytes sent per mesh axis, from a trace's counters (`bytes_sent`, counted message by
    message where the course's own ring and messenger carry them: pp and dp; tp's
    collectives are torch's and counted by their tensors' sizes in `tp_collective`)."""
    out: dict[str, float] = {}
    for c in counters:
        if c.name == "bytes_sent" and "axis" in c.meta:
            out[c.meta["axis"]] = out.get(c.meta["axis"], 0.0) + c.value
    return out

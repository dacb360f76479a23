"""The 3D step: the course's GPT on a mesh, composed from the parts the lessons run alone.

    mesh = Mesh({"pp": 2, "dp": 2, "tp": 2})          # on 8 ranks
    model = Hybrid(gpt(config), mesh, schedule="1f1b", microbatches=4)
    loss = model.step(tokens, targets)                  # the global batch, every rank
    state = model.full_state_dict()                     # the unsplit model's weights

Built as a list, one part a line (as picotron's and torchtitan's `parallelize`): 1. the
plan (`ParallelPlan`) and the ranks' roles (`parcourse.roles`); 2. tp, the experts over
ep, the stages, each sequence over cp; 3. gradient synchronisation, lesson 02's buckets or
ZeRO's flat units behind one interface (`BucketedStages`, `ShardedStages`); 4. the
pipeline runtime over pp (any schedule of lessons 06-07); 5. clipping by the global norm.
Every message goes through the group of its axis or role, and says its axis on a trace
(`bytes_by_axis`; the dense gradients' is "dp"). Lesson 09's table of what each group
reduces is `parcourse.experiments.hybrid.reductions`, the whole state `parcourse.export`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parcourse.comm import Comm, Network
from parcourse.context_parallel import SequenceShard, context_parallel
from parcourse.context_parallel.attention import Method
from parcourse.data import shard as shard_rows
from parcourse.data_parallel.stages import BucketedStages, StageWeights, SyncGroups
from parcourse.experts import expert_parallel, expert_parameters, set_aux_scale, update_bias
from parcourse.export import full_state_dict, memory
from parcourse.memory import storage_bytes
from parcourse.mesh import Mesh
from parcourse.models import GPT, gpt_layers
from parcourse.parts import check_simulation
from parcourse.pipeline.partition import partition, tied_weights
from parcourse.pipeline.runtime import PipelineRuntime
from parcourse.pipeline.simulate import SimulatedCompute
from parcourse.plan import ParallelPlan
from parcourse.roles import Roles
from parcourse.tensor_parallel import apply_tensor_parallel, gpt_plan
from parcourse.tensor_parallel.comm import TPComm
from parcourse.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from parcourse.tensor_parallel.replicated import one_sum
from parcourse.tensor_parallel.state_dict import split_dims
from parcourse.trace import Tracer, bytes_by_axis
from parcourse.zero.clip import clip_counted_, counted_once
from parcourse.zero.stages import ShardedStages
from parcourse.zero.step_precision import StepPrecision

__all__ = ["Hybrid", "bytes_by_axis"]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
GradientSync = BucketedStages | ShardedStages


class Hybrid:
    """The GPT on a `Mesh`, one per rank, all built alike, from a copy of the model (the
    one passed stays whole, as DDP leaves it); `Hybrid.from_plan` takes a `ParallelPlan`.

    `schedule`: a name of `parcourse.pipeline.SCHEDULES`; `microbatches` per replica;
    `chunks`: stages per rank (interleaved 1F1B); `recompute`: checkpoint each stage.
    `optimizer`: this rank's, from its parameters (Adam, lr 1e-3). `zero`: ZeRO's stage
    over the dense replicas; without it lesson 02's buckets (`bucket_mb`). `max_norm`:
    clip by the global norm (`grad_norm`). `link`: a `SimulatedLink` or `Topology`;
    `compute`: a `SimulatedCompute` (lesson 09); `seed`: dropout's. A `cp` axis cuts every
    sequence over its ranks (`cp_method`), the gradients averaged over dp and cp
    (Megatron-LM's cp_dp group). An `ep` axis cuts each MoE layer's experts: its ranks
    take their own rows, the dense weights averaged over dp x ep (x cp), each expert over
    the ranks holding the same experts, both divided by every dense replica.

    `compute_dtype` (bf16, fp16; with `zero`): 16-bit compute, messages and gradients,
    fp32 masters in ZeRO's slices, the loss in fp32; `scaler` (fp16): torch's
    `ShardedGradScaler` over the mesh, called at the step's moments (`precision`, a
    `StepPrecision`: its `skipped_steps` counts the skips)."""

    def __init__(
        self,
        model: GPT,
        mesh: Mesh,
        *,
        cp_method: Method = "ring",
        schedule: str = "1f1b",
        microbatches: int = 4,
        chunks: int = 2,
        sequence_parallel: bool = False,
        recompute: bool = False,
        optimizer: OptimizerFactory | None = None,
        zero: Literal[0, 1, 2, 3] = 0,
        max_norm: float | None = None,
        link: Network | None = None,
        compute: SimulatedCompute | None = None,
        tracer: Tracer | None = None,
        seed: int = 0,
        bucket_mb: float = 25.0,
        compute_dtype: torch.dtype | None = None,
        scaler: Any = None,
    ) -> None:
        config = model.config
        # 1. the plan, checked by the rules the planner and the CLI use, and the roles
        fields = dict(cp_method=cp_method, schedule=schedule, microbatches=microbatches)
        fields.update(chunks=chunks, zero=zero, sequence_parallel=sequence_parallel)
        self.plan = ParallelPlan.on_mesh(mesh, recompute="full" if recompute else "none", **fields)
        self.plan.check(config, world=mesh.layout.world_size)
        check_simulation(self.plan, mesh, link, compute)
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        self.precision = StepPrecision(compute_dtype, scaler, zero, mesh.parent)
        self.mesh, self.config, self.microbatches, self.zero = mesh, config, microbatches, zero
        self.sequence_parallel, self.max_norm = sequence_parallel, max_norm
        self.roles, self.schedule = Roles.of(self.plan, config), self.plan.schedule_value()
        self._tracer, self._link = tracer, link
        # On a simulated network every axis runs the course's ring, which the link slows.
        self.tp_comm = TPComm(self._comm("tp", algorithm="ring" if link is not None else "torch"))
        self.dense_comm = self._comm(*self.roles.dense, tag="dp")
        # 2. the parts: tp, ep, the stages, cp
        cut = self._parallelise(model, seed)
        stage = mesh.coordinate("pp")  # this rank's stages, and the weights several share
        mine = {s: cut[s] for s, r in enumerate(self.schedule.stage_rank) if r == stage}
        tied_groups = tied_weights(cut)
        self.params = list({id(p): p for m in mine.values() for p in m.parameters()}.values())
        self.first = stage in self.schedule.entry_ranks  # given the inputs
        self.last = stage in self.schedule.exit_ranks  # given the targets; the loss is here
        # 3. gradient synchronisation
        tied = {id(cut[s].get_parameter(name)) for g in tied_groups for s, name in g.items()}
        self.sync = self._gradient_sync(
            StageWeights.of(mine, tied, set(self.cut_over)),
            optimizer or (lambda ps: torch.optim.Adam(ps, lr=1e-3)),
            holds_tied={s for g in tied_groups for s in g if s in mine},
            bucket_mb=bucket_mb,
        )
        self.precision.cast_frozen(mine.values(), [p for p in self.params if p.requires_grad])
        self.sharded = self.sync if isinstance(self.sync, ShardedStages) else None
        self.optimizer = self.sync.optimizer
        # 4. the pipeline; simulated compute pads each action, tp's collectives on top
        self.runtime = PipelineRuntime(
            self.schedule,
            mine,
            None,
            self._loss,
            tracer=tracer,
            recompute=recompute,
            tied=tied_groups,
            comm=self._comm("pp"),
            on_weight_gradients=self.sync.on_weight_gradients,
            around=self.sync.around,
            compute=compute,
            paced=self.tp_comm.comm if mesh.size("tp") > 1 else None,
            together=one_sum if sequence_parallel else None,
        )
        # 5. clipping: each gradient element counted once over the norm's group
        self.grad_norm: float | None = None
        self.grad_bytes = 0
        if max_norm is not None:
            self._counted = self._counted_once(cut, set(mine), tied_groups)
            self._norm_group = mesh.group(*self.roles.norm)

    def _counted_once(
        self, cut: list[nn.Module], mine: set[int], tied_groups: list[dict[int, str]]
    ) -> list[float]:
        """`zero.clip.counted_once` for this rank's weights (a tied one on its first stage,
        a gradient the norm's group holds copies of on its first copy)."""
        owner = {id(cut[min(g)].get_parameter(g[min(g)])): min(g) for g in tied_groups}
        copies = [a for a in self.roles.norm if a not in ("tp", "pp")]  # same gradients
        return counted_once(
            self.params,
            split=set(split_dims(self.model)),
            on_first_tp=self.mesh.coordinate("tp") == 0,
            owner=owner,
            stages=mine,
            first_copy=bool(self.zero) or all(self.mesh.coordinate(a) == 0 for a in copies),
            own=set(self.cut_over),
        )

    def _comm(self, *axes: str, tag: str | None = None, algorithm: Any = "auto") -> Comm:
        """`axes`' group's communication; what it records says `tag` (its axis)."""
        traced = self._tracer.tagged(axis=tag or axes[0]) if self._tracer is not None else None
        return Comm(self.mesh.group(*axes), tracer=traced, link=self._link, algorithm=algorithm)

    def _parallelise(self, model: GPT, seed: int) -> list[nn.Module]:
        """A copy of `model` split over tp, its experts over ep, cut into stages, each
        sequence over cp: one call a part. Dropout's masks differ by stage (as Megatron's
        seed, 100 a stage) and replica, and agree over tp where activations are whole."""
        mesh, config = self.mesh, model.config
        self.model = copy.deepcopy(model)  # split in place
        apply_tensor_parallel(
            self.model,
            gpt_plan(config.experts),
            mesh.group("tp"),
            sequence_parallel=self.sequence_parallel,
            comm=self.tp_comm.comm,
            seed=seed + 100 * mesh.coordinate("pp") + 10007 * mesh.coordinate("dp"),
        )
        self.cut_over: dict[int, str] = {}  # weights a part cut along dim 0 over its axis
        if mesh.size("ep") > 1:
            expert_parallel(self.model, self._comm("ep"))
            self.cut_over = {id(p): "ep" for p in expert_parameters(self.model)}
        set_aux_scale(self.model, 1 / self.microbatches)  # as each microbatch's loss is
        cut: list[nn.Module] = list(partition(gpt_layers(self.model), self.schedule.stages))
        self.shard: SequenceShard | None = None
        if mesh.size("cp") > 1:
            self.shard = SequenceShard(mesh.group("cp"), self.plan.cp_method, comm=self._comm("cp"))
            context_parallel(cut, self.shard)
        return cut

    def _gradient_sync(
        self,
        weights: StageWeights,
        factory: OptimizerFactory,
        holds_tied: set[int],
        bucket_mb: float,
    ) -> GradientSync:
        """ZeRO's units over the shard's ranks (`Roles.shard`), or lesson 02's buckets over
        the dense replicas; the experts' over the ranks holding the same experts."""
        r, zero = self.roles, bool(self.zero)  # ZeRO's slices over the shard (`Roles.shard`)
        dense, experts = (r.shard, r.expert_shard) if zero else (r.dense, r.experts)
        comm = self.dense_comm if dense == r.dense else self._comm(*dense)  # traced as its
        expert_comm = self._comm(*experts) if self.cut_over else None  # first axis
        replicate = self._comm(*r.replicate) if zero and r.replicate else None
        groups = SyncGroups(comm, expert_comm, r.size("dense"), replicate)
        if self.zero:
            args = (self.zero, holds_tied, self._note_grad_bytes, self.precision.compute_dtype)
            return ShardedStages.for_stages(weights, self.params, groups, factory, *args)
        mine = self.schedule.actions[self.mesh.coordinate("pp")]
        last = {a.stage: (a.stage, a.microbatch) for a in mine if a.kind in ("B", "W")}
        return BucketedStages(
            weights, self.params, groups, factory, last, bucket_mb, self._note_grad_bytes
        )

    @classmethod
    def from_plan(cls, model: GPT, mesh: Mesh, plan: ParallelPlan | str, **kwargs: Any) -> Hybrid:
        """`Hybrid` for a `ParallelPlan` (or its label, 'dp2 tp2 pp2 1f1b m4 ZeRO-1') on a
        mesh laid out as the plan says; `kwargs`: what the plan does not hold (optimizer,
        max_norm, link, compute, tracer, seed)."""
        plan = ParallelPlan.parse(plan) if isinstance(plan, str) else plan
        held = sorted(set(kwargs) & {*_PLANNED, "recompute"})
        if held:
            raise ValueError(
                f"{', '.join(held)}: given by the plan ({plan.label()}), not beside it"
            )
        plan.check(model.config, world=mesh.layout.world_size)
        plan.check_mesh(mesh.layout, mesh.ranks_per_node)
        planned = {k: getattr(plan, k) for k in _PLANNED}
        return cls(model, mesh, recompute=plan.recompute == "full", **planned, **kwargs)

    def whole_weights(self) -> AbstractContextManager[None]:
        """Every weight whole inside the block (ZeRO-3 gathers them): what exports read."""
        return self.sync.whole_weights()

    @property
    def replica(self) -> tuple[int, int]:
        """(this rank's replica, how many there are): which rows of each global batch it
        takes (`Roles.index`: dp's, dp_shard's, ep's); tp's, pp's and cp's take the same."""
        where = self.mesh.layout.coordinates(self.mesh.local_rank)
        return self.roles.index(where), self.roles.replicas

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross entropy from this rank's vocabulary shard of the logits, as one process's;
        under context parallelism weighed by this rank's share of the sequence."""
        if self.tp_comm.size == 1:
            wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # 16-bit:
            loss = F.cross_entropy(wide.flatten(0, 1), targets.flatten())  # in fp32
        else:  # and there too
            loss = vocab_parallel_cross_entropy(
                logits, targets, self.tp_comm.group, self.config.vocab, comm=self.tp_comm
            )
        loss = self.precision.loss(loss)  # fp16: every gradient scaled up with the loss
        return loss if self.shard is None else loss * self.shard.loss_scale()

    # -- one training step

    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor, *, local: bool = False
    ) -> float | None:
        """One optimizer step on the global batch (the same tensors on every rank; each
        replica takes its rows), or with `local=True` on this replica's rows only (what a
        loader sharded by replica gives it; the ranks of one replica, its cp ranks
        included, the same rows). Returns the global batch's mean loss on the ranks of
        the last stage, None elsewhere."""
        replica, replicas = self.replica
        if local and inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"this replica's {inputs.shape[0]} rows cannot be cut into "
                f"{self.microbatches} equal microbatches"
            )
        if not local:
            self.plan.check(batch=inputs.shape[0])
        self.sync.check()
        x = (inputs if local else shard_rows(inputs, replica, replicas)) if self.first else None
        y = (targets if local else shard_rows(targets, replica, replicas)) if self.last else None
        if self.shard is not None:  # this rank's tokens of each sequence
            x, y = self.shard.cut_batch(x, y, inputs.shape[1], self.config.block_size)
        self.grad_bytes = 0
        scale = self.precision.scale()  # the balancing losses scaled as the loss is
        set_aux_scale(self.model, scale / self.microbatches)
        loss = self.runtime.step(x, y)  # and the tied weights' gradients added up
        self.finalize_gradients()
        for module in self.runtime.stages.values():  # experts' balancing bias, from every
            update_bias(module, self.dense_comm)  # replica's token counts (before the step)
        self.precision.step(self.sync.step, self.optimizer)
        for p in self.params:
            p.grad = None
        if loss is None:
            return None
        mean = torch.tensor([loss / scale / self.roles.size("loss")])  # the replicas' losses,
        dist.all_reduce(mean, group=self.mesh.group(*self.roles.loss))  # averaged
        return mean.item()

    def finalize_gradients(self) -> None:
        """Between the schedule and the optimizer, in Megatron-LM's order
        (`finalize_model_grads`). Before it: under sequence parallelism the replicated
        (LayerNorm) gradients were summed over tp in backward, and the pipeline runtime
        added up the tied embedding's and head's over the first and last stage. Here:
        1. the dense replicas' mean (`sync.finalize`: the buckets still to go, or ZeRO's
        reduce-scatters), the experts' over their own group; 2. with `max_norm`, the
        global norm over the norm's group (`Roles.norm`) and every gradient scaled by
        min(1, max_norm / norm), as `torch.nn.utils.clip_grad_norm_` in one process.
        Between the two, with a `scaler`: its `unscale_`, as a loop unscales before
        `clip_grad_norm_` (a norm of inf: the step will be skipped)."""
        self.sync.finalize()
        self.precision.unscale(self.optimizer)
        if self.max_norm is not None:
            counted = {id(p): bool(w) for p, w in zip(self.params, self._counted)}
            grads = [(g, counted[id(p)]) for g, p in self.sync.gradients()]
            self.grad_norm = float(clip_counted_(grads, self._norm_group, self.max_norm))

    def _note_grad_bytes(self) -> None:
        """The gradients held now (full ones and slices), if more than before this step."""
        held = [p.grad for p in self.params if p.grad is not None] + self.sync.held()
        self.grad_bytes = max(self.grad_bytes, storage_bytes(held))

    # -- what it holds

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, by category (`parcourse.export.memory`)."""
        return memory(self)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit GPT's state dict, fp32, on every rank (`parcourse.export`)."""
        return full_state_dict(self)


_PLANNED = ("cp_method", "schedule", "microbatches", "chunks", "sequence_parallel", "zero")

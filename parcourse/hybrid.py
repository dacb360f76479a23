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

The step owns no strategy of its own: ZeRO over dp is `parcourse.zero.stages` (the
course's flat units, driven at the moments the schedule gives), clipping is
`parcourse.zero.clip`'s norm over the groups that split the gradients. One file, read top
to bottom in the order of a step (build, step, finalize the gradients, clip), then what it
reports (reductions, memory, the whole state dict).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parcourse.comm import Comm, Network, Topology
from parcourse.context_parallel import SequenceShard, context_parallel
from parcourse.context_parallel.attention import Method
from parcourse.data import shard as shard_rows
from parcourse.data_parallel.bucketed import Bucket, make_buckets
from parcourse.experts import expert_parallel, expert_parameters, set_aux_scale, update_bias
from parcourse.memory import storage_bytes, tensors_in
from parcourse.mesh import ORDERS, Layout, Mesh
from parcourse.models import GPT, gpt_layers
from parcourse.pipeline.partition import partition
from parcourse.pipeline.runtime import PipelineRuntime
from parcourse.pipeline.simulate import SimulatedCompute
from parcourse.plan import ParallelPlan
from parcourse.tensor_parallel import apply_tensor_parallel, gpt_plan
from parcourse.tensor_parallel.comm import TPComm
from parcourse.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from parcourse.tensor_parallel.replicated import one_sum
from parcourse.tensor_parallel.state_dict import split_dims, whole_parameters
from parcourse.trace import Tracer
from parcourse.zero.clip import clip_counted_
from parcourse.zero.layout import FlatUnit
from parcourse.zero.stages import ShardedStages

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _stages_tied(stages: list[nn.Module]) -> list[dict[int, str]]:
    """Weights more than one stage uses (the embedding and the head), as PipelineRuntime's
    `tied`: {stage: the weight's name in that stage}."""
    where: dict[int, dict[int, str]] = {}
    for s, module in enumerate(stages):
        for name, p in module.named_parameters():
            where.setdefault(id(p), {})[s] = name
    return [group for group in where.values() if len(group) > 1]


class Hybrid:
    """The GPT on a `Mesh` of dp x tp x pp ranks; one per rank, all built alike. The model
    given is copied, and the copy split: the one passed stays whole, a one-process
    reference (as DDP leaves it), where torch's `parallelize_module` and `fully_shard`
    change it in place. `Hybrid.from_plan(model, mesh, plan)` takes the run's
    `ParallelPlan` (or its label) instead of the keywords it holds; both are checked by
    its `problems()`, in the words the planner and the CLI use.

    `schedule`: a name of `parcourse.pipeline.SCHEDULES`; `microbatches` per replica (each
    replica's share of the global batch is cut into them); `chunks`: stages per rank for
    interleaved 1F1B. `optimizer`: builds this rank's optimizer from its parameters (Adam,
    lr 1e-3, by default). `recompute`: activation checkpointing of each stage (GPipe's).
    `zero=1`: ZeRO-1 over dp (`parcourse.zero.stages`, lesson 03's flat units, one per
    stage): each replica steps its rows of every weight (1/dp of them: the optimizer gets
    one such shard per weight, so an elementwise optimizer equals one process's) and keeps
    their optimizer state only; gradients are reduce-scattered instead of all-reduced, and
    the stepped rows all-gathered. `zero=2`: the gradients sharded too (P_os+g): after
    each microbatch's backward of a stage, its gradients are reduce-scattered into this
    replica's shards (while the schedule goes on) and dropped, so a stage's full gradient
    never outlives one microbatch; the price is a reduce-scatter per microbatch instead of
    one per step (why DeepSpeed refuses ZeRO-2 with its pipeline engine). The tied
    embedding and head add up their gradient after the schedule, so theirs is reduced
    then. At this granularity (a stage, not a bucket) a rank still holds one stage's full
    gradient beside its shards, P/v + P/dp for v stages per rank against ZeRO-1's P: it
    pays only with several stages per rank and a wide dp (lesson 09 measures it).
    `zero=3`: the weights sharded too (lesson 04), as torchtitan runs FSDP inside a
    pipeline's stages: a stage's weights are all-gathered over dp before each of its
    actions (F, B, I or W of one microbatch) and freed after; gradients as ZeRO-2's.
    Without ZeRO, dp averages the gradients in lesson 02's buckets, each stage's started
    as soon as its last backward of the step is done (`bucket_mb`, 25 as DDP's).
    `max_norm`: clip the gradients by their global norm (over every axis that splits
    them), as `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` in one
    process; the norm before clipping is `grad_norm` after each step.
    `link`: a `SimulatedLink` or a two-level `Topology` (fast inside a node, slow between
    nodes) for every message of every axis. `compute`: a `SimulatedCompute`, the seconds
    of each stage's forward and backward of one microbatch (a list over the schedule's
    stages): the real math runs, then the rank waits out the rest, tensor parallelism's
    collectives on top (a GPU's time on a laptop: the planner's check, lesson 09).
    `seed`: dropout's; each pipeline stage and each data-parallel replica draws its own
    masks from it, the ranks of a tp group the same where their activation is whole.
    A mesh with a `cp` axis cuts every sequence over its ranks (context parallelism,
    `parcourse.context_parallel`: zigzag, two chunks a rank): each rank runs every layer
    on its tokens, attention over all of them by `cp_method` ("ring", "all-gather" or
    "ulysses", after tp has split the heads); its loss is weighed by its share of the
    sequence, and the gradients are averaged over dp and cp together (ZeRO shards over
    both), as Megatron-LM's cp_dp group.
    A GPT with experts (`GPTConfig(experts=...)`) on a mesh with an `ep` axis cuts each
    MoE layer's experts over ep's ranks (`parcourse.experts`: tokens dispatched to their
    experts' ranks and combined back by all-to-alls). ep's ranks take different rows of
    the batch, as dp's do: the dense weights are averaged over dp x ep (x cp), each
    expert's gradient, which holds every token of its ep group that chose it, over the
    ranks holding the same experts (dp x cp), both divided by all the replicas; ZeRO
    shards each over its own group. The experts stay whole on every tp rank. Their
    balancing losses are weighed as each microbatch's loss is, and a balancing bias moves
    from the token counts of all replicas before each optimizer step.
    """

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
    ) -> None:
        config = model.config
        self.mesh, self.config, self.microbatches = mesh, config, microbatches
        self.sequence_parallel = sequence_parallel
        tp = mesh.size("tp")
        # The run's one plan record, checked by the same rules as the planner and the CLI.
        shape = {
            "dp": mesh.size("dp"),
            "tp": tp,
            "pp": mesh.size("pp"),
            "cp": mesh.size("cp"),
            "ep": mesh.size("ep"),
        }
        order = next((o for o in ORDERS if Layout.of(shape, o) == mesh.layout), "megatron")
        self.parallel_plan = ParallelPlan(
            **shape,
            cp_method=cp_method,
            schedule=schedule,
            microbatches=microbatches,
            chunks=chunks,
            zero=zero,
            sequence_parallel=sequence_parallel,
            recompute="full" if recompute else "none",
            order=order,
            ranks_per_node=mesh.ranks_per_node,  # type: ignore[arg-type]
        ).check(config, world=mesh.layout.world_size)
        if isinstance(link, Topology) and mesh.ranks_per_node not in (None, link.ranks_per_node):
            raise ValueError(
                f"the mesh says {mesh.ranks_per_node} ranks per node, the "
                f"simulated network {link.ranks_per_node}"
            )
        self.plan = self.parallel_plan.schedule_value()
        # The model given stays whole (a one-process reference, as DDP leaves it): the
        # split is made on a copy.
        model = copy.deepcopy(model)

        def on(axis: str) -> Tracer | None:  # what each axis records says which axis
            return tracer.tagged(axis=axis) if tracer is not None else None

        # On a simulated network every axis runs the course's ring, which the link slows;
        # dp's gradients go over the ring on gloo anyway (it counts the bytes it sends).
        self.tp_comm = TPComm(
            Comm(
                mesh.group("tp"),
                tracer=on("tp"),
                link=link,
                algorithm="ring" if link is not None else "torch",
            )
        )
        # The ranks that hold the same weights and average their gradients: dp's, and with
        # the sequence cut over cp, cp's with them (Megatron-LM's cp_dp group), and ep's
        # (each with its own rows) for every weight but the experts.
        self.replicas = mesh.size("dp") * mesh.size("cp") * mesh.size("ep")
        self.dp_comm = Comm(
            mesh.group(*self._replica_axes), tracer=on("dp"), link=link, algorithm="auto"
        )
        # Dropout: each pipeline stage (as Megatron offsets its seed by 100 a stage) and
        # each data-parallel replica (which sees other rows) draws its own masks; the
        # ranks of a tp group agree where the activation is replicated (RNGTracker).
        self.model = apply_tensor_parallel(
            model,
            gpt_plan(config.experts),
            mesh.group("tp"),
            sequence_parallel=sequence_parallel,
            comm=self.tp_comm.comm,
            seed=seed + 100 * mesh.coordinate("pp") + 10007 * mesh.coordinate("dp"),
        )
        # Experts: each MoE layer's cut over ep (its ranks' tokens dispatched to them); the
        # ranks holding the same experts average their gradients (dp's and cp's).
        ep = mesh.size("ep")
        if ep > 1 and compute is not None:
            raise ValueError(
                "simulated compute pads each action with tp's collectives on top; "
                "ep's all-to-alls inside the MoE layers would be padded away as "
                "compute: run ep with its compute real"
            )
        if ep > 1:
            expert_parallel(
                self.model, Comm(mesh.group("ep"), tracer=on("ep"), link=link, algorithm="auto")
            )
        set_aux_scale(self.model, 1 / microbatches)  # as each microbatch's loss is weighed
        self._experts = {id(p) for p in expert_parameters(self.model)} if ep > 1 else set()
        self.expert_comm = (
            Comm(
                mesh.group(*self._expert_replica_axes), tracer=on("dp"), link=link, algorithm="auto"
            )
            if self._experts
            else None
        )
        cut = partition(gpt_layers(self.model), self.plan.stages)
        # Context parallelism: each rank runs every layer on its tokens of the sequence,
        # attention over all of them by the plan's method (`parcourse.context_parallel`).
        self.shard: SequenceShard | None = None
        if mesh.size("cp") > 1 and compute is not None:
            raise ValueError(
                "simulated compute pads each action with tp's collectives on top; "
                "cp's messages inside attention would be padded away as compute: "
                "run cp with its compute real"
            )
        if mesh.size("cp") > 1:
            self.shard = SequenceShard(
                mesh.group("cp"),
                cp_method,
                comm=Comm(mesh.group("cp"), tracer=on("cp"), link=link, algorithm="auto"),
            )
            context_parallel(cut, self.shard)
        stage = mesh.coordinate("pp")
        mine = {s: cut[s] for s, r in enumerate(self.plan.stage_rank) if r == stage}
        tied_groups = _stages_tied(cut)  # {stage: name} of each weight several stages share
        self.zero = zero
        self.runtime = PipelineRuntime(
            self.plan,
            mine,
            None,
            self._loss,
            tracer=tracer,
            recompute=recompute,
            tied=tied_groups,
            comm=Comm(mesh.group("pp"), tracer=on("pp"), link=link, algorithm="auto"),
            on_weight_gradients=self._reduce_stage
            if zero >= 2
            else None
            if zero
            else self._reduce_buckets,
            around=self._gathered_for if zero == 3 else None,
            # simulated compute pads each action, tp's
            # collectives on top, met at their share
            compute=compute,
            paced=self.tp_comm.comm if tp > 1 else None,
            together=one_sum if sequence_parallel else None,
        )
        self.first = stage in self.plan.entry_ranks  # given the inputs
        self.last = stage in self.plan.exit_ranks  # given the targets; the loss is here
        self.params = list({id(p): p for m in mine.values() for p in m.parameters()}.values())
        factory = optimizer or (lambda ps: torch.optim.Adam(ps, lr=1e-3))
        self.sharded: ShardedStages | None = None
        self._stage_units: dict[int, list[FlatUnit]] = {}
        # What dp reduces together: each stage's weights, and the tied ones apart (their
        # gradient is whole only after the schedule, when the pipeline has added it up).
        # (stage None: the tied weights), a frozen weight in none: nothing reduces or steps it
        tied = {id(cut[s].get_parameter(name)) for g in tied_groups for s, name in g.items()}
        seen: set[int] = set()
        # A stage's experts (cut over ep) apart from its other weights: another group
        # averages them.
        units: dict[int | None, list[nn.Parameter]] = {}
        expert_units: dict[int, list[nn.Parameter]] = {}
        for s in sorted(mine):
            held = [
                p
                for p in mine[s].parameters()
                if p.requires_grad and id(p) not in tied and id(p) not in seen
            ]
            seen.update(id(p) for p in held)
            units[s] = [p for p in held if id(p) not in self._experts]
            expert_units[s] = [p for p in held if id(p) in self._experts]
        units[None] = [p for p in self.params if id(p) in tied and p.requires_grad]
        # Without ZeRO: lesson 02's buckets (`data_parallel.bucketed`), a stage's all-reduced
        # as soon as its last backward of the step is done, while the schedule goes on.
        self._buckets: dict[int | None, list[Bucket]] = {}
        self._expert_buckets: set[int] = set()
        if not zero and self.replicas > 1:
            self._buckets = {
                s: make_buckets(ps, bucket_mb) if ps else [] for s, ps in units.items()
            }
            for s, ps in expert_units.items():
                made = make_buckets(ps, bucket_mb) if ps else []
                self._expert_buckets.update(id(b) for b in made)
                self._buckets[s] = self._buckets[s] + made
            backward = [a for a in self.plan.actions[stage] if a.kind in ("B", "W")]
            self._last_backward = {a.stage: (a.stage, a.microbatch) for a in backward}
        if zero:
            keys: list[Any] = [*units, *(("experts", s) for s in expert_units)]
            lists = [*units.values(), *expert_units.values()]
            comms = [self.dp_comm] * len(units) + [self.expert_comm or self.dp_comm] * len(
                expert_units
            )
            self.sharded = ShardedStages(
                lists,
                self.dp_comm,
                factory,
                stage=zero,  # type: ignore[arg-type]
                comms=comms,
                mean_over=self.replicas,
            )
            made = iter(self.sharded.units)  # one for each list that holds a weight, in order
            unit_of = {k: next(made) for k, ps in zip(keys, lists) if ps}
            self._tied_unit = unit_of.pop(None, None)
            self._stage_units = {
                s: [u for u in (unit_of.get(s), unit_of.get(("experts", s))) if u is not None]
                for s in mine
            }
            # ZeRO-3: the units each stage's actions need whole (its own, and the tied
            # weights' where it holds one of them)
            holds_tied = {s for g in tied_groups for s in g if s in mine}
            self._uses = {
                s: [
                    *self._stage_units[s],
                    *([self._tied_unit] if s in holds_tied and self._tied_unit else []),
                ]
                for s in mine
            }
        self.optimizer = self.sharded.optimizer if self.sharded else factory(self.params)
        self._frozen = self._frozen_now()
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        self.max_norm, self.grad_norm, self.grad_bytes = max_norm, None, 0
        if max_norm is not None:
            # Each gradient element counted once over the mesh: a weight left whole on
            # every tp rank only on tp rank 0, a tied weight only on its first stage.
            split = split_dims(self.model)
            tied_owner = {id(cut[min(g)].get_parameter(g[min(g)])): min(g) for g in tied_groups}
            # Without ZeRO a dense weight's gradient is the same on every ep rank (counted
            # on the first), each expert's on the one ep rank that holds it.
            ep_first = self.mesh.size("ep") == 1 or mesh.coordinate("ep") == 0
            self._counted = [
                float(
                    (id(p) in split or mesh.coordinate("tp") == 0)
                    and tied_owner.get(id(p), min(mine)) in mine
                    and (zero or ep_first or id(p) in self._experts)
                )
                for p in self.params
            ]
            # The norm's group: the ranks whose gradients differ (Megatron's model-parallel
            # group, with ep's holding other experts), and dp too when each replica holds a
            # different slice.
            self._norm_group = mesh.group(*self._norm_axes)

    @classmethod
    def from_plan(cls, model: GPT, mesh: Mesh, plan: ParallelPlan | str, **kwargs: Any) -> Hybrid:
        """`Hybrid` for a `ParallelPlan` (or its label, 'dp2 tp2 pp2 1f1b m4 ZeRO-1') on a
        mesh laid out as the plan says; `kwargs`: what the plan does not hold (optimizer,
        max_norm, link, compute, tracer, seed)."""
        plan = ParallelPlan.parse(plan) if isinstance(plan, str) else plan
        held = sorted(
            set(kwargs)
            & {
                "cp_method",
                "schedule",
                "microbatches",
                "chunks",
                "sequence_parallel",
                "recompute",
                "zero",
            }
        )
        if held:
            raise ValueError(
                f"{', '.join(held)}: given by the plan ({plan.label()}), not beside it"
            )
        plan.check(model.config, world=mesh.layout.world_size)
        want = Layout.of(plan.shape, plan.order)
        if want != mesh.layout:
            raise ValueError(
                f"the plan {plan.label()} lays ranks out as {want.axes} "
                f"{want.sizes}, the mesh as {mesh.layout.axes} "
                f"{mesh.layout.sizes}"
            )
        if plan.ranks_per_node != mesh.ranks_per_node:
            raise ValueError(
                f"the plan says {plan.ranks_per_node} ranks per node, the mesh "
                f"{mesh.ranks_per_node}"
            )
        return cls(
            model,
            mesh,
            cp_method=plan.cp_method,
            schedule=plan.schedule,
            microbatches=plan.microbatches,
            chunks=plan.chunks,
            sequence_parallel=plan.sequence_parallel,
            recompute=plan.recompute == "full",
            zero=plan.zero,  # type: ignore[arg-type]
            **kwargs,
        )

    def _gathered_for(self, action: Any) -> AbstractContextManager[None]:
        """ZeRO-3: the stage's weights gathered over dp for one action (F, B, I or W of
        one microbatch), freed after it, as torchtitan runs FSDP inside a pipeline's
        stages: between actions a rank holds its 1/dp shards only."""
        return self._gathered(self._uses[action.stage])

    def whole_weights(self) -> AbstractContextManager[None]:
        """Every weight of this rank whole inside the block (ZeRO-3 gathers them over dp,
        and frees them after): what exports and checkpoints read and write. A no-op for
        the other stages, whose weights are always whole."""
        return self._gathered(self.sharded.units if self.zero == 3 else [])  # type: ignore[union-attr]

    @contextlib.contextmanager
    def _gathered(self, units: list[FlatUnit]) -> Iterator[None]:
        for unit in units:
            self.sharded.gather(unit)  # type: ignore[union-attr]
        try:
            yield
        finally:
            for unit in units:
                unit.free()

    @property
    def replica(self) -> tuple[int, int]:
        """(this rank's replica, how many there are): which rows of each global batch it
        takes. dp's coordinate and, inside it, ep's (whose ranks take their own rows); the
        ranks of tp, pp and cp in one replica take the same."""
        ep = self.mesh.size("ep")
        return (
            self.mesh.coordinate("dp") * ep + self.mesh.coordinate("ep"),
            self.mesh.size("dp") * ep,
        )

    @property
    def _replica_axes(self) -> tuple[str, ...]:
        return ("dp", *(a for a in ("ep", "cp") if self.mesh.size(a) > 1))

    @property
    def _norm_axes(self) -> tuple[str, ...]:
        """The ranks over which the gradient norm's squares are summed."""
        if self.zero:
            return (*self._replica_axes, "tp", "pp")
        return ("tp", "pp", *(("ep",) if self._experts else ()))

    @property
    def _expert_replica_axes(self) -> tuple[str, ...]:
        return ("dp", "cp") if self.mesh.size("cp") > 1 else ("dp",)

    def _frozen_now(self) -> set[int]:
        return {id(p) for p in self.params if not p.requires_grad}

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross entropy from this rank's vocabulary shard of the logits (the same value on
        every tp rank), as one process computes it from the whole logits; under context
        parallelism weighed by this rank's share of the sequence (`loss_scale`), so that
        the mean over the cp ranks is the whole sequence's."""
        if self.tp_comm.size == 1:
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        else:
            loss = vocab_parallel_cross_entropy(
                logits, targets, self.tp_comm.group, self.config.vocab, comm=self.tp_comm
            )
        return loss if self.shard is None else loss * self.shard.loss_scale()

    # -- one training step

    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor, *, local: bool = False
    ) -> float | None:
        """One optimizer step on the global batch (the same tensors on every rank; each
        replica takes its rows), or with `local=True` on this replica's rows only (what a
        sharded loader gives it; every replica the same number; the ranks of one replica,
        its cp ranks included, the same rows: a loader sharded by dp coordinate, not by
        rank). Returns the global
        batch's mean loss on the ranks of the last stage, None elsewhere."""
        replica, dp = self.replica
        if local and inputs.shape[0] % self.microbatches:
            raise ValueError(
                f"this replica's {inputs.shape[0]} rows cannot be cut into "
                f"{self.microbatches} equal microbatches"
            )
        if not local:
            self.parallel_plan.check(batch=inputs.shape[0])
        if self.sharded is not None and self._frozen_now() != self._frozen:
            raise ValueError(
                "weights were frozen or unfrozen after Hybrid(zero=...) was "
                "made: ZeRO's flat slices hold the weights that were trainable "
                "then. Set requires_grad before making it (as FSDP asks)."
            )
        if self._buckets and self._frozen - self._frozen_now():  # a frozen one is skipped
            raise ValueError(
                "weights were unfrozen after Hybrid was made: dp's buckets hold "
                "the weights that were trainable then. Set requires_grad before "
                "making it (as DDP asks)."
            )
        x = (inputs if local else shard_rows(inputs, replica, dp)) if self.first else None
        y = (targets if local else shard_rows(targets, replica, dp)) if self.last else None
        if self.shard is not None:  # this rank's tokens of each sequence
            if inputs.shape[1] > self.config.block_size:
                raise ValueError(
                    f"sequences of {inputs.shape[1]} tokens, longer than "
                    f"block_size {self.config.block_size}"
                )
            self.shard.tokens = inputs.shape[1]  # every rank's attention needs it
            x = self.shard.cut(x) if x is not None else None
            y = self.shard.cut(y) if y is not None else None
        self.grad_bytes = 0
        loss = self.runtime.step(x, y)  # and the tied weights' gradients added up
        self.finalize_gradients()
        for module in self.runtime.stages.values():  # experts' balancing bias, from every
            update_bias(module, self.dp_comm)  # replica's token counts (before the step)
        if self.sharded is not None:
            self.sharded.step()  # step this rank's slices, all-gather the slices
        else:
            self.optimizer.step()
        for p in self.params:
            p.grad = None
        if loss is None:
            return None
        mean = torch.tensor([loss / self.replicas])
        dist.all_reduce(mean, group=self.dp_comm.group)  # the replicas' losses, averaged
        return mean.item()

    def finalize_gradients(self) -> None:
        """What happens to the gradients between the schedule and the optimizer, in
        Megatron-LM's order (`finalize_model_grads`). Before it: under sequence
        parallelism the replicated (LayerNorm) gradients were summed over tp in backward,
        and the pipeline runtime added up the tied embedding's and head's gradients over
        the first and last stage at the end of its schedule. Here:

        1. dp: every gradient averaged over the data-parallel group: without ZeRO by
           lesson 02's buckets, a stage's all-reduced since its last backward of the step
           (here the tied weights', then waiting for them all); under ZeRO-1 a
           reduce-scatter per stage instead, each replica keeping its shards; under ZeRO-2
           and 3 only the tied weights' (the stages' went in backward), then waiting for
           the reduce-scatters still in flight.
        2. if `max_norm`: the global gradient norm over tp and pp (and dp under ZeRO), and
           every gradient scaled by min(1, max_norm / norm), as
           `torch.nn.utils.clip_grad_norm_` does in one process (`self.grad_norm`).
        """
        if self.sharded is not None:
            self.sharded.collect()  # ZeRO-2: the last stage's reduction, still in flight
        self._note_grad_bytes()
        if self.sharded is not None:
            if self.zero == 1:
                for unit in self.sharded.units:
                    self.sharded.reduce(unit)
            elif self._tied_unit is not None:  # ZeRO-2: the stages' are on their way; after
                self.sharded.reduce(self._tied_unit, async_op=True)  # them on the one thread
            self.sharded.collect()
        elif self._buckets:
            # A frozen weight is in no bucket and keeps no gradient (None, so the optimizer
            # skips it, weight decay included); one unused on this replica counts as zeros
            # in the mean, one unused on every replica keeps none, as in one process.
            for buckets in self._buckets.values():
                for bucket in buckets:
                    if bucket.done is None:  # the tied weights' (and, in a step cut short,
                        self._launch(bucket)  # any not launched yet)
            for buckets in self._buckets.values():
                for bucket in buckets:
                    assert bucket.done is not None
                    bucket.done.result()
                    bucket.done = None
                    bucket.unpack(self.replicas)
        if self.max_norm is not None:
            self.grad_norm = self._clip(self.max_norm)

    def _reduce_buckets(self, stage: int, microbatch: int) -> None:
        """Without ZeRO: after a stage's last backward of the step its gradients are whole,
        and its buckets' all-reduces start while the rank's other actions run."""
        if self._buckets and self._last_backward.get(stage) == (stage, microbatch):
            for bucket in self._buckets[stage]:
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.pack()  # an expert bucket over the ranks holding the same experts
        comm = self.expert_comm if id(bucket) in self._expert_buckets else self.dp_comm
        bucket.done = comm.all_reduce(bucket.buffer, async_op=True)  # type: ignore[union-attr]

    def _reduce_stage(self, stage: int, microbatch: int) -> None:
        """ZeRO-2: a microbatch's gradients of `stage` reduce-scattered into this replica's
        slice while the schedule goes on, and dropped here."""
        assert self.sharded is not None
        self.sharded.collect()  # the one before (done by now, most often): its buffer goes
        self._note_grad_bytes()
        for unit in self._stage_units.get(stage, []):
            self.sharded.reduce(unit, async_op=True)

    def _note_grad_bytes(self) -> None:
        """The gradients held now (full ones and slices), if more than before this step."""
        held = [p.grad for p in self.params if p.grad is not None]
        if self.sharded is not None:
            held += self.sharded.in_flight()
            held += [sp.grad for sp in self.sharded.shard_params if sp.grad is not None]
        self.grad_bytes = max(self.grad_bytes, storage_bytes(held))

    def _clip(self, max_norm: float) -> float:
        """Scale every gradient so that their norm over the whole model is at most
        `max_norm`; the norm before (`zero.clip.clip_counted_`: each element counted once
        over the norm's group, `_counted`; under ZeRO this rank's shards of the weights)."""
        counted = {id(p): bool(w) for p, w in zip(self.params, self._counted)}
        if self.sharded is not None:
            grads = [
                (sp.grad, counted[id(p)])
                for u in self.sharded.units
                for p, sp in zip(u.params, u.shard_params)
                if sp.grad is not None
            ]
        else:
            grads = [(p.grad, counted[id(p)]) for p in self.params if p.grad is not None]
        return float(clip_counted_(grads, self._norm_group, max_norm))

    def reductions(self) -> list[dict[str, Any]]:
        """What each group of this rank does to the numbers in one step, in the order it
        happens, as this model is built (sequence parallel or not, ZeRO-1 or not,
        clipping or not, the tied weights cut apart or not): rows of {"when", "what",
        "axis", "op", "ranks"} (`ranks`: this rank's group). Lesson 09's table."""
        sp, zero = self.sequence_parallel, self.sharded is not None
        tp, pp, cp = (self.mesh.ranks(a) for a in ("tp", "pp", "cp"))
        # the replicas: dp's ranks, and cp's with them when the sequence is cut
        replicas, dp = "-".join(self._replica_axes), self.mesh.ranks(*self._replica_axes)
        rows = []

        def row(when: str, what: str, axis: str, op: str, ranks: list[int]) -> None:
            if len(ranks) > 1:
                rows.append({"when": when, "what": what, "axis": axis, "op": op, "ranks": ranks})

        row(
            "forward",
            "the token embedding's vocabulary shards",
            "tp",
            "all-reduce (sum)" if not sp else "reduce-scatter (sum) along the sequence",
            tp,
        )
        row(
            "forward",
            "the row-parallel layers' partial outputs (attention out, MLP down)",
            "tp",
            "reduce-scatter (sum) along the sequence" if sp else "all-reduce (sum)",
            tp,
        )
        if sp:
            row(
                "forward",
                "the sequence chunks entering attention and the MLP",
                "tp",
                "all-gather",
                tp,
            )
        if self.shard is not None:
            attention = {
                "ring": "send / recv round the ring (no sum)",
                "all-gather": "all-gather",
                "ulysses": "all-to-all, to a head cut and back",
            }[self.shard.method]
            row(
                "forward",
                "attention's keys and values, every block of the sequence",
                "cp",
                attention,
                cp,
            )
        ep = self.mesh.ranks("ep") if self._experts else []
        row(
            "forward",
            "each MoE layer's tokens to their experts' ranks (after the counts), "
            "and the outputs back",
            "ep",
            "all-to-all, there and back (no sum)",
            ep,
        )
        row("forward", "activations, stage to stage", "pp", "send / recv (no sum)", pp)
        row(
            "loss",
            "the logits' max, sum of exps and target logit (vocabulary-parallel cross entropy)",
            "tp",
            "all-reduce (max, sum)",
            tp,
        )
        row(
            "backward",
            "the column-parallel layers' input gradients (qkv, MLP up)",
            "tp",
            "reduce-scatter (sum) along the sequence" if sp else "all-reduce (sum)",
            tp,
        )
        if sp:
            row(
                "backward",
                "the LayerNorm weights' gradients (each rank saw its chunk)",
                "tp",
                "all-reduce (sum)",
                tp,
            )
        if self.shard is not None:
            back = {
                "ring": "K and V round the ring again, their gradients with them, home "
                "(send / recv, summed on the way)",
                "all-gather": "reduce-scatter (sum) to each block's owner",
                "ulysses": "all-to-all, to a head cut and back",
            }[self.shard.method]
            row("backward", "attention's keys' and values' gradients", "cp", back, cp)
        row(
            "backward",
            "the combine's and the dispatch's gradients, the other way",
            "ep",
            "all-to-all, there and back (no sum)",
            ep,
        )
        row("backward", "activations' gradients, stage to stage", "pp", "send / recv (no sum)", pp)
        if self.zero == 3:
            row(
                "forward and backward",
                "a stage's weights, before each of its actions (freed after it)",
                replicas,
                "all-gather",
                dp,
            )
        if self.zero >= 2:
            row(
                "backward",
                "a stage's gradients, after each microbatch's backward of it",
                replicas,
                "reduce-scatter (mean) into a slice each, while the schedule goes on",
                dp,
            )
        if self.runtime.tied:
            embedding = next(
                (g for g in self.mesh.layout.embedding_groups() if self.mesh.local_rank in g), []
            )
            row(
                "end of schedule",
                "the tied embedding's and head's gradients",
                "embedding",
                "sum over the first and last stage",
                embedding,
            )
        if self.zero >= 2:
            row(
                "finalize 1",
                "the tied weights' gradients (the rest went in backward)",
                replicas,
                "reduce-scatter (mean): a slice each",
                dp,
            )
        elif zero:
            row("finalize 1", "every gradient", replicas, "reduce-scatter (mean): a slice each", dp)
        else:
            row(
                "finalize 1",
                "every gradient, in buckets: the tied weights' start here, each "
                "stage's started after its last backward" + (", the experts' apart" if ep else ""),
                replicas,
                "all-reduce (mean)",
                dp,
            )
        if ep:
            copies = self._expert_replica_axes
            row(
                "finalize 1",
                "each expert's gradient, over the ranks holding the same experts",
                "-".join(copies),
                "reduce-scatter (mean over every replica)"
                if zero
                else "all-reduce (mean over every replica)",
                self.mesh.ranks(*copies),
            )
        if self.max_norm is not None:
            axes = self._norm_axes
            row(
                "finalize 2",
                "the squared gradient norm (each element once)",
                "-".join(axes),
                "all-reduce (sum)",
                self.mesh.ranks(*axes),
            )
        if zero and self.zero < 3:
            row(
                "after the step", "the updated slices of the parameters", replicas, "all-gather", dp
            )
        row("report", "the replicas' losses", replicas, "all-reduce (mean)", dp)
        return rows

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, by category: its parameters, its gradients as the
        schedule left them (their peak, before the dp reduction; `grad_bytes`, 0 before
        the first step), the optimizer's state (under ZeRO-1 and 2 with the slices it
        steps; under ZeRO-3 those are the weights it keeps, between two actions) and,
        when traced, the peak of the activations kept for backward over the last step
        (0 otherwise: they are counted only when measuring). Comparable with
        `theory.mesh_bytes` and the planner."""
        optimizer = storage_bytes(tensors_in(list(self.optimizer.state.values())))
        params = storage_bytes(self.params)  # ZeRO-3's freed weights hold none
        if self.zero == 3:  # the shards are the weights this rank keeps (P/dp); under
            assert self.sharded is not None  # ZeRO-1 and 2 they are views of the whole ones
            params += storage_bytes(u.master for u in self.sharded.units)
        return {
            "params": params,
            "grads": self.grad_bytes,
            "optimizer": optimizer,
            "activations": self.runtime.peak_in_flight_bytes,
        }

    # -- export

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsplit GPT's state dict (same keys, fp32 values), on every rank: each
        stage's parameters gathered over tp, then every stage's over pp (replicas are
        equal)."""
        with self.whole_weights():
            mine = whole_parameters(self.model, self.tp_comm.group, only=self.params)
            if self._experts:  # each rank of an ep group holds its slice of the experts
                mine.update(self._whole_experts())
        # this rank's stages' buffers (a balancing bias moves only where its layer runs)
        stage_buffers = {id(b) for m in self.runtime.stages.values() for b in m.buffers()}
        kept = self.model.state_dict().keys()
        mine.update(
            {
                name: b.detach().cpu().clone()
                for name, b in self.model.named_buffers()
                if id(b) in stage_buffers and name in kept
            }
        )
        stages: list[Any] = [None] * self.mesh.size("pp")
        dist.all_gather_object(
            stages, {k: v.cpu() for k, v in mine.items()}, group=self.mesh.group("pp")
        )
        state: dict[str, torch.Tensor] = {}
        for part in stages:
            state.update(part)
        buffers = {name: b.detach().cpu().clone() for name, b in self.model.named_buffers()}
        return {k: state[k] if k in state else buffers[k] for k in self.model.state_dict()}

    def _whole_experts(self) -> dict[str, torch.Tensor]:
        """This stage's experts, every ep rank's slice gathered (in rank order, as
        `expert_parallel` cut them)."""
        group, size = self.mesh.group("ep"), self.mesh.size("ep")
        out = {}
        for name, p in self.model.named_parameters():
            if id(p) in self._experts and any(p is q for q in self.params):
                parts = [torch.empty_like(p) for _ in range(size)]
                dist.all_gather(parts, p.detach().contiguous(), group=group)
                out[name] = torch.cat(parts).cpu()
        return out


def bytes_by_axis(counters: Any) -> dict[str, float]:
    """Bytes sent per mesh axis, from a trace's counters (`bytes_sent`, counted message by
    message where the course's own ring and messenger carry them: pp and dp; tp's
    collectives are torch's and counted by their tensors' sizes in `tp_collective`)."""
    out: dict[str, float] = {}
    for c in counters:
        if c.name == "bytes_sent" and "axis" in c.meta:
            out[c.meta["axis"]] = out.get(c.meta["axis"], 0.0) + c.value
    return out

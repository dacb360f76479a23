"""ZeRO for a pipeline's stages: the entry point the 3D step (`parcourse.hybrid`) uses.

`ZeroStage1..3` wrap one module and act on their own, from its hooks: gather before its
forward, reduce when its backward ends. Inside a pipeline a rank runs its stages one
microbatch at a time, in the order the schedule says, and a step ends only when the
schedule does; so here the same flat units (layout.py: this rank's rows of every weight,
the buffers that travel) are driven by the caller instead, at the moments the schedule
gives:

- `reduce(unit)`: the unit's gradients reduce-scattered over the data-parallel group into
  this rank's shards (`shard_params[i].grad`, added to what earlier microbatches put
  there), and the full gradients dropped. ZeRO-1 calls it once per unit after the
  schedule; ZeRO-2 and 3 after each microbatch's backward of a stage (`async_op`: while
  the schedule goes on, one at a time; `collect` waits);
- `gather(unit)` (ZeRO-3), and the unit's own `free()`: its weights whole for one action
  of the stage, then gone (torchtitan composes FSDP with a pipeline the same way);
- `step()`: the optimizer steps this rank's shards; under ZeRO-1 and 2 the stepped rows are
  all-gathered into the weights (stage 3 gathers at the next use).

The 3D step builds it with `for_stages` and drives it at the moments of a schedule, with
the same calls as lesson 02's buckets (`parcourse.data_parallel.stages.BucketedStages`:
`on_weight_gradients`, `around`, `finalize`, `step`, `gradients`, `held`,
`whole_weights`; their module says when each is called).

One unit per stage, and one for the weights several stages share (a GPT's tied embedding
and head, whose gradient the pipeline adds up over its stages only after the schedule).
A unit may have a group of its own (`comms`): a stage's experts, cut over ep, are sharded
over the ranks that hold the same experts, the rest over all data-parallel ranks; `mean_over`
then says what a gradient is divided by (the data-parallel replicas, for both).
The optimizer holds `shard_params`: one tensor per weight (its rows here), so parameter
groups and per-weight settings work as on the whole model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from torch import nn

from parcourse.comm import Comm, Pending
from parcourse.data_parallel.stages import StageWeights, SyncGroups
from parcourse.zero.layout import FlatUnit

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class ShardedStages:
    """`ShardedStages(units, comm, optimizer, stage=1)`: ZeRO `stage` over `comm`'s group
    (the data-parallel ranks) for the parameters in `units` (lists of trainable
    parameters, each list one unit). `optimizer` builds the optimizer from the shards.
    `comms`: a group for each unit instead (None: `comm`); `mean_over`: what a summed
    gradient is divided by (None: its unit's group size); `replicate`: the group across
    which every slice is summed once a step, after the reduce-scatters (HSDP: the shards
    replicated over it, `sum_replicas`; None: none). `compute_dtype` (bf16, fp16): the
    weights, their gradients and the messages 16-bit, the optimizer's shards fp32
    masters, each slice's gradient cast to fp32 once reduced (mixed_precision.py)."""

    def __init__(
        self,
        units: list[list[nn.Parameter]],
        comm: Comm,
        optimizer: OptimizerFactory,
        stage: Literal[1, 2, 3] = 1,
        comms: list[Comm] | None = None,
        mean_over: int | None = None,
        replicate: Comm | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        if comms is not None and len(comms) != len(units):
            raise ValueError(f"{len(comms)} comms for {len(units)} units")
        self.comm, self.stage, self.mean_over = comm, stage, mean_over
        self.replicate, self.compute_dtype = replicate, compute_dtype
        kept = [(params, comms[i] if comms else comm) for i, params in enumerate(units) if params]
        self.units = [
            FlatUnit(
                i, params, c.rank, c.size, compute_dtype=compute_dtype, sharded_weights=stage == 3
            )
            for i, (params, c) in enumerate(kept)
        ]
        self._comm = {id(u): c for u, (_, c) in zip(self.units, kept)}
        self.shard_params = [sp for u in self.units for sp in u.shard_params]
        self.optimizer = optimizer(self.shard_params)
        self._in_flight: list[tuple[FlatUnit, Pending, torch.Tensor]] = []
        self._slices: dict[int, torch.Tensor] = {}  # each unit's gradient slice, this step
        if stage == 3:
            for unit in self.units:
                unit.free()
        # What `for_stages` sets: the units of each stage, the tied weights' unit, the
        # units each stage's actions need whole (ZeRO-3), and what was frozen then.
        self.stage_units: dict[int, list[FlatUnit]] = {}
        self.tied_unit: FlatUnit | None = None
        self.uses: dict[int, list[FlatUnit]] = {}
        self.note: Callable[[], None] = lambda: None
        self._params: list[nn.Parameter] = []
        self._frozen: set[int] = set()

    @classmethod
    def for_stages(
        cls,
        weights: StageWeights,
        params: list[nn.Parameter],
        groups: SyncGroups,
        optimizer: OptimizerFactory,
        stage: Literal[1, 2, 3],
        holds_tied: set[int],
        note: Callable[[], None] = lambda: None,
        compute_dtype: torch.dtype | None = None,
    ) -> ShardedStages:
        """ZeRO `stage` over a pipeline's stages: a unit for each stage's weights, one
        for the tied weights, one for each stage's experts (over their own group, in
        `groups`); `holds_tied`: the stages that use a tied weight (ZeRO-3 gathers it for
        them)."""
        keys: list[Any] = [*weights.dense, None, *(("experts", s) for s in weights.experts)]
        lists = [*weights.dense.values(), weights.tied, *weights.experts.values()]
        comm, expert_comm = groups.comm, groups.experts or groups.comm
        comms = [comm] * (len(weights.dense) + 1) + [expert_comm] * len(weights.experts)
        self = cls(
            lists, comm, optimizer, stage, comms, groups.mean_over, groups.replicate, compute_dtype
        )
        made = iter(self.units)  # one for each list that holds a weight, in order
        unit_of = {k: next(made) for k, ps in zip(keys, lists) if ps}
        self.tied_unit = unit_of.pop(None, None)
        self.stage_units = {
            s: [u for u in (unit_of.get(s), unit_of.get(("experts", s))) if u is not None]
            for s in weights.dense
        }
        tied = [self.tied_unit] if self.tied_unit is not None else []
        self.uses = {
            s: [*self.stage_units[s], *(tied if s in holds_tied else [])] for s in weights.dense
        }
        self.note, self._params = note, params
        self._frozen = {id(p) for p in params if not p.requires_grad}
        return self

    # -- the moments of a schedule (the 3D step's calls)

    def check(self) -> None:
        """Refuse a weight frozen or unfrozen after the flat units were made."""
        if {id(p) for p in self._params if not p.requires_grad} != self._frozen:
            raise ValueError(
                "weights were frozen or unfrozen after Hybrid(zero=...) was "
                "made: ZeRO's flat slices hold the weights that were trainable "
                "then. Set requires_grad before making it (as FSDP asks)."
            )

    @property
    def on_weight_gradients(self) -> Callable[[int, int], None] | None:
        """ZeRO-2 and 3 reduce a stage's gradients after each of its backward actions."""
        return self.after_backward if self.stage >= 2 else None

    def after_backward(self, stage: int, microbatch: int) -> None:
        """A microbatch's gradients of `stage` reduce-scattered into this replica's
        slice while the schedule goes on, and dropped here."""
        self.collect()  # the one before (done by now, most often): its buffer goes
        self.note()
        for unit in self.stage_units.get(stage, []):
            self.reduce(unit, async_op=True)

    @property
    def around(self) -> Callable[[Any], AbstractContextManager[None]] | None:
        """ZeRO-3: a stage's weights gathered over dp for one action (F, B, I or W of
        one microbatch), freed after it, as torchtitan runs FSDP inside a pipeline's
        stages: between actions a rank holds its 1/dp shards only."""
        return self._gathered_for if self.stage == 3 else None

    def _gathered_for(self, action: Any) -> AbstractContextManager[None]:
        return self._gathered(self.uses[action.stage])

    def finalize(self) -> None:
        """After the schedule: ZeRO-1 reduce-scatters every unit; ZeRO-2 and 3 only the
        tied weights' (the stages' went in backward), then wait for those in flight."""
        self.collect()  # ZeRO-2: the last stage's reduction, still in flight
        self.note()
        if self.stage == 1:
            for unit in self.units:
                self.reduce(unit)
        elif self.tied_unit is not None:  # the stages' are on their way; after them
            self.reduce(self.tied_unit, async_op=True)  # on the one thread
        self.collect()
        self.sum_replicas()

    def sum_replicas(self) -> None:
        """HSDP: each unit's slice, summed over the step's microbatches, summed once more
        across `replicate`'s ranks (the other copies of the same slice); a no-op without
        `replicate`."""
        if self.replicate is not None and self.replicate.size > 1:
            for unit in self.units:
                if (part := self._slices.get(id(unit))) is not None:
                    self.replicate.all_reduce(part)
        self._slices.clear()

    def gradients(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """This rank's slices of the gradients, with the weight each is of."""
        return [
            (sp.grad, p)
            for u in self.units
            for p, sp in zip(u.params, u.shard_params)
            if sp.grad is not None
        ]

    def held(self) -> list[torch.Tensor]:
        """The gradients held beyond the weights' own: in flight, and the slices."""
        return self.in_flight() + [sp.grad for sp in self.shard_params if sp.grad is not None]

    def whole_weights(self) -> AbstractContextManager[None]:
        """Every weight whole inside the block (ZeRO-3 gathers them, and frees them
        after); a no-op under ZeRO-1 and 2, whose weights are always whole. Under mixed
        precision the weights are the fp32 masters instead (`_masters_whole`)."""
        if self.compute_dtype is not None:
            return self._masters_whole()
        return self._gathered(self.units if self.stage == 3 else [])

    @contextlib.contextmanager
    def _masters_whole(self) -> Iterator[None]:
        """Every weight whole as its masters hold it (fp32, each unit's slices
        all-gathered over its group), in place of the 16-bit copy the stages compute
        with: what an export reads and a checkpoint writes. What is written into them
        inside the block (a load) reaches the masters by `load_weights`; after it, the
        16-bit weights (ZeRO-1 and 2) are cast from what the block left in them."""
        self.collect()
        held = []
        with torch.no_grad():
            for unit in self.units:
                flat = unit.gathered_masters(self.comm_of(unit).all_gather)
                held.append((unit, flat, [p.data for p in unit.params]))
                for p, view in zip(unit.params, unit.views(flat)):
                    p.data = view
        try:
            yield
        finally:
            with torch.no_grad():
                for unit, flat, views in held:
                    for p, view in zip(unit.params, views):
                        p.data = view
                    if unit.gathered():  # ZeRO-1 and 2: whole, cast from the masters
                        unit.full.copy_(flat)

    @contextlib.contextmanager
    def _gathered(self, units: list[FlatUnit]) -> Iterator[None]:
        for unit in units:
            self.gather(unit)
        try:
            yield
        finally:
            for unit in units:
                unit.free()

    # -- gradients

    @torch.no_grad()
    def reduce(self, unit: FlatUnit, async_op: bool = False) -> None:
        """The unit's gradients (a missing one: zeros) averaged over the group into this
        rank's shards; the full gradients dropped."""
        comm = self.comm_of(unit)
        parts = torch.empty(
            comm.size, unit.part_numel, dtype=unit.full.dtype, device=unit.full.device
        )
        unit.pack([p.grad for p in unit.params], parts)
        for p in unit.params:
            p.grad = None
        if async_op:
            self.collect()  # one at a time: the one before is added first
            self._in_flight.append(
                (unit, comm.reduce_scatter(parts.view(-1), async_op=True), parts)
            )
        else:
            self._add(unit, comm.reduce_scatter(parts.view(-1)))

    def comm_of(self, unit: FlatUnit) -> Comm:
        """The group `unit` is sharded over."""
        return self._comm[id(unit)]

    def _add(self, unit: FlatUnit, part: torch.Tensor) -> None:
        part = part.div_(self.mean_over or self.comm_of(unit).size)
        if all(sp.grad is None for sp in unit.shard_params):  # the first: one copy, viewed
            part = part.to(unit.dtype, copy=True)  # (the reduction's buffer is scratch;
            for i, sp in enumerate(unit.shard_params):  # fp32 under mixed precision)
                sp.grad = unit.shard_of(part, i)
            self._slices[id(unit)] = part  # what HSDP sums across its replicas
            return
        for i, sp in enumerate(unit.shard_params):
            piece = unit.shard_of(part, i)
            sp.grad = piece.to(unit.dtype, copy=True) if sp.grad is None else sp.grad.add_(piece)

    def collect(self) -> None:
        """Wait for every reduce-scatter in flight, in the order they started."""
        for unit, pending, _ in self._in_flight:
            self._add(unit, pending.result())
        self._in_flight.clear()

    def in_flight(self) -> list[torch.Tensor]:
        """The gradients' buffers still being reduced (memory accounting)."""
        return [parts for *_, parts in self._in_flight]

    # -- ZeRO-3: a unit's weights only while a stage uses them

    @torch.no_grad()
    def gather(self, unit: FlatUnit) -> None:
        """The unit's weights whole, from every rank's shard (an all-gather), written
        into the storage the weights view, which autograd's saved references share."""
        if unit.gathered():
            return
        self.collect()  # a reduce-scatter in flight on the same group goes first
        self._all_gather(unit)

    def _all_gather(self, unit: FlatUnit) -> None:
        part, whole = unit.gather_buffers()
        unit.fill(self.comm_of(unit).all_gather(part, whole))

    # -- the step

    @torch.no_grad()
    def step(self, optimizer_step: Callable[[], Any] | None = None) -> None:
        """Step this rank's shards (by `optimizer_step`, e.g. a loss scaler's, if given);
        under ZeRO-1 and 2 all-gather the stepped rows into the weights (under ZeRO-3 the
        next use gathers them)."""
        self.collect()
        (optimizer_step or self.optimizer.step)()
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage == 3:
            return
        for unit in self.units:
            self._all_gather(unit)

    # -- after a load

    @torch.no_grad()
    def load_weights(self) -> None:
        """After the weights were written whole (a load): each shard takes its rows."""
        for unit in self.units:
            if unit.master is not unit.full:
                unit.pack_part(
                    torch.cat([p.detach().reshape(-1) for p in unit.params]), unit.master
                )
            unit.gathered_version = -1

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

One unit per stage, and one for the weights several stages share (a GPT's tied embedding
and head, whose gradient the pipeline adds up over its stages only after the schedule).
A unit may have a group of its own (`comms`): a stage's experts, cut over ep, are sharded
over the ranks that hold the same experts, the rest over all data-parallel ranks; `mean_over`
then says what a gradient is divided by (the data-parallel replicas, for both).
The optimizer holds `shard_params`: one tensor per weight (its rows here), so parameter
groups and per-weight settings work as on the whole model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from parcourse.comm import Comm, Pending
from parcourse.zero.layout import FlatUnit

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class ShardedStages:
    """`ShardedStages(units, comm, optimizer, stage=1)`: ZeRO `stage` over `comm`'s group
    (the data-parallel ranks) for the parameters in `units` (lists of trainable
    parameters, each list one unit). `optimizer` builds the optimizer from the shards.
    `comms`: a group for each unit instead (None: `comm`); `mean_over`: what a summed
    gradient is divided by (None: its unit's group size)."""

    def __init__(
        self,
        units: list[list[nn.Parameter]],
        comm: Comm,
        optimizer: OptimizerFactory,
        stage: Literal[1, 2, 3] = 1,
        comms: list[Comm] | None = None,
        mean_over: int | None = None,
    ) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        if comms is not None and len(comms) != len(units):
            raise ValueError(f"{len(comms)} comms for {len(units)} units")
        self.comm, self.stage, self.mean_over = comm, stage, mean_over
        kept = [(params, comms[i] if comms else comm) for i, params in enumerate(units) if params]
        self.units = [
            FlatUnit(i, params, c.rank, c.size, sharded_weights=stage == 3)
            for i, (params, c) in enumerate(kept)
        ]
        self._comm = {id(u): c for u, (_, c) in zip(self.units, kept)}
        self.shard_params = [sp for u in self.units for sp in u.shard_params]
        self.optimizer = optimizer(self.shard_params)
        self._in_flight: list[tuple[FlatUnit, Pending, torch.Tensor]] = []
        if stage == 3:
            for unit in self.units:
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
            part = part.clone()  # (the reduction's buffer is scratch)
            for i, sp in enumerate(unit.shard_params):
                sp.grad = unit.shard_of(part, i)
            return
        for i, sp in enumerate(unit.shard_params):
            piece = unit.shard_of(part, i)
            sp.grad = piece.clone() if sp.grad is None else sp.grad.add_(piece)

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
    def step(self) -> None:
        """Step this rank's shards; under ZeRO-1 and 2 all-gather the stepped rows into
        the weights (under ZeRO-3 the next use gathers them)."""
        self.collect()
        self.optimizer.step()
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

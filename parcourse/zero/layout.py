"""The flat units of ZeRO: which rows each rank keeps, and how they travel.

Layout, as in PyTorch's FSDP2: every parameter is cut into N chunks of rows
(dim 0, the last chunks padded), and rank r keeps chunk r of each. Parameters
are grouped into *units* (buckets of about `bucket_mb`, in backward order, for
stages 1-2; one unit per module for stage 3); a unit's chunks travel together
as one flat buffer, laid out rank by rank, so that every all-gather and
reduce-scatter is even whatever the shapes:

    whole buffer = [part of rank 0 | part of rank 1 | ... | part of rank N-1]
    part of rank r = [chunk r of params[0] | chunk r of params[1] | ...]

Nothing here communicates: the layout is tested without ranks
(tests/test_zero_layout.py). The stages (stage1.py, stage2.py, stage3.py) move the
buffers; mixed_precision.py makes the masters when they live apart from the weights.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from parcourse.ranges import chunk_bounds
from parcourse.zero.mixed_precision import compute_copy, own_master


def row_chunk(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the rows `rank` keeps: chunks of ceil(rows / N) rows, so the last
    ranks get fewer, or none (as torch.chunk and FSDP2 cut them)."""
    return chunk_bounds(rows, world_size, "chunk")[rank]


@dataclass(eq=False)
class FlatUnit:
    """Parameters whose row chunks are sharded, gathered and reduced together.

    Rank r's part of a whole buffer is [chunk r of params[0] | chunk r of params[1] | ...],
    each chunk `chunk_rows[i]` rows long (zero rows pad the last ranks); a whole buffer,
    as an all-gather returns it and a reduce-scatter takes it, is the N parts in rank
    order. `full` holds the module's parameters one after another, unpadded.
    """

    index: int
    params: list[nn.Parameter]
    rank: int
    world_size: int
    compute_dtype: torch.dtype | None = None  # e.g. bf16: params, grads and messages
    sharded_weights: bool = False  # stage 3: `full` exists only while needed
    host: torch.device | None = None  # ZeRO-Offload: where the masters live (offload.py)
    params_on_host: bool = False  # stage 3's parameter offload: the 16-bit shard too
    full: torch.Tensor = field(init=False)  # the module's parameters (compute dtype)
    master: torch.Tensor = field(init=False)  # what the shard parameters are views into
    shard_params: list[nn.Parameter] = field(init=False)  # what the optimizer steps
    ready: set[int] = field(default_factory=set)
    pending: Any = None  # a reduction in flight: (future of this rank's part, launch time,
    #                      the whole buffer)
    gathering: Any = None  # stage 3: (future of the whole buffer, launch time, its kind)
    secondary: torch.Tensor | None = None  # ZeRO++'s hpZ: this rank's share of the node's copy
    secondary_version: int = -1  # master._version when `secondary` was made
    gathered_version: int = -1  # master._version when `full` was last gathered

    def __post_init__(self) -> None:
        n = self.world_size
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.rows = [p.shape[0] if p.dim() else 1 for p in self.params]
        self.row_numels = [max(1, math.prod(s[1:])) for s in self.shapes]
        self.chunk_rows = [math.ceil(r / n) for r in self.rows]
        chunk_numels = [c * rn for c, rn in zip(self.chunk_rows, self.row_numels)]
        # Every weight's rows cut into N equal chunks, no padding: a whole buffer is then
        # the weights side by side as (N, rows / N x rest) each, one op to pack or read
        # (what `pack`, `unpack` and `pack_part` do weight by weight otherwise).
        self.even = all(r % n == 0 for r in self.rows)
        self.chunk_numels = chunk_numels
        *self.part_offsets, self.part_numel = itertools.accumulate(chunk_numels, initial=0)
        *self.full_offsets, self.numel = itertools.accumulate(self.numels, initial=0)
        self.padded = self.part_numel * n
        self.local_rows = [
            end - start for start, end in (row_chunk(r, self.rank, n) for r in self.rows)
        ]
        p0 = self.params[0]
        self.dtype = p0.dtype  # the masters' (and the optimizer's) dtype
        self.full = torch.empty(
            self.numel, dtype=self.compute_dtype or self.dtype, device=p0.device
        )
        with torch.no_grad():
            # The given weights, in their own dtype (fp32): the masters come from these.
            given = (
                self.full
                if self.compute_dtype is None
                else torch.cat([p.detach().reshape(-1) for p in self.params])
            )
            for p, offset, size in zip(self.params, self.full_offsets, self.numels):
                self.full[offset : offset + size] = p.detach().reshape(-1)
            # Without mixed precision and with the weights whole (stages 1-2), this rank's
            # rows live in `full` itself; otherwise in a part of their own (fp32).
            if self.compute_dtype is None and not self.sharded_weights and self.host is None:
                self.master = self.full
            else:
                self.master = own_master(self, given, self.host)
            for p, view in zip(self.params, self.views(self.full)):
                p.data = view
        # Stage 3 gathers a 16-bit copy of the master every time: keep one.
        self.compute_shard = compute_copy(self) if self.sharded_weights else None
        self.shard_params = [
            nn.Parameter(self._mine(i), requires_grad=p.requires_grad)
            for i, p in enumerate(self.params)
        ]
        self.gathered_version = self.master._version
        _watch_steps(self)

    # -- layout

    def _mine(self, i: int) -> torch.Tensor:
        """Parameter i's rows on this rank, as a view into the master."""
        if self.master is self.full:
            start = self.full_offsets[i] + self.rank * self.chunk_rows[i] * self.row_numels[i]
            rows = self.local_rows[i]
            return self.full[start : start + rows * self.row_numels[i]].view(
                rows, *self.shapes[i][1:]
            )
        return self.shard_of(self.master, i)

    def shard_of(self, part: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's rows in a rank's part (a view, shape (rows, *rest))."""
        start = self.part_offsets[i]
        rows = self.local_rows[i]
        return part[start : start + rows * self.row_numels[i]].view(rows, *self.shapes[i][1:])

    def _chunks(self, flat: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Parameter i's rows as (whole chunks, remainder rows, count of whole chunks)."""
        c, rn = self.chunk_rows[i], self.row_numels[i]
        whole = self.rows[i] // c
        rows = flat.view(self.rows[i], rn)
        return rows[: whole * c].view(whole, c, rn), rows[whole * c :], whole

    def _columns(self, parts: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's chunk in every rank's part: parts (N, width) -> (N, chunk_rows, rest)."""
        start = self.part_offsets[i]
        c, rn = self.chunk_rows[i], self.row_numels[i]
        return parts[:, start : start + c * rn].view(self.world_size, c, rn)

    def pack(self, tensors: Iterable[torch.Tensor | None], parts: torch.Tensor) -> None:
        """Write full-size tensors (one per parameter, None = zeros) into parts (N, width)."""
        tensors = list(tensors)
        present = [t for t in tensors if t is not None]
        if (
            self.even
            and parts.shape == (self.world_size, self.part_numel)
            and parts.is_contiguous()
            and len(present) == len(tensors)
            and all(t.dtype == parts.dtype for t in present)
        ):
            torch.cat(
                [t.reshape(self.world_size, -1) for t in present],
                dim=1,
                out=parts,
            )
            return
        for i, t in enumerate(tensors):
            cols = self._columns(parts, i)
            if t is None:
                cols.zero_()
                continue
            whole, rest, k = self._chunks(t.reshape(-1), i)
            cols[:k].copy_(whole)
            if k < self.world_size:
                cols[k, : rest.shape[0]].copy_(rest)
                cols[k, rest.shape[0] :].zero_()
                cols[k + 1 :].zero_()

    def unpack(self, parts: torch.Tensor, into: torch.Tensor | None = None) -> None:
        """Copy a whole buffer, parts (N, part_numel), into the parameters, one after
        another (`full` unless told otherwise)."""
        into = self.full if into is None else into
        if self.even:
            pieces = parts.split(self.chunk_numels, dim=1)
            for piece, offset, size in zip(pieces, self.full_offsets, self.numels):
                into[offset : offset + size].view(self.world_size, -1).copy_(piece)
            return
        for i, (offset, size) in enumerate(zip(self.full_offsets, self.numels)):
            whole, rest, k = self._chunks(into[offset : offset + size], i)
            cols = self._columns(parts, i)
            whole.copy_(cols[:k])
            if k < self.world_size:
                rest.copy_(cols[k, : rest.shape[0]])

    def pack_part(self, full: torch.Tensor, part: torch.Tensor) -> None:
        """This rank's part of the parameters `full` (one after another, unpadded)."""
        if self.even and full.dtype == part.dtype:
            torch.cat(
                [
                    full[o : o + n].view(self.world_size, -1)[self.rank]
                    for o, n in zip(self.full_offsets, self.numels)
                ],
                out=part[: self.part_numel],
            )
            return
        for i, (offset, size) in enumerate(zip(self.full_offsets, self.numels)):
            c, rn = self.chunk_rows[i], self.row_numels[i]
            rows = full[offset : offset + size].view(self.rows[i], rn)
            mine = rows[self.rank * c : self.rank * c + self.local_rows[i]]
            part[self.part_offsets[i] : self.part_offsets[i] + mine.numel()] = mine.reshape(-1)

    def master_part(
        self, dtype: torch.dtype | None = None, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This rank's part of the masters, contiguous, in `dtype` (default: theirs),
        written into `into` when given."""
        dtype = dtype or self.dtype
        if into is None:
            into = torch.empty(self.part_numel, dtype=dtype, device=self.full.device)
        if self.master is not self.full:
            return into.copy_(self.master)
        self.pack_part(self.full, into)
        for i, (c, rn) in enumerate(zip(self.chunk_rows, self.row_numels)):
            if self.local_rows[i] < c:  # padding rows: zeros
                into[
                    self.part_offsets[i] + self.local_rows[i] * rn : self.part_offsets[i] + c * rn
                ].zero_()
        return into

    def gathered_masters(
        self, all_gather: Callable[[torch.Tensor, torch.Tensor], Any]
    ) -> torch.Tensor:
        """Every rank's masters (fp32), the weights one after another, unpadded:
        `all_gather(part, whole)` writes every rank's part into `whole`, in rank order."""
        part = self.master_part()
        whole = torch.empty(self.padded, dtype=part.dtype, device=part.device)
        all_gather(part, whole)
        full = torch.empty(self.numel, dtype=part.dtype, device=part.device)
        self.unpack(whole.view(self.world_size, self.part_numel), into=full)
        return full

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each weight's view into `flat` (its weights one after another, unpadded)."""
        return [
            flat[offset : offset + size].view(shape)
            for offset, size, shape in zip(self.full_offsets, self.numels, self.shapes)
        ]

    # -- what is gathered

    @property
    def nbytes(self) -> int:
        """Bytes of a whole (padded) buffer in the compute dtype: one collective's size."""
        return self.padded * self.full.element_size()

    def stepped(self) -> bool:
        """An optimizer (or a load) changed the master since the last gather."""
        return self.master._version != self.gathered_version

    def fill(self, whole: torch.Tensor) -> None:
        """The parameters from a whole buffer, as an all-gather of every rank's part
        returns it, into the storage they view (made again if it was freed): gathered as
        of the master now."""
        self.full.untyped_storage().resize_(self.numel * self.full.element_size())
        self.unpack(whole.view(self.world_size, self.part_numel))
        self.gathered_version = self.master._version

    def mark_stepped(self) -> None:
        """Gather again before the next use, and drop copies of the old weights."""
        self.gathered_version = -1
        self.secondary = None

    def settle(self) -> None:
        """Before an optimizer writes the master: a gather still in flight (a prefetch
        that no forward used, e.g. one a recomputation in backward started) reads the old
        weights, so let it land and drop it; stage 3's gathered weights go too."""
        if self.gathering is not None:
            self.gathering[0].result()
            self.gathering = None
        if self.sharded_weights:
            self.full.untyped_storage().resize_(0)

    def gather_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's part as the next all-gather sends it, the whole buffer to gather
        into), in the compute dtype; stages 1-2 write the part straight into the whole."""
        whole = torch.empty(self.padded, dtype=self.full.dtype, device=self.full.device)
        if self.compute_shard is None:
            mine = whole[self.rank * self.part_numel : (self.rank + 1) * self.part_numel]
            return self.master_part(self.full.dtype, into=mine), whole
        if self.compute_shard is not self.master and self.stepped():
            self.compute_shard.copy_(self.master)
        # Parameter offload: the shard comes over from the host, one unit at a time.
        return self.compute_shard.to(self.full.device, non_blocking=True), whole

    def complete(self) -> bool:
        """Every parameter's gradient of this backward is in."""
        return len(self.ready) == len(self.params)

    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Give the full parameters' memory back; the views stay, pointing at nothing."""
        if self.gathering is not None:  # a prefetch still writing into it (a unit unused
            self.gathering[0].result()  # this step): let it land first
            self.gathering = None
        self.full.untyped_storage().resize_(0)


# -- steps that leave no trace on the tensors
#
# A unit knows its master changed by the master's version counter, which every in-place
# op bumps, but not torch's fused optimizers (`fused=True`: one kernel writes the
# parameters and the counter stays put). So every optimizer step also marks the units of
# the shard parameters it holds as stepped: the next forward gathers them again.

_UNIT = "_parcourse_unit"
_step_hook_installed = False


def _units_of(optimizer: torch.optim.Optimizer) -> list[FlatUnit]:
    units = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = getattr(p, _UNIT, None)
            unit = ref() if ref is not None else None
            if unit is not None:
                units[id(unit)] = unit
    return list(units.values())


def _settle_units(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for unit in _units_of(optimizer):
        unit.settle()


def _mark_units(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for unit in _units_of(optimizer):
        unit.mark_stepped()


def _watch_steps(unit: FlatUnit) -> None:
    """Every optimizer step that holds the unit's shard parameters settles its gathers
    before, and marks it stepped after."""
    global _step_hook_installed
    for sp in unit.shard_params:
        setattr(sp, _UNIT, weakref.ref(unit))
    if not _step_hook_installed:
        register_optimizer_step_pre_hook(_settle_units)
        register_optimizer_step_post_hook(_mark_units)
        _step_hook_installed = True

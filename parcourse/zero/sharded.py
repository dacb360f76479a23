"""ZeRO stages 1, 2 and 3 (Rajbhandari et al., arXiv:1910.02054), one wrapper for all.

Data parallelism keeps a full copy of everything on every rank: parameters (W),
gradients (G) and optimizer state (O, two tensors for Adam). ZeRO removes the
copies, one kind at a time:

- stage 1: O sharded. Backward builds the full gradient on every rank, as in
  DDP; when it ends, the gradients are reduce-scattered (each rank needs only
  the slice it updates), each rank steps its slice, and the next forward
  all-gathers the updated slices. Together that is one all-reduce's volume,
  2(N-1)/N x S: the ZeRO paper's P_os costs what DDP costs (sec. 7.2.1).
- stage 2: O and G sharded. Each bucket of gradients is reduce-scattered as
  soon as backward has produced it, so the full gradient never exists at once.
- stage 3: O, G and W sharded. A layer's parameters are all-gathered just
  before its forward and again before its backward, and freed after; the next
  layer's gather is started early (prefetch). 1.5x DDP's volume.

Layout, as in PyTorch's FSDP2: every parameter is cut into N chunks of rows
(dim 0, the last chunks padded), and rank r keeps chunk r of each. Parameters
are grouped into *units* (buckets of about `bucket_mb`, in backward order, for
stages 1-2; one unit per module for stage 3); a unit's chunks travel together
as one flat buffer, laid out rank by rank, so that every all-gather and
reduce-scatter is even whatever the shapes.

`model.parameters()` of the sharded model are this rank's chunks, each an
`nn.Parameter` of shape (rows, *rest) that shares memory with the unit's
master copy, and after backward each has a `.grad` of the same shape. So any
optimizer built from them trains the model, exactly as with `fully_shard`:

    model = ZeroModel(net, stage=3, group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

Where this differs from one process: an optimizer that is not elementwise
(one that takes a norm over a whole tensor, e.g. LAMB, or
`torch.nn.utils.clip_grad_norm_` over the chunks) sees only this rank's rows;
use `ZeroModel.clip_grad_norm_`. The module's own parameters
(`model.module.parameters()`) are the gathered copies, not what an optimizer
should hold: an optimizer over them raises at its first step.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map_only

from parcourse._compat import all_gather_single, reduce_scatter_single
from parcourse.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from parcourse.data_parallel.base import GradSyncModule
from parcourse.data_parallel.bucketed import group_by_size
from parcourse.memory import tensors_in
from parcourse.trace import Tracer

Stage = Literal[1, 2, 3]
Algorithm = Literal["auto", "torch", "ring"]
_MAX_IN_FLIGHT = 2


# --------------------------------------------------------------------------- a unit


def row_chunk(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the rows `rank` keeps: chunks of ceil(rows / N) rows, so the last
    ranks get fewer, or none (as torch.chunk and FSDP2 cut them)."""
    chunk = math.ceil(rows / world_size)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


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
    full: torch.Tensor = field(init=False)  # the module's parameters (compute dtype)
    master: torch.Tensor = field(init=False)  # what the shard parameters are views into
    shard_params: list[nn.Parameter] = field(init=False)  # what the optimizer steps
    ready: set[int] = field(default_factory=set)
    pending: Any = None  # a reduction in flight: (future of this rank's part, launch time,
    #                      the whole buffer)
    gathering: Any = None  # stage 3: (future of the whole buffer, launch time)
    gathered_version: int = -1  # master._version when `full` was last gathered

    def __post_init__(self) -> None:
        n = self.world_size
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.rows = [p.shape[0] if p.dim() else 1 for p in self.params]
        self.row_numels = [max(1, math.prod(s[1:])) for s in self.shapes]
        self.chunk_rows = [math.ceil(r / n) for r in self.rows]
        chunk_numels = [c * rn for c, rn in zip(self.chunk_rows, self.row_numels)]
        *self.part_offsets, self.part_numel = itertools.accumulate(chunk_numels, initial=0)
        *self.full_offsets, self.numel = itertools.accumulate(self.numels, initial=0)
        self.padded = self.part_numel * n
        self.local_rows = [end - start for start, end in
                           (row_chunk(r, self.rank, n) for r in self.rows)]
        p0 = self.params[0]
        self.dtype = p0.dtype  # the masters' (and the optimizer's) dtype
        self.full = torch.empty(self.numel, dtype=self.compute_dtype or self.dtype,
                                device=p0.device)
        with torch.no_grad():
            for p, offset, size in zip(self.params, self.full_offsets, self.numels):
                self.full[offset:offset + size] = p.detach().reshape(-1)
            # Without mixed precision and with the weights whole (stages 1-2), this rank's
            # rows live in `full` itself; otherwise in a part of their own (fp32).
            if self.compute_dtype is None and not self.sharded_weights:
                self.master = self.full
            else:
                self.master = torch.zeros(self.part_numel, dtype=self.dtype, device=p0.device)
                self.pack_part(self.full.to(self.dtype), self.master)
            for p, offset, size, shape in zip(self.params, self.full_offsets, self.numels,
                                              self.shapes):
                p.data = self.full[offset:offset + size].view(shape)
        # Stage 3 gathers a 16-bit copy of the master every time: keep one.
        self.compute_shard = None
        if self.sharded_weights:
            self.compute_shard = (self.master if self.compute_dtype is None
                                  else self.master.to(self.compute_dtype))
        self.shard_params = [nn.Parameter(self._mine(i), requires_grad=p.requires_grad)
                             for i, p in enumerate(self.params)]
        self.gathered_version = self.master._version

    # -- layout

    def _mine(self, i: int) -> torch.Tensor:
        """Parameter i's rows on this rank, as a view into the master."""
        if self.master is self.full:
            start = self.full_offsets[i] + self.rank * self.chunk_rows[i] * self.row_numels[i]
            rows = self.local_rows[i]
            return self.full[start:start + rows * self.row_numels[i]].view(
                rows, *self.shapes[i][1:])
        return self.shard_of(self.master, i)

    def shard_of(self, part: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's rows in a rank's part (a view, shape (rows, *rest))."""
        start = self.part_offsets[i]
        rows = self.local_rows[i]
        return part[start:start + rows * self.row_numels[i]].view(rows, *self.shapes[i][1:])

    def _chunks(self, flat: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Parameter i's rows as (whole chunks, remainder rows, count of whole chunks)."""
        c, rn = self.chunk_rows[i], self.row_numels[i]
        whole = self.rows[i] // c
        rows = flat.view(self.rows[i], rn)
        return rows[:whole * c].view(whole, c, rn), rows[whole * c:], whole

    def _columns(self, parts: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's chunk in every rank's part: parts (N, width) -> (N, chunk_rows, rest)."""
        start = self.part_offsets[i]
        c, rn = self.chunk_rows[i], self.row_numels[i]
        return parts[:, start:start + c * rn].view(self.world_size, c, rn)

    def pack(self, tensors: Iterable[torch.Tensor | None], parts: torch.Tensor) -> None:
        """Write full-size tensors (one per parameter, None = zeros) into parts (N, width)."""
        for i, t in enumerate(tensors):
            cols = self._columns(parts, i)
            if t is None:
                cols.zero_()
                continue
            whole, rest, k = self._chunks(t.reshape(-1), i)
            cols[:k].copy_(whole)
            if k < self.world_size:
                cols[k, :rest.shape[0]].copy_(rest)
                cols[k, rest.shape[0]:].zero_()
                cols[k + 1:].zero_()

    def unpack(self, parts: torch.Tensor, into: torch.Tensor | None = None) -> None:
        """Copy a whole buffer, parts (N, part_numel), into the parameters, one after
        another (`full` unless told otherwise)."""
        into = self.full if into is None else into
        for i, (offset, size) in enumerate(zip(self.full_offsets, self.numels)):
            whole, rest, k = self._chunks(into[offset:offset + size], i)
            cols = self._columns(parts, i)
            whole.copy_(cols[:k])
            if k < self.world_size:
                rest.copy_(cols[k, :rest.shape[0]])

    def pack_part(self, full: torch.Tensor, part: torch.Tensor) -> None:
        """This rank's part of the parameters `full` (one after another, unpadded)."""
        for i, (offset, size) in enumerate(zip(self.full_offsets, self.numels)):
            c, rn = self.chunk_rows[i], self.row_numels[i]
            rows = full[offset:offset + size].view(self.rows[i], rn)
            mine = rows[self.rank * c:self.rank * c + self.local_rows[i]]
            part[self.part_offsets[i]:self.part_offsets[i] + mine.numel()] = mine.reshape(-1)

    def master_part(self, dtype: torch.dtype | None = None,
                    into: torch.Tensor | None = None) -> torch.Tensor:
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
                into[self.part_offsets[i] + self.local_rows[i] * rn:
                     self.part_offsets[i] + c * rn].zero_()
        return into

    # -- what is gathered

    @property
    def nbytes(self) -> int:
        """Bytes of a whole (padded) buffer in the compute dtype: one collective's size."""
        return self.padded * self.full.element_size()

    def stepped(self) -> bool:
        """An optimizer (or a load) changed the master since the last gather."""
        return self.master._version != self.gathered_version

    def gather_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's part as the next all-gather sends it, the whole buffer to gather
        into), in the compute dtype; stages 1-2 write the part straight into the whole."""
        whole = torch.empty(self.padded, dtype=self.full.dtype, device=self.full.device)
        if self.compute_shard is None:
            mine = whole[self.rank * self.part_numel:(self.rank + 1) * self.part_numel]
            return self.master_part(self.full.dtype, into=mine), whole
        if self.compute_shard is not self.master and self.stepped():
            self.compute_shard.copy_(self.master)
        return self.compute_shard, whole

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


# --------------------------------------------------------------------------- communication


class _Comm:
    """The unit collectives: torch's (async) or this course's ring (on one thread).

    Everything goes out in the order it is asked for, the same on every rank. The
    ring counts the bytes it really sends (`bytes_sent` on the tracer).
    """

    def __init__(self, group: dist.ProcessGroup, algorithm: Algorithm,
                 tracer: Tracer | None) -> None:
        if algorithm not in ("auto", "torch", "ring"):
            raise ValueError(f"unknown algorithm {algorithm!r}; choose 'auto', 'torch' or 'ring'")
        if algorithm == "auto":  # gloo's own reduce-scatter and all-gather are slow (README)
            algorithm = "ring" if dist.get_backend(group) == "gloo" else "torch"
        self.group, self.algorithm, self.tracer = group, algorithm, tracer
        self._thread = ThreadPoolExecutor(1, "parcourse-zero") if algorithm == "ring" else None

    def _run(self, work: Callable[[], torch.Tensor]) -> Future[torch.Tensor]:
        assert self._thread is not None
        return self._thread.submit(work)

    def reduce_scatter(self, buffer: torch.Tensor) -> Future[torch.Tensor]:
        """Sum `buffer` over ranks; the future gives this rank's part."""
        if self._thread is not None:
            return self._run(lambda: ring_reduce_scatter(buffer, self.group, tracer=self.tracer,
                                                         scratch=True))
        out = torch.empty(buffer.numel() // dist.get_world_size(self.group), dtype=buffer.dtype,
                          device=buffer.device)
        work = reduce_scatter_single(out, buffer, group=self.group, async_op=True)
        return _After(work, out)

    def all_gather(self, part: torch.Tensor, whole: torch.Tensor) -> Future[torch.Tensor]:
        """Every rank's part, in rank order, into `whole` (`part` may be its own chunk)."""
        if self._thread is not None:
            return self._run(lambda: ring_all_gather(part, self.group, tracer=self.tracer,
                                                     out=whole))
        work = all_gather_single(whole, part, group=self.group, async_op=True)
        return _After(work, whole)

    def all_reduce(self, buffer: torch.Tensor) -> Future[torch.Tensor]:
        if self._thread is not None:
            return self._run(lambda: ring_all_reduce(buffer, self.group, tracer=self.tracer))
        return _After(dist.all_reduce(buffer, group=self.group, async_op=True), buffer)


class _After(Future):  # type: ignore[type-arg]
    """A torch Work seen as a Future of its output tensor."""

    def __init__(self, work: dist.Work, out: torch.Tensor) -> None:
        super().__init__()
        self.work, self.out = work, out

    def result(self, timeout: float | None = None) -> torch.Tensor:
        self.work.wait()
        return self.out


# --------------------------------------------------------------------------- misuse


# A module parameter that a ZeroModel turned into a gathered copy carries this mark. An
# optimizer that steps it would change nothing that lasts (or nothing at all): it raises.
_SHARDED_AWAY = "_parcourse_sharded_away"
_hook_installed = False


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, _SHARDED_AWAY, False):
                raise RuntimeError(
                    "this optimizer holds the module's own parameters, which ZeRO replaced by "
                    "gathered copies: stepping them trains nothing. Build the optimizer from "
                    "the sharded model, after sharding: torch.optim.AdamW(model.parameters())")


def _install_optimizer_check() -> None:
    global _hook_installed
    if not _hook_installed:
        register_optimizer_step_pre_hook(_check_optimizer)
        _hook_installed = True


# --------------------------------------------------------------------------- the model


class ZeroModel(GradSyncModule):
    """`ZeroModel(module, stage, group=None, *, bucket_mb=25.0, prefetch=True,
    compute_dtype=None, algorithm="auto", keep_modules=(), tracer=None)`.

    Use it like the module; build the optimizer from its `parameters()`.

    - `compute_dtype=torch.bfloat16` (or float16): parameters, gradients and messages
      in 16 bits; the optimizer steps fp32 masters and gets fp32 gradients (as FSDP2
      with a bf16 `param_dtype`).
    - `algorithm`: "ring" (this course's, built from send/recv, which counts the bytes
      it sends), "torch" (torch.distributed's collectives), or "auto": the ring on
      gloo, torch's otherwise.
    - `keep_modules`: modules left unsharded (FSDP's ignored modules), e.g. norms:
      replicated on every rank, gradients all-reduced, and kept in their own dtype
      (fp32) under mixed precision, their inputs cast to it.
    """

    def __init__(self, module: nn.Module, stage: Stage, group: dist.ProcessGroup | None = None,
                 *, bucket_mb: float = 25.0, prefetch: bool = True,
                 compute_dtype: torch.dtype | None = None, algorithm: Algorithm = "auto",
                 keep_modules: Iterable[nn.Module] = (), tracer: Tracer | None = None) -> None:
        if compute_dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"compute_dtype must be torch.bfloat16, torch.float16 or None, "
                             f"got {compute_dtype}")
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("the model has no parameter that requires a gradient")
        keep_modules = list(keep_modules)
        inside = {id(m) for m in module.modules()}
        for m in keep_modules:
            if id(m) not in inside:
                raise ValueError(f"keep_modules: {type(m).__name__} is not a submodule "
                                 "of the model")
        # Broadcast from the first rank, gradient hooks, no_sync, the end-of-backward call.
        super().__init__(module, group, tracer)
        self.stage, self.prefetch = stage, prefetch
        self.compute_dtype = None if compute_dtype == torch.float32 else compute_dtype
        self.comm = _Comm(self.group, algorithm, tracer)
        kept = {id(p) for m in keep_modules for p in m.parameters()}
        self.kept_params = [p for p in self.sync_params if id(p) in kept]
        sharded = [p for p in self.sync_params if id(p) not in kept]
        self.units, uses = self._make_units(module, sharded, bucket_mb)
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._names = {id(p): n for n, p in module.named_parameters(remove_duplicate=True)}
        # Gradients arrive last layer first; units are launched strictly in that order.
        self._backward_order = self.units if stage < 3 else self.units[::-1]
        self._next = 0
        self._kept_ready = False
        for p in sharded:
            setattr(p, _SHARDED_AWAY, True)
        _install_optimizer_check()
        if stage == 3:
            for unit in self.units:
                unit.free()
            for m, needed in uses:
                m.register_forward_pre_hook(self._before_forward(needed))
                m.register_forward_hook(self._after_forward(needed))
        else:
            self.register_forward_pre_hook(self._gather_if_stepped)
        if self.compute_dtype is not None:
            for m in keep_modules:  # run in their own dtype; hand back 16 bits
                m.register_forward_pre_hook(_cast_inputs_to_params, with_kwargs=True)
                m.register_forward_hook(self._cast_output_to_compute)

    def _make_units(self, module: nn.Module, trainable: list[nn.Parameter], bucket_mb: float
                    ) -> tuple[list[FlatUnit], list[tuple[nn.Module, list[FlatUnit]]]]:
        """The units, and (stage 3) which units each module needs gathered to run."""
        mine = {id(p) for p in trainable}
        uses: list[tuple[nn.Module, list[int]]] = []
        if self.stage < 3:
            groups = group_by_size(trainable, bucket_mb)
        else:  # a unit per module with parameters of its own, in forward (registration)
            owner: dict[int, int] = {}  # order; a tied parameter goes with its first module
            groups = []
            for m in module.modules():
                direct = [p for p in m.parameters(recurse=False) if id(p) in mine]
                new = [p for p in direct if id(p) not in owner]
                if new:
                    groups.append(new)
                    owner.update((id(p), len(groups) - 1) for p in new)
                if direct:
                    uses.append((m, sorted({owner[id(p)] for p in direct})))
        units = [FlatUnit(i, params, self.rank, self.world_size, self.compute_dtype,
                          sharded_weights=self.stage == 3) for i, params in enumerate(groups)]
        return units, [(m, [units[i] for i in needed]) for m, needed in uses]

    # -- what an optimizer sees

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's shards under the module's names (prefixed "module.", as DDP's),
        then the parameters left whole: kept modules' and frozen ones."""
        shards = {id(p): sp for u in self.units for p, sp in zip(u.params, u.shard_params)}
        for name, p in self.module.named_parameters(remove_duplicate=remove_duplicate):
            yield f"{prefix}{'.' if prefix else ''}module.{name}", shards.get(id(p), p)

    def _gather_if_stepped(self, module: nn.Module, args: Any) -> None:
        """Stages 1-2: before a forward, gather the units whose master an optimizer changed."""
        futures = [(u, self.comm.all_gather(*u.gather_buffers()), time.perf_counter_ns())
                   for u in self.units if u.stepped()]
        for unit, future, started in futures:
            unit.unpack(future.result().view(self.world_size, unit.part_numel))
            unit.gathered_version = unit.master._version
            self._comm_span("all_gather", started, unit)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compute_dtype is None:
            return super().forward(*args, **kwargs)
        # Mixed precision: inputs in, outputs out of the compute dtype; the loss stays fp32.
        args, kwargs = _cast_floats((args, kwargs), self.compute_dtype)
        return _cast_floats(super().forward(*args, **kwargs), torch.float32)

    def _cast_output_to_compute(self, module: nn.Module, args: Any, output: Any) -> Any:
        return _cast_floats(output, self.compute_dtype)

    def _comm_span(self, name: str, started: int, unit: FlatUnit) -> None:
        if self.tracer is not None:
            self.tracer.add_span(name, started, time.perf_counter_ns(), kind="comm",
                                 unit=unit.index, size=unit.nbytes)

    # -- stage 3: gather before use, free after

    def _start_gather(self, unit: FlatUnit) -> None:
        if unit.gathered() or unit.gathering is not None:
            return
        unit.gathering = (self.comm.all_gather(*unit.gather_buffers()), time.perf_counter_ns())

    def _wait_gather(self, unit: FlatUnit) -> None:
        self._start_gather(unit)
        if unit.gathering is not None:
            future, started = unit.gathering
            whole = future.result()
            unit.gathering = None
            unit.full.untyped_storage().resize_(unit.numel * unit.full.element_size())
            unit.unpack(whole.view(self.world_size, unit.part_numel))
            unit.gathered_version = unit.master._version
            self._comm_span("all_gather", started, unit)

    def _prefetch(self, index: int) -> None:
        if self.prefetch and 0 <= index < len(self.units):
            self._start_gather(self.units[index])

    def _before_forward(self, needed: list[FlatUnit]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            for unit in needed:
                self._wait_gather(unit)
            self._prefetch(needed[-1].index + 1)
        return hook

    def _after_forward(self, needed: list[FlatUnit]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for unit in needed:
                unit.free()  # backward gathers again, when the gradient of the output arrives
            if torch.is_grad_enabled():
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(self._before_backward(needed))
        return hook

    def _before_backward(self, needed: list[FlatUnit]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            for unit in needed:
                self._wait_gather(unit)
            self._prefetch(needed[0].index - 1)
        return hook

    # -- gradients: reduce-scattered unit by unit

    def grad_ready(self, param: torch.Tensor) -> None:
        unit = self._unit_of.get(id(param))
        if unit is None:  # a kept module's parameter: all-reduced when backward ends
            self._kept_ready = True
            return
        unit.ready.add(id(param))
        if self.stage == 1:  # stage 1 keeps the full gradient until backward ends
            return
        order = self._backward_order
        while self._next < len(order) and order[self._next].complete():
            self._launch(order[self._next])

    def _launch(self, unit: FlatUnit) -> None:
        """Pack the unit's local gradients (and a used-flag per parameter in every rank's
        part) and start reducing them; from here on the gradient lives in the reduction."""
        k = len(unit.params)
        parts = torch.empty(self.world_size, unit.part_numel + k, dtype=unit.full.dtype,
                            device=unit.full.device)
        unit.pack([p.grad for p in unit.params], parts)
        used = torch.tensor([float(p.grad is not None) for p in unit.params], dtype=parts.dtype)
        parts[:, unit.part_numel:] = used  # every rank's part ends with the same flags
        for p in unit.params:
            p.grad = None
        if self.stage == 3:
            unit.free()
        unit.pending = (self.comm.reduce_scatter(parts.view(-1)), time.perf_counter_ns(), parts)
        self._next = self._backward_order.index(unit) + 1
        # At most two in flight: each is as big as its unit's full gradient, and
        # stages 2-3 exist to not hold all of those at once.
        in_flight = [u for u in self._backward_order if u.pending is not None]
        for older in in_flight[:-_MAX_IN_FLIGHT]:
            self._finish(older)

    def finish_gradient_sync(self) -> None:
        """Wait for every reduction; afterwards each shard parameter holds its gradient."""
        if not (self._kept_ready or any(u.ready or u.pending for u in self.units)):
            return
        kept = self._start_kept_all_reduce()
        for unit in self._backward_order[self._next:]:  # units some parameter never reached,
            self._launch(unit)                          # or all of them (stage 1)
        for unit in self._backward_order:
            if unit.pending is not None:
                self._finish(unit)
            unit.ready.clear()
        self._next = 0
        if kept is not None:
            self._finish_kept(*kept)

    def _finish(self, unit: FlatUnit) -> None:
        """Wait for one unit's reduce-scatter; add the average into the shards' .grad."""
        future, started, _ = unit.pending
        part = future.result()
        unit.pending = None  # the full-size buffer is freed here
        self._comm_span("reduce_scatter", started, unit)
        k = len(unit.params)
        used = part[unit.part_numel:].tolist()
        grad = part[:unit.part_numel].div_(self.world_size).to(unit.dtype)
        for i, (sp, count) in enumerate(zip(unit.shard_params, used)):
            if count == 0:  # no rank used it: no gradient, as in one process
                continue
            piece = unit.shard_of(grad, i)
            if sp.grad is None:
                sp.grad = piece
            else:  # accumulate across steps until zero_grad, like .grad does
                sp.grad.add_(piece)
        assert len(used) == k

    def _start_kept_all_reduce(self) -> tuple[Future[torch.Tensor], list[nn.Parameter]] | None:
        if not self._kept_ready:
            return None
        self._kept_ready = False
        with_grad = [p for p in self.kept_params if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in with_grad]) if with_grad else None
        return (self.comm.all_reduce(flat), with_grad) if flat is not None else None

    def _finish_kept(self, future: Future[torch.Tensor], params: list[nn.Parameter]) -> None:
        # Every rank had a gradient for the same kept parameters: they ran the same modules.
        flat = future.result().div_(self.world_size)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    # -- helpers an ordinary training loop needs

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The shards' gradients, and any local gradient still waiting (no_sync)."""
        for p in [*self.parameters(), *self.module.parameters()]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their norm over the whole model (every rank's shards);
        returns that norm. torch.nn.utils.clip_grad_norm_ on the shards would see only
        this rank's rows."""
        self.finish_gradient_sync()
        shard_grads = [sp.grad for u in self.units for sp in u.shard_params if sp.grad is not None]
        kept = [p.grad for p in self.kept_params if p.grad is not None]
        p = float(norm_type)
        local = torch.zeros((), dtype=torch.float64)
        for g in shard_grads:
            local += g.double().abs().pow(p).sum().cpu()
        total = local.clone()
        dist.all_reduce(total, group=self.group)
        for g in kept:  # replicated: count once, not once per rank
            total += g.double().abs().pow(p).sum().cpu()
        norm = total.pow(1 / p)
        scale = float(max_norm) / (float(norm) + 1e-6)
        if scale < 1:
            for g in [*shard_grads, *kept]:
                g.mul_(scale)
        return norm.float()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights (gathered fp32 masters) and buffers, on every rank."""
        state = {k: v.detach().clone() for k, v in self.module.state_dict(keep_vars=True).items()
                 if id(v) not in self._unit_of}
        for unit in self.units:
            part = unit.master_part()
            whole = torch.empty(unit.padded, dtype=part.dtype, device=part.device)
            all_gather_single(whole, part, group=self.group)
            full = torch.empty(unit.numel, dtype=part.dtype, device=part.device)
            unit.unpack(whole.view(self.world_size, unit.part_numel), into=full)
            for p, offset, size, shape in zip(unit.params, unit.full_offsets, unit.numels,
                                              unit.shapes):
                state[self._names[id(p)]] = full[offset:offset + size].view(shape).clone()
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if name not in state:  # the second name of a tied parameter
                state[name] = state[self._names[id(p)]]
        return {k: state[k] for k in self.module.state_dict()}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError(
            "a ZeroModel's own parameters are gathered copies (freed at stage 3, refreshed "
            "only by the next forward at stages 1-2), so state_dict() would save the wrong "
            "weights. Call model.full_state_dict() on every rank (it gathers the shards), and "
            "model.load_full_state_dict(state) to load one.")

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("use model.load_full_state_dict(state), with the keys of "
                           "model.full_state_dict(): it loads each rank's rows")

    @torch.no_grad()
    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load unsharded weights (as `full_state_dict` returns them): every rank takes its
        own rows, so no rank waits for another. The next forward gathers them."""
        missing = set(self.module.state_dict()) - set(state)
        if missing:
            raise KeyError(f"the state lacks {sorted(missing)}")
        for name, value in self.module.state_dict(keep_vars=True).items():
            if id(value) not in self._unit_of:  # buffers, kept and frozen parameters
                value.copy_(state[name])
        for unit in self.units:
            full = torch.cat([state[self._names[id(p)]].reshape(-1).to(unit.dtype)
                              for p in unit.params])
            if unit.master is unit.full and unit.gathered():
                unit.full.copy_(full)
            elif unit.master is not unit.full:
                unit.pack_part(full, unit.master)
            unit.gathered_version = -1  # gather again before the next forward

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, by category, for memory accounting.

        Gradient buffers still being reduced count as "other" (temporary buffers).
        """
        params = [u.full for u in self.units if u.gathered()]
        masters = [u.master for u in self.units]
        if self.stage == 3:  # this rank's share of the weights: the fp32 master itself,
            params += [u.compute_shard for u in self.units]  # or its 16-bit copy
        whole = [p for p in self.module.parameters() if id(p) not in self._unit_of]
        grads = [sp.grad for u in self.units for sp in u.shard_params if sp.grad is not None]
        grads += [p.grad for p in self.module.parameters() if p.grad is not None]
        in_flight = [u.pending[2] for u in self.units if u.pending is not None]
        memory = {"params": params + whole, "grads": grads, "other": in_flight}
        if self.compute_dtype is not None:  # fp32 masters: optimizer state in ZeRO's count
            memory["optimizer"] = masters
        return memory


def _cast_floats(tree: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return tree
    return tree_map_only(torch.Tensor,
                         lambda t: t.to(dtype) if torch.is_floating_point(t) else t, tree)


def _cast_inputs_to_params(module: nn.Module, args: Any, kwargs: Any) -> Any:
    dtype = next(module.parameters()).dtype
    return _cast_floats((args, kwargs), dtype)


# --------------------------------------------------------------------------- the pair


class ShardedOptimizer:
    """The optimizer half of `parcourse.zero.shard(...)`: yours, over the model's shards.

    A thin wrapper: `ZeroModel.parameters()` are already what an optimizer steps.
    """

    def __init__(self, model: ZeroModel,
                 optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.model = model
        self.shard_params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer_factory(self.shard_params)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        self.model.finish_gradient_sync()
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (a sharded checkpoint)."""
        return {"stage": self.model.stage, "rank": self.model.rank,
                "world_size": self.model.world_size, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = (self.model.stage, self.model.rank, self.model.world_size)
        found = (state["stage"], state["rank"], state["world_size"])
        if found != expected:
            raise ValueError(f"this checkpoint holds (stage, rank, world_size) = {found}, "
                             f"this optimizer is {expected}")
        self.optimizer.load_state_dict(state["optimizer"])


def shard(model: nn.Module,
          optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
          stage: Stage = 1, group: dist.ProcessGroup | None = None, *,
          mixed_precision: torch.dtype | None = None, bucket_mb: float = 25.0,
          prefetch: bool = True, algorithm: Algorithm = "auto",
          keep_modules: Iterable[nn.Module] = (), tracer: Tracer | None = None
          ) -> tuple[ZeroModel, ShardedOptimizer]:
    """Shard a model and its optimizer with ZeRO `stage`; use the pair as before.

    >>> model, opt = zero.shard(net, lambda ps: torch.optim.Adam(ps, lr=1e-3), stage=2)
    >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

    The factory gets `model.parameters()` of the sharded model: build param groups
    from `model.named_parameters()` instead when you need them (as with FSDP2),
    e.g. `opt = torch.optim.AdamW(groups)` after `model = ZeroModel(net, stage)`.

    `mixed_precision=torch.bfloat16` (or float16): parameters, gradients and
    communication in 16 bits, fp32 master weights in the optimizer.
    """
    zero_model = ZeroModel(model, stage, group, bucket_mb=bucket_mb, prefetch=prefetch,
                           compute_dtype=mixed_precision, algorithm=algorithm,
                           keep_modules=keep_modules, tracer=tracer)
    return zero_model, ShardedOptimizer(zero_model, optimizer_factory)

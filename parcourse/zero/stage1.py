"""ZeRO stage 1: the optimizer state sharded (Rajbhandari et al., arXiv:1910.02054).

Data parallelism keeps a full copy of everything on every rank: parameters (W),
gradients (G) and optimizer state (O, two tensors for Adam). Stage 1 removes the
copies of O:

- each rank keeps only a slice of every parameter (its rows, see layout.py) as
  the parameters its optimizer steps, so Adam's state exists for that slice only;
- backward builds the full gradient on every rank, as in DDP; when it ends, the
  gradients are reduce-scattered (each rank needs only the slice it updates);
- each rank steps its slice, and the next forward all-gathers the updated slices.

Together that is one all-reduce's volume, 2(N-1)/N x S: the ZeRO paper's P_os
costs what DDP costs (sec. 7.2.1). Stage 2 (stage2.py) reduce-scatters during
backward instead; stage 3 (stage3.py) shards the weights too.

`model.parameters()` of the sharded model are this rank's chunks, each an
`nn.Parameter` of shape (rows, *rest) that shares memory with the unit's
master copy, and after backward each has a `.grad` of the same shape. So any
optimizer built from them trains the model, exactly as with `fully_shard`:

    model = ZeroModel(net, stage=1, group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

Where this differs from one process: an optimizer that is not elementwise
(one that takes a norm over a whole tensor, e.g. LAMB, or
`torch.nn.utils.clip_grad_norm_` over the chunks) sees only this rank's rows;
use `model.clip_grad_norm_` (clip.py). The module's own parameters
(`model.module.parameters()`) are the gathered copies, not what an optimizer
should hold: an optimizer over them raises at its first step (misuse.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, NoReturn

import torch
import torch.distributed as dist
from torch import nn

import parcourse.zero.clip as clip
import parcourse.zero.state_dict as checkpoint
from parcourse.comm import Algorithm, Comm, Pending
from parcourse.comm.link import Network
from parcourse.data_parallel.base import GradSyncModule, weakly
from parcourse.data_parallel.bucketed import group_by_size
from parcourse.trace import Tracer
from parcourse.zero.layout import FlatUnit
from parcourse.zero.misuse import mark_sharded_away
from parcourse.zero.mixed_precision import (
    STEPS_DISAGREE,
    check_compute_dtype,
    forward_in,
    frozen_in_compute_dtype,
    keep_in_own_dtype,
)
from parcourse.zero.offload import OffloadTarget, check_offload, host_device

_MAX_IN_FLIGHT = 2


class ZeroStage1(GradSyncModule):
    """`ZeroStage1(module, group=None, *, bucket_mb=25.0, compute_dtype=None,
    algorithm="auto", keep_modules=(), offload_optimizer=None, link=None, tracer=None)`;
    `ZeroModel(module, stage=1)` builds one.

    Use it like the module; build the optimizer from its `parameters()`.

    - `bucket_mb`: parameters travel in units of about this size, in backward order.
    - `compute_dtype=torch.bfloat16` (or float16): parameters, gradients and messages
      in 16 bits; the optimizer steps fp32 masters and gets fp32 gradients (as FSDP2
      with a bf16 `param_dtype`; mixed_precision.py). Weights frozen before wrapping
      stay whole and in their own dtype, and each forward uses a 16-bit copy of them.
    - `algorithm`: "ring" (this course's, built from send/recv, which counts the bytes
      it sends), "torch" (torch.distributed's collectives), or "auto": the ring on
      gloo, torch's otherwise.
    - `keep_modules`: modules left unsharded (FSDP's ignored modules), e.g. norms:
      replicated on every rank, gradients all-reduced, and kept in their own dtype
      (fp32) under mixed precision, their inputs cast to it.
    - `offload_optimizer="cpu"`: ZeRO-Offload (offload.py): the fp32 masters, so the
      optimizer's state and its update, live in host memory; gradients go there unit by
      unit as their reduction ends. (On disk: `zero.shard(..., offload_optimizer="nvme")`.)
    - `link`: a simulated link or two-level `Topology` for the ring's messages.
    """

    stage: ClassVar[int] = 1
    sharded_weights: ClassVar[bool] = False  # stage 3: a unit's full weights only while used

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        bucket_mb: float = 25.0,
        compute_dtype: torch.dtype | None = None,
        algorithm: Algorithm = "auto",
        keep_modules: Iterable[nn.Module] = (),
        offload_optimizer: OffloadTarget = None,
        link: Network | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        compute_dtype = check_compute_dtype(compute_dtype)
        self.offload_optimizer = check_offload(offload_optimizer)
        self.offload_params = getattr(self, "offload_params", False)  # stage 3 sets it
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("the model has no parameter that requires a gradient")
        keep_modules = list(keep_modules)
        inside = {id(m) for m in module.modules()}
        for m in keep_modules:
            if id(m) not in inside:
                raise ValueError(
                    f"keep_modules: {type(m).__name__} is not a submodule of the model"
                )
        # Broadcast from the first rank, gradient hooks, no_sync, the end-of-backward call.
        super().__init__(module, group, tracer)
        self.compute_dtype = compute_dtype
        self.comm = Comm(self.group, tracer=tracer, algorithm=algorithm, link=link)
        self.link = link
        kept = {id(p) for m in keep_modules for p in m.parameters()}
        self.kept_params = [p for p in self.sync_params if id(p) in kept]
        sharded = [p for p in self.sync_params if id(p) not in kept]
        self.host = host_device() if self.offload_optimizer else None
        self.units = [
            FlatUnit(
                i,
                params,
                self.rank,
                self.world_size,
                self.compute_dtype,
                sharded_weights=self.sharded_weights,
                host=self.host,
                params_on_host=self.offload_params,
            )
            for i, params in enumerate(self._group_params(module, sharded, bucket_mb))
        ]
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        # Gradients arrive last layer first; units are launched strictly in that order.
        self._backward_order = self._in_backward_order(self.units)
        self._next = 0
        self._kept_ready = False
        mark_sharded_away(sharded)
        self._follows = {id(p): True for p in sharded}
        module.register_forward_pre_hook(weakly(self._follow_requires_grad))
        self._install_gathers(module)
        if self.compute_dtype is not None:  # run in their own dtype; hand back 16 bits
            keep_in_own_dtype(keep_modules, self.compute_dtype)
            frozen_in_compute_dtype(
                module,
                [*self.sync_params, *(p for m in keep_modules for p in m.parameters())],
                self.compute_dtype,
            )

    # -- how parameters are grouped, and when they are gathered (stage 3 changes both)

    def _group_params(
        self, module: nn.Module, params: list[nn.Parameter], bucket_mb: float
    ) -> list[list[nn.Parameter]]:
        """Units of about bucket_mb in backward order, as data parallelism's buckets."""
        return group_by_size(params, bucket_mb)

    def _in_backward_order(self, units: list[FlatUnit]) -> list[FlatUnit]:
        return units  # group_by_size already walks the parameters backwards

    def _install_gathers(self, module: nn.Module) -> None:
        """The weights stay whole on every rank: before a forward, gather the rows that
        an optimizer stepped since the last one. The hook is the module's, not the
        wrapper's: a loop that calls the module itself, as FSDP2's `fully_shard` allows,
        sees the new weights too."""
        module.register_forward_pre_hook(weakly(self._gather_if_stepped), prepend=True)

    def _follow_requires_grad(self, module: nn.Module, args: Any) -> None:
        """A shard and its module parameter are two tensors: whichever one's
        requires_grad was changed since the last forward (freezing layers through
        `named_parameters()`, or the module's own), the other follows. A frozen
        parameter then makes no gradient, and its shard gets none, as in one process."""
        for unit in self.units:
            for p, sp in zip(unit.params, unit.shard_params):
                last = self._follows[id(p)]
                now = p.requires_grad if p.requires_grad != last else sp.requires_grad
                if p.requires_grad != now:
                    p.requires_grad_(now)
                if sp.requires_grad != now:
                    sp.requires_grad_(now)
                self._follows[id(p)] = now

    def _gather_if_stepped(self, module: nn.Module, args: Any) -> None:
        """Before a forward, gather the units whose master an optimizer changed."""
        futures = [
            (u, self.comm.all_gather(*u.gather_buffers(), async_op=True), time.perf_counter_ns())
            for u in self.units
            if u.stepped()
        ]
        for unit, future, started in futures:
            unit.fill(future.result())
            self._comm_span("all_gather", started, unit)

    # -- what an optimizer sees

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's shards under the module's names (prefixed "module.", as DDP's),
        then the parameters left whole: kept modules' and frozen ones."""
        shards = {id(p): sp for u in self.units for p, sp in zip(u.params, u.shard_params)}
        for name, p in self.module.named_parameters(remove_duplicate=remove_duplicate):
            yield f"{prefix}{'.' if prefix else ''}module.{name}", shards.get(id(p), p)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compute_dtype is None:
            return super().forward(*args, **kwargs)
        if self.compute_dtype == torch.float16:
            self._check_steps_agree()
        return forward_in(self.compute_dtype, super().forward, args, kwargs)

    def _check_steps_agree(self) -> None:
        """fp16 skips steps (loss scaling): every rank must have skipped or stepped alike
        since the last forward, or its rows belong to another model (STEPS_DISAGREE).
        One all-reduce of one number a forward, under fp16 only."""
        now = tuple(u.master._version for u in self.units)
        last, self._versions = getattr(self, "_versions", None), now
        if last is None or self.world_size == 1:
            return
        stepped = torch.tensor([float(now != last)], device=self.units[0].full.device)
        dist.all_reduce(stepped, group=self.group)
        if 0 < stepped.item() < self.world_size:
            raise RuntimeError(
                STEPS_DISAGREE.format(stepped=int(stepped.item()), world=self.world_size)
            )

    def _comm_span(self, name: str, started: int, unit: FlatUnit) -> None:
        if self.tracer is not None:
            self.tracer.add_span(
                name,
                started,
                time.perf_counter_ns(),
                kind="comm",
                unit=unit.index,
                size=unit.nbytes,
            )

    # -- gradients: reduce-scattered unit by unit when backward ends

    def grad_ready(self, param: torch.Tensor) -> None:
        """Stage 1 keeps the full gradient until backward ends: only note it."""
        unit = self._unit_of.get(id(param))
        if unit is None:  # a kept module's parameter: all-reduced when backward ends
            self._kept_ready = True
            return
        unit.ready.add(id(param))

    def _launch(self, unit: FlatUnit) -> None:
        """Start reducing the unit's gradients; from here on they live in the reduction."""
        # At most two in flight: each is as big as its unit's full gradient, and stages
        # 2-3 exist to not hold all of those at once. The oldest is finished (its buffer
        # freed) before this unit's buffer is made, not after.
        in_flight = [u for u in self._backward_order if u.pending is not None]
        for older in in_flight[: len(in_flight) + 1 - _MAX_IN_FLIGHT]:
            self._finish(older)
        parts = self._take_gradients(unit)
        unit.pending = (self._reduce_scatter(unit, parts), time.perf_counter_ns(), parts)
        self._next = self._backward_order.index(unit) + 1

    def _reduce_scatter(self, unit: FlatUnit, parts: torch.Tensor) -> Pending:
        """Start the reduction of a unit's gradients, (N, part_numel + flags), to this
        rank's part (stage 3's ZeRO++ quantizes it)."""
        return self.comm.reduce_scatter(parts.view(-1), async_op=True)

    def _take_gradients(self, unit: FlatUnit) -> torch.Tensor:
        """Pack the unit's local gradients (and a used-flag per parameter in every rank's
        part) into a whole buffer, (N, part_numel + flags); drop the parameters' own."""
        k = len(unit.params)
        parts = torch.empty(
            self.world_size, unit.part_numel + k, dtype=unit.full.dtype, device=unit.full.device
        )
        unit.pack([p.grad for p in unit.params], parts)
        used = torch.tensor([float(p.grad is not None) for p in unit.params], dtype=parts.dtype)
        parts[:, unit.part_numel :] = used  # every rank's part ends with the same flags
        for p in unit.params:
            p.grad = None
        return parts

    def finish_gradient_sync(self) -> None:
        """Wait for every reduction; afterwards each shard parameter holds its gradient."""
        if not (self._kept_ready or any(u.ready or u.pending for u in self.units)):
            return
        kept = self._start_kept_all_reduce()
        for unit in self._backward_order[self._next :]:  # units some parameter never reached,
            self._launch(unit)  # or all of them (stage 1)
        for unit in self._backward_order:
            if unit.pending is not None:
                self._finish(unit)
            unit.ready.clear()
        self._next = 0
        if kept is not None:
            self._finish_kept(*kept)
        self._host_ready()

    def _host_ready(self) -> None:
        """Offloaded from a GPU: wait for the gradients' copies to the host to land."""
        if (
            self.host is not None
            and torch.cuda.is_available()
            and any(u.full.is_cuda for u in self.units)
        ):
            torch.cuda.current_stream().synchronize()

    def _finish(self, unit: FlatUnit) -> None:
        """Wait for one unit's reduce-scatter; add the average into the shards' .grad."""
        future, started, _ = unit.pending
        part = future.result()
        unit.pending = None  # the full-size buffer is freed here
        self._comm_span("reduce_scatter", started, unit)
        k = len(unit.params)
        used = part[unit.part_numel :].tolist()
        # Offloaded: to the host, where the masters and the optimizer are (a copy that
        # overlaps the GPU's work; `_host_ready` waits for it before the host reads).
        grad = (
            part[: unit.part_numel]
            .div_(self.world_size)
            .to(unit.master.device, unit.dtype, non_blocking=True)
        )
        if any(sp.grad is not None for sp in unit.shard_params):
            self._host_ready()
        for i, (sp, count) in enumerate(zip(unit.shard_params, used)):
            if count == 0:  # no rank used it: no gradient, as in one process
                continue
            piece = unit.shard_of(grad, i)
            if sp.grad is None:
                sp.grad = piece
            else:  # accumulate across steps until zero_grad, like .grad does
                sp.grad.add_(piece)
        assert len(used) == k

    # -- kept modules: replicated, their gradients all-reduced as in DDP

    def _start_kept_all_reduce(self) -> tuple[Pending, list[nn.Parameter]] | None:
        """All-reduce every kept parameter's gradient (zeros where this rank has none) and
        a used-flag each: every rank sends the same layout whichever modules it ran, and a
        parameter no rank used keeps no gradient, as in one process."""
        self._kept_ready = False
        if not self.kept_params:
            return None
        first = self.kept_params[0]
        pieces = [
            p.grad.reshape(-1).to(first.dtype)
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=first.dtype, device=first.device)
            for p in self.kept_params
        ]
        used = torch.tensor(
            [float(p.grad is not None) for p in self.kept_params],
            dtype=first.dtype,
            device=first.device,
        )
        return self.comm.all_reduce(torch.cat([*pieces, used]), async_op=True), self.kept_params

    def _finish_kept(self, future: Pending, params: list[nn.Parameter]) -> None:
        flat = future.result()
        used = flat[-len(params) :]
        flat = flat[: -len(params)].div_(self.world_size)
        offset = 0
        for p, count in zip(params, used.tolist()):
            piece = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if count == 0:  # no rank used it
                continue
            if p.grad is None:
                p.grad = piece.to(p.dtype, copy=True)
            else:
                p.grad.copy_(piece)

    # -- helpers an ordinary training loop needs

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The shards' gradients, and any local gradient still waiting (no_sync)."""
        for p in [*self.parameters(), *self.module.parameters()]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:  # as torch's zero_grad, but a shard's gradient is a view: no detach_
                if p.grad.grad_fn is not None:
                    p.grad = p.grad.detach()
                p.grad.zero_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients by their norm over the whole model (every rank's shards);
        returns that norm. torch.nn.utils.clip_grad_norm_ on the shards would see only
        this rank's rows."""
        self.finish_gradient_sync()
        return clip.clip_grad_norm_(self.units, self.kept_params, self.group, max_norm, norm_type)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights (gathered fp32 masters) and buffers, on every rank."""
        return checkpoint.full_state_dict(self.module, self.units, self.group)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load unsharded weights (as `full_state_dict` returns them): every rank takes its
        own rows, so no rank waits for another. The next forward gathers them."""
        checkpoint.load_full_state_dict(self.module, self.units, state)

    def state_dict(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(checkpoint.STATE_DICT_REFUSED)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(checkpoint.LOAD_STATE_DICT_REFUSED)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, by category, for memory accounting.

        Gradient buffers still being reduced count as "other" (temporary buffers).
        """
        params = [u.full for u in self.units if u.gathered()]
        whole = [p for p in self.module.parameters() if id(p) not in self._unit_of]
        grads = [sp.grad for u in self.units for sp in u.shard_params if sp.grad is not None]
        grads += [p.grad for p in self.module.parameters() if p.grad is not None]
        in_flight = [u.pending[2] for u in self.units if u.pending is not None]
        memory = {"params": params + whole, "grads": grads, "other": in_flight}
        # Masters apart from the weights (mixed precision, offload): optimizer state in
        # ZeRO's count.
        masters = [
            u.master
            for u in self.units
            if u.master is not u.full and u.master is not u.compute_shard
        ]
        if masters:
            memory["optimizer"] = masters
        return memory

"""ZeRO stages 1, 2 and 3 (Rajbhandari et al., arXiv:1910.02054), one wrapper for all.

Data parallelism keeps a full copy of everything on every rank: parameters (W),
gradients (G) and optimizer state (O, two tensors for Adam). ZeRO removes the
copies, one kind at a time:

- stage 1: O sharded. Gradients are all-reduced as in DDP; each rank updates
  only its shard of the parameters, then the shards are all-gathered.
- stage 2: O and G sharded. Gradients are reduce-scattered (bucket by bucket,
  during backward): each rank keeps only the gradient of its own shard.
- stage 3: O, G and W sharded. A layer's parameters are all-gathered just
  before its forward and again before its backward, and freed after; the next
  layer's gather is started early (prefetch).

Layout: parameters are grouped into *units* (buckets of about `bucket_mb` in
reverse order for stages 1-2; one unit per module for stage 3). Each unit is
flattened into one 1-D buffer, padded to a multiple of N, and rank r owns slice
r of it (as FSDP does), so every gather and reduce-scatter is even whatever the
parameter shapes. The optimizer (yours, from `optimizer_factory`) only ever
sees this rank's shards.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from parcourse._compat import all_gather_single, reduce_scatter_single
from parcourse.data_parallel.base import GradSyncModule
from parcourse.data_parallel.bucketed import group_by_size
from parcourse.memory import tensors_in
from parcourse.trace import Tracer

Stage = Literal[1, 2, 3]
_MAX_IN_FLIGHT = 2


@dataclass(eq=False)
class FlatUnit:
    """Parameters flattened, sharded and gathered together."""

    index: int
    params: list[nn.Parameter]
    rank: int
    world_size: int
    module: nn.Module | None = None  # stage 3: the module whose forward needs these
    compute_dtype: torch.dtype | None = None  # e.g. bf16: params, grads and messages
    full: torch.Tensor = field(init=False)  # the gathered flat parameters (padded)
    shard: torch.Tensor = field(init=False)  # this rank's slice: the master copy (fp32)
    grad_full: torch.Tensor | None = None  # stage 1: all-reduced gradients
    grad_shard: torch.Tensor | None = None  # the gradient of `shard`
    ready: set[int] = field(default_factory=set)
    pending: Any = None  # (work, result, keep-alive buffer, launch time)
    gathering: Any = None  # stage 3: an all-gather in flight

    def __post_init__(self) -> None:
        self.numels = [p.numel() for p in self.params]
        *self.offsets, self.numel = itertools.accumulate(self.numels, initial=0)
        self.padded = math.ceil(self.numel / self.world_size) * self.world_size
        self.shard_numel = self.padded // self.world_size
        self.start = self.rank * self.shard_numel
        p0 = self.params[0]
        master = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        for p, offset, n in zip(self.params, self.offsets, self.numels):
            master[offset:offset + n] = p.detach().reshape(-1)
        # This rank's slice of the weights, in the parameters' own dtype (fp32): what
        # the optimizer updates. Without mixed precision it is a view into `full`.
        self.full = master if self.compute_dtype is None else master.to(self.compute_dtype)
        self.shard = master[self.start:self.start + self.shard_numel]
        # What is gathered: the shard itself, or (mixed precision) a 16-bit copy of it.
        self.compute_shard = self.shard
        if self.compute_dtype is not None:
            self.shard = self.shard.clone()
            self.compute_shard = self.shard.to(self.compute_dtype)
        with torch.no_grad():  # the module's parameters become views into `full`
            for p, offset, n in zip(self.params, self.offsets, self.numels):
                p.data = self.full[offset:offset + n].view(p.shape)

    @property
    def nbytes(self) -> int:
        return self.padded * self.full.element_size()

    def complete(self) -> bool:
        """Every parameter's gradient of this backward is in."""
        return len(self.ready) == len(self.params)

    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Give the full parameters' memory back; the views stay, pointing at nothing."""
        if self.gathering is not None:  # a prefetch still writing into it (a unit unused
            self.gathering[0].wait()    # this step): let it land first
            self.gathering = None
        self.full.untyped_storage().resize_(0)

    def start_gather(self, group: dist.ProcessGroup) -> None:
        """Re-allocate `full` and start filling it from every rank's shard."""
        if self.gathered() or self.gathering is not None:
            return
        self.full.untyped_storage().resize_(self.nbytes)
        work = all_gather_single(self.full, self.compute_shard, group=group, async_op=True)
        self.gathering = (work, time.perf_counter_ns())


class ZeroModel(GradSyncModule):
    """The model half of `parcourse.zero.shard(...)`; use it like the model."""

    def __init__(self, module: nn.Module, stage: Stage, group: dist.ProcessGroup | None = None,
                 *, bucket_mb: float = 25.0, prefetch: bool = True,
                 compute_dtype: torch.dtype | None = None, tracer: Tracer | None = None) -> None:
        if compute_dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"compute_dtype must be torch.bfloat16, torch.float16 or None, "
                             f"got {compute_dtype}")
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("the model has no parameter that requires a gradient")
        # Broadcast from the first rank, gradient hooks, no_sync, the end-of-backward call.
        super().__init__(module, group, tracer)
        self.stage, self.prefetch = stage, prefetch
        self.compute_dtype = None if compute_dtype == torch.float32 else compute_dtype
        self.units = self._make_units(module, self.sync_params, bucket_mb)
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        # Gradients arrive last layer first; units are launched strictly in that order.
        self._backward_order = self.units if stage < 3 else self.units[::-1]
        self._next = 0
        if stage == 3:
            for unit in self.units:
                if unit.compute_dtype is None:  # the master must outlive `full`
                    unit.shard = unit.compute_shard = unit.shard.clone()
                unit.free()
                assert unit.module is not None
                unit.module.register_forward_pre_hook(self._before_forward(unit))
                unit.module.register_forward_hook(self._after_forward(unit))

    def _make_units(self, module: nn.Module, trainable: list[nn.Parameter],
                    bucket_mb: float) -> list[FlatUnit]:
        if self.stage < 3:
            groups = [(g, None) for g in group_by_size(trainable, bucket_mb)]
        else:  # one unit per module that owns parameters, in forward (registration) order
            owner: dict[int, nn.Module] = {}
            groups = []
            for m in module.modules():
                own = [p for p in m.parameters(recurse=False) if p.requires_grad]
                for p in own:
                    if id(p) in owner:
                        raise ValueError("stage 3 shards each module's parameters on their own; "
                                         "a parameter shared by two modules (tied weights) "
                                         "needs stage 1 or 2")
                    owner[id(p)] = m
                if own:
                    groups.append((own, m))
        return [FlatUnit(i, params, self.rank, self.world_size, m, self.compute_dtype)
                for i, (params, m) in enumerate(groups)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compute_dtype is None:
            return super().forward(*args, **kwargs)
        # Mixed precision: inputs in, outputs out of the compute dtype; the loss stays fp32.
        cast = lambda t, d: t.to(d) if torch.is_floating_point(t) else t  # noqa: E731
        args, kwargs = tree_map_only(torch.Tensor, lambda t: cast(t, self.compute_dtype),
                                     (args, kwargs))
        out = super().forward(*args, **kwargs)
        return tree_map_only(torch.Tensor, lambda t: cast(t, torch.float32), out)

    # -- stage 3: gather before use, free after

    def _wait_gather(self, unit: FlatUnit) -> None:
        unit.start_gather(self.group)
        if unit.gathering is not None:
            work, started = unit.gathering
            work.wait()
            unit.gathering = None
            if self.tracer is not None:
                self.tracer.add_span("all_gather", started, time.perf_counter_ns(), kind="comm",
                                     unit=unit.index, bytes=unit.nbytes)

    def _before_forward(self, unit: FlatUnit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._wait_gather(unit)
            if self.prefetch and unit.index + 1 < len(self.units):
                self.units[unit.index + 1].start_gather(self.group)
        return hook

    def _after_forward(self, unit: FlatUnit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            unit.free()  # backward gathers again:
            if torch.is_grad_enabled():  # when the gradient of the output arrives
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(self._before_backward(unit))
        return hook

    def _before_backward(self, unit: FlatUnit) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._wait_gather(unit)
            if self.prefetch and unit.index > 0:
                self.units[unit.index - 1].start_gather(self.group)
        return hook

    # -- gradients: reduce (stage 1) or reduce-scatter (stages 2, 3) unit by unit

    def grad_ready(self, param: torch.Tensor) -> None:
        self._unit_of[id(param)].ready.add(id(param))
        order = self._backward_order
        while self._next < len(order) and order[self._next].complete():
            self._launch(order[self._next])

    def _launch(self, unit: FlatUnit) -> None:
        buffer = torch.zeros(unit.padded, dtype=unit.full.dtype, device=unit.full.device)
        for p, offset, n in zip(unit.params, unit.offsets, unit.numels):
            if p.grad is not None:
                buffer[offset:offset + n] = p.grad.reshape(-1)
            p.grad = None  # from here on the gradient lives in the bucket
        if self.stage == 3:
            unit.free()
        started = time.perf_counter_ns()
        if self.stage == 1:
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
            unit.pending = (work, buffer, buffer, started)
        else:
            out = torch.empty(unit.shard_numel, dtype=buffer.dtype, device=buffer.device)
            work = reduce_scatter_single(out, buffer, group=self.group, async_op=True)
            unit.pending = (work, out, buffer, started)
        self._next = self._backward_order.index(unit) + 1
        # At most two buckets in flight: each is as big as its unit's full gradient,
        # and stages 2-3 exist to not hold all of those at once.
        in_flight = [u for u in self._backward_order if u.pending is not None]
        for older in in_flight[:-_MAX_IN_FLIGHT]:
            self._finish(older)

    def finish_gradient_sync(self) -> None:
        """Wait for every unit's reduction; afterwards each rank holds its shards' gradients."""
        if not any(u.ready or u.pending for u in self.units):
            return
        for unit in self._backward_order[self._next:]:  # units some parameter never reached
            self._launch(unit)
        for unit in self._backward_order:
            if unit.pending is not None:
                self._finish(unit)
            unit.ready.clear()
        self._next = 0

    def _finish(self, unit: FlatUnit) -> None:
        """Wait for one unit's reduction and keep what this rank needs of it."""
        work, result, _, started = unit.pending
        work.wait()
        if self.tracer is not None:
            name = "all_reduce" if self.stage == 1 else "reduce_scatter"
            self.tracer.add_span(name, started, time.perf_counter_ns(), kind="comm",
                                 unit=unit.index, bytes=unit.nbytes)
        result.div_(self.world_size)
        if self.stage == 1:  # full averaged gradients, as DDP leaves them
            unit.grad_full = result
            shard = result[unit.start:unit.start + unit.shard_numel]
            for p, offset, n in zip(unit.params, unit.offsets, unit.numels):
                p.grad = result[offset:offset + n].view(p.shape)
        else:
            shard = result
        # Accumulate across backward passes until zero_grad, like .grad does.
        unit.grad_shard = shard if unit.grad_shard is None else unit.grad_shard + shard
        unit.pending = None  # stages 2-3: the full-size bucket is freed here

    # -- after the optimizer step

    def gather_parameters(self) -> None:
        """Stages 1-2: every rank updated its shard; put the full parameters back together."""
        if self.stage == 3:  # gathered when next needed, from the (refreshed) 16-bit shard
            for u in self.units:
                if u.compute_shard is not u.shard:
                    u.compute_shard.copy_(u.shard)
            return
        works = [all_gather_single(u.full, u.shard.to(u.full.dtype, copy=True), group=self.group,
                                   async_op=True) for u in self.units]
        for w in works:
            w.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.units:
            unit.grad_shard = unit.grad_full = None
            for p in unit.params:
                p.grad = None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded weights (gathered fp32 masters) and buffers, on every rank."""
        state = {k: v.detach().clone() for k, v in self.module.state_dict(keep_vars=True).items()
                 if not isinstance(v, nn.Parameter) or not v.requires_grad}
        names = {id(p): n for n, p in self.module.named_parameters(remove_duplicate=False)}
        for unit in self.units:
            full = torch.empty(unit.padded, dtype=unit.shard.dtype, device=unit.shard.device)
            all_gather_single(full, unit.shard, group=self.group)
            for p, offset, n in zip(unit.params, unit.offsets, unit.numels):
                state[names[id(p)]] = full[offset:offset + n].view(p.shape).clone()
        return {k: state[k] for k in self.module.state_dict()}

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, by category, for memory accounting.

        Buckets still being reduced count as "other" (temporary buffers).
        """
        params = [u.full for u in self.units if u.gathered()]
        masters = [u.shard for u in self.units]
        if self.stage == 3:
            params += [u.compute_shard for u in self.units]  # the master itself, in fp32
        frozen = [p for p in self.module.parameters() if not p.requires_grad]
        grads = [g for u in self.units for g in (u.grad_full, u.grad_shard) if g is not None]
        grads += [p.grad for u in self.units for p in u.params if p.grad is not None]
        other = [t for u in self.units if u.pending is not None for t in u.pending[1:3]]
        memory = {"params": params + frozen, "grads": grads, "other": other}
        if self.compute_dtype is not None:  # fp32 masters: optimizer state in ZeRO's count
            memory["optimizer"] = masters
        return memory


class ShardedOptimizer:
    """The optimizer half of `parcourse.zero.shard(...)`: yours, over this rank's shards."""

    def __init__(self, model: ZeroModel,
                 optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.model = model
        # Each shard as a Parameter sharing its memory: the optimizer updates it in place.
        self.shard_params = [nn.Parameter(u.shard, requires_grad=True) for u in model.units]
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
        for unit, param in zip(self.model.units, self.shard_params):
            grad = unit.grad_shard
            param.grad = grad.to(param.dtype) if grad is not None else None  # 16-bit -> fp32
        self.optimizer.step()
        for param in self.shard_params:
            param.grad = None  # the fp32 copies were only for this step
        self.model.gather_parameters()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad()
        for param in self.shard_params:
            param.grad = None

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
          prefetch: bool = True, tracer: Tracer | None = None
          ) -> tuple[ZeroModel, ShardedOptimizer]:
    """Shard a model and its optimizer with ZeRO `stage`; use the pair as before.

    >>> model, opt = zero.shard(net, lambda ps: torch.optim.Adam(ps, lr=1e-3), stage=2)
    >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

    `mixed_precision=torch.bfloat16` (or float16): parameters, gradients and
    communication in 16 bits, fp32 master weights in the optimizer (2 + 2 + 12
    bytes per parameter before sharding, as in the ZeRO paper).
    """
    zero_model = ZeroModel(model, stage, group, bucket_mb=bucket_mb, prefetch=prefetch,
                           compute_dtype=mixed_precision, tracer=tracer)
    return zero_model, ShardedOptimizer(zero_model, optimizer_factory)

"""What every data-parallel wrapper here shares with torch's DistributedDataParallel.

- The same weights everywhere: parameters and buffers are broadcast from the
  group's first rank when the wrapper is made; with `broadcast_buffers` (the data-
  parallel wrappers' default, as DDP's) the buffers again before each forward that follows
  a training forward.
- `forward` passes through to `.module`.
- Gradients are synchronized when `loss.backward()` returns. A hook on each
  parameter (`register_post_accumulate_grad_hook`) tells the wrapper when that
  parameter's gradient is ready; the first one in a backward queues a callback
  that autograd runs when the whole backward pass is done (DDP does the same).
- `no_sync()` skips synchronization, for gradient accumulation: gradients add
  up locally and the next backward outside `no_sync` averages the sum.
- `finish_gradient_sync()` waits for what is still in flight; it is a no-op
  when the backward callback has already done it.
"""

from __future__ import annotations

import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm import global_rank, group_info
from parcourse.memory import tensors_in
from parcourse.trace import Tracer


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """A hook that calls a wrapper's method through a weak reference. A parameter's
    post-accumulate-grad hook held strongly closes a cycle (wrapper -> module ->
    parameter -> hook -> wrapper) through a list the garbage collector cannot see, so a
    wrapper would never be freed, and a pool's ranks, which live on between runs, would
    keep every model built; a module's forward hook held strongly keeps a dropped
    wrapper alive as long as its module, still syncing and checking it."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


def broadcast_module(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Make every rank's parameters and buffers equal to the group's first rank's."""
    src = global_rank(group, 0)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


class GradSyncModule(nn.Module, ABC):
    """Base of the data-parallel wrappers: hooks, no_sync, the end-of-backward callback."""

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None,
        tracer: Tracer | None,
        broadcast_buffers: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self._buffers_due = False  # broadcast at construction; again after a training forward
        self.group, self.rank, self.world_size = group_info(group)
        self.tracer = tracer
        self.sync_enabled = True
        self._callback_queued = False
        self._backward_start: int | None = None
        broadcast_module(module, self.group)
        # Frozen parameters never get gradients; they take no part in synchronization.
        self.sync_params = [p for p in module.parameters() if p.requires_grad]
        self._hooks = [
            p.register_post_accumulate_grad_hook(weakly(self._hook)) for p in self.sync_params
        ]
        synced = {id(p) for p in self.sync_params}
        self._frozen = [(name, p) for name, p in module.named_parameters() if id(p) not in synced]
        module.register_forward_pre_hook(weakly(self._check_frozen))

    def _check_frozen(self, module: nn.Module, args: Any) -> None:
        """A parameter frozen when the wrapper was made has no hook and is in no bucket
        or shard: unfrozen later, each rank would train its own copy. Refuse."""
        thawed = [name for name, p in self._frozen if p.requires_grad]
        if thawed:
            raise ValueError(
                f"{', '.join(thawed)} did not require a gradient when the model was wrapped "
                f"and {'do' if len(thawed) > 1 else 'does'} now: wrap the model after "
                "unfreezing (frozen parameters take no part in synchronization)"
            )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self._buffers_due:
            # As DDP's broadcast_buffers: a forward after a training forward (evaluation
            # too) starts from the first rank's buffers (BatchNorm's running statistics).
            src = global_rank(self.group, 0)
            with torch.no_grad():
                for b in self.module.buffers():
                    dist.broadcast(b, src=src, group=self.group)
        self._buffers_due = torch.is_grad_enabled() and self.sync_enabled
        out = self.module(*args, **kwargs)
        if self.tracer is not None and torch.is_grad_enabled():
            first = next((t for t in tensors_in(out) if t.requires_grad), None)
            if first is not None:  # fires at the very start of backward
                first.register_hook(self._mark_backward_start)
        return out

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block accumulate gradients locally only."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def _mark_backward_start(self, grad: torch.Tensor) -> None:
        self._backward_start = time.perf_counter_ns()

    def _hook(self, param: torch.Tensor) -> None:
        if not self.sync_enabled:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.grad_ready(param)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self.tracer is not None and self._backward_start is not None:
            self.tracer.add_span(
                "backward", self._backward_start, time.perf_counter_ns(), kind="compute"
            )
            self._backward_start = None
        self.finish_gradient_sync()

    def grad_ready(self, param: torch.Tensor) -> None:
        """Called when `param.grad` holds this backward's gradient."""

    @abstractmethod
    def finish_gradient_sync(self) -> None:
        """Make every synchronized gradient the average over ranks; no-op when done."""

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

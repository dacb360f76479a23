"""ZeRO stage 3: the weights sharded too (Rajbhandari et al., arXiv:1910.02054).

Stage 2 (stage2.py) keeps every weight whole on every rank. Stage 3 keeps only this
rank's rows of them (the fp32 masters, and their 16-bit copy under mixed precision):

- one unit per module with parameters of its own, in forward order (a tied
  parameter goes with its first module);
- a module's units are all-gathered just before its forward and freed after;
  gathered again when the gradient of its output arrives in backward, and freed
  once their gradients are reduce-scattered;
- the next module's gather is started early (prefetch): the one after it in
  forward, the one before it in backward.

1.5x DDP's volume: an all-gather in forward, one in backward, a reduce-scatter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parcourse.memory import tensors_in
from parcourse.trace import Tracer
from parcourse.comm import Algorithm
from parcourse.zero.layout import FlatUnit
from parcourse.zero.stage2 import ZeroStage2


class ZeroStage3(ZeroStage2):
    """`ZeroStage3(module, group=None, *, prefetch=True, ...)`, the arguments of
    `ZeroStage1` and `prefetch` (start the next module's gather early);
    `ZeroModel(module, stage=3)` builds one."""

    stage = 3
    sharded_weights = True

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None, *,
                 prefetch: bool = True, bucket_mb: float = 25.0,
                 compute_dtype: torch.dtype | None = None, algorithm: Algorithm = "auto",
                 keep_modules: Iterable[nn.Module] = (), tracer: Tracer | None = None) -> None:
        super().__init__(module, group, bucket_mb=bucket_mb, compute_dtype=compute_dtype,
                         algorithm=algorithm, keep_modules=keep_modules, tracer=tracer)
        self.prefetch = prefetch

    def _group_params(self, module: nn.Module, params: list[nn.Parameter],
                      bucket_mb: float) -> list[list[nn.Parameter]]:
        """A unit per module with parameters of its own, in forward (registration) order;
        a tied parameter goes with its first module."""
        mine = {id(p) for p in params}
        seen: set[int] = set()
        groups = []
        for m in module.modules():
            new = [p for p in m.parameters(recurse=False) if id(p) in mine and id(p) not in seen]
            if new:
                groups.append(new)
                seen.update(id(p) for p in new)
        return groups

    def _in_backward_order(self, units: list[FlatUnit]) -> list[FlatUnit]:
        return units[::-1]  # units are in forward order

    def _install_gathers(self, module: nn.Module) -> None:
        """Free every unit now; each module gathers the units it needs before it runs."""
        for unit in self.units:
            unit.free()
        for m in module.modules():
            direct = [p for p in m.parameters(recurse=False) if id(p) in self._unit_of]
            if direct:
                indices = sorted({self._unit_of[id(p)].index for p in direct})
                needed = [self.units[i] for i in indices]
                m.register_forward_pre_hook(self._before_forward(needed))
                m.register_forward_hook(self._after_forward(needed))

    # -- gather before use, free after

    def _start_gather(self, unit: FlatUnit) -> None:
        if unit.gathered() or unit.gathering is not None:
            return
        unit.gathering = (self.comm.all_gather(*unit.gather_buffers(), async_op=True),
                          time.perf_counter_ns())

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

    # -- gradients: as stage 2, and the weights freed with them

    def _take_gradients(self, unit: FlatUnit) -> torch.Tensor:
        parts = super()._take_gradients(unit)
        unit.free()  # backward is done with this unit's weights
        return parts

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Stage 2's, and this rank's share of the weights: the fp32 master itself, or
        its 16-bit copy."""
        memory = super().memory_tensors()
        memory["params"] += [u.compute_shard for u in self.units]
        return memory

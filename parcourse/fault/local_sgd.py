"""Replicas that step alone and meet every H steps: LocalSGD averages their weights,
DiLoCo applies an outer optimizer to the average of how far they moved.

    model, inner = make()
    sync = DiLoCo(model, group, every=8)          # or LocalSGD(model, group, every=8)
    for step in range(steps):
        inner.zero_grad()
        loss_fn(model, *batch(step, rank)).backward()
        inner.step()                              # this replica alone: no all-reduce
        sync.step()                               # every 8th call: the replicas meet

Bytes a step fall by H against synchronous data parallelism (BSP: every step's gradients
all-reduced): one all-reduce of the weights every H steps instead of one of the gradients
every step. With H = 1 and plain SGD, LocalSGD is BSP: averaging the weights after each
replica's step w - lr g_r is w - lr mean(g_r). DiLoCo (Douillard et al. 2023) keeps the
weights of the last meeting, w0; at a meeting the pseudo-gradient is w0 - mean(w_r), and
an outer SGD with Nesterov momentum (lr 0.7, momentum 0.9 in the paper) steps w0 with it;
the inner optimizer (AdamW in the paper) keeps its own state on each replica.

torchft ships both (`torchft.local_sgd`), tied to its Manager; these are the same
algorithms over any process group, so that lesson 13 can set them beside BSP."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class LocalSGD:
    """`LocalSGD(model, group, every)`: `step()` after each inner step; every `every`-th
    averages the weights (and floating buffers) over the group. `meetings` counts them,
    `bytes_sent` is what this rank gave the all-reduces (one tensor of the weights each)."""

    model: nn.Module
    group: dist.ProcessGroup | None
    every: int
    steps: int = 0
    meetings: int = 0
    bytes_sent: int = 0

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be at least 1 step, got {self.every}")

    def step(self) -> bool:
        """Count an inner step; True when the replicas met at it."""
        self.steps += 1
        if self.steps % self.every:
            return False
        self._meet()
        self.meetings += 1
        return True

    def _tensors(self) -> list[torch.Tensor]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        return params + buffers

    def _average(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The mean over the group of `tensors`, flat, in one all-reduce."""
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=self.group)
        self.bytes_sent += flat.numel() * flat.element_size()
        return flat / dist.get_world_size(self.group)

    def _meet(self) -> None:
        tensors = self._tensors()
        mean = self._average(tensors)
        with torch.no_grad():
            _unflatten_into(mean, tensors)


@dataclass
class DiLoCo(LocalSGD):
    """`DiLoCo(model, group, every, outer_lr=0.7, momentum=0.9)`: at each meeting, the
    outer SGD (Nesterov) steps the last meeting's weights by the mean pseudo-gradient
    (last meeting's weights minus the replicas' mean); every replica then holds them.
    The weights only, as torchft's: buffers stay each replica's own."""

    outer_lr: float = 0.7
    momentum: float = 0.9
    start: list[torch.Tensor] = field(default_factory=list, init=False)  # the last meeting's

    def __post_init__(self) -> None:
        super().__post_init__()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.start = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(
            self.start, lr=self.outer_lr, momentum=self.momentum, nesterov=True
        )

    def _meet(self) -> None:
        mean = self._average(self.params)
        offset = 0
        for w0, p in zip(self.start, self.params):
            n = p.numel()
            w0.grad = w0 - mean[offset : offset + n].view_as(p)  # the pseudo-gradient
            offset += n
        self.outer.step()
        with torch.no_grad():
            for w0, p in zip(self.start, self.params):
                p.copy_(w0)


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n

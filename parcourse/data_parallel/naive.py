"""Naive data parallelism: after backward, all-reduce every gradient, one by one.

The simplest thing that is correct, and the baseline for what bucketing and
overlap improve: one collective per parameter tensor (many small messages, each
paying the latency alpha), and none of them starts before backward has ended.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm import Algorithm, Comm, SimulatedLink
from parcourse.data_parallel.base import GradSyncModule
from parcourse.trace import Tracer


class NaiveDataParallel(GradSyncModule):
    """`NaiveDataParallel(model, group)`: same weights everywhere, gradients averaged.

    A parameter that got no gradient on any rank this step keeps `grad = None`
    (as in one process, so the optimizer skips it); one that got a gradient on
    some ranks only is averaged with zeros from the others.

    `algorithm` and `link` make its `Comm`: torch's all-reduce, or the course's ring,
    which can go over a simulated link.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        algorithm: Algorithm = "torch",
        link: SimulatedLink | None = None,
        tracer: Tracer | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        comm = Comm(group, link=link, algorithm=algorithm)  # checks them before anything moves
        super().__init__(module, group, tracer, broadcast_buffers)
        self.comm = comm
        self._pending = False

    def grad_ready(self, param: torch.Tensor) -> None:
        self._pending = True

    def finish_gradient_sync(self) -> None:
        if not self._pending:
            return
        self._pending = False
        params = self.sync_params
        # Which parameters got a gradient anywhere? (Every rank must call the same
        # collectives in the same order, so this is agreed on first.)
        used = torch.tensor(
            [p.grad is not None for p in params], dtype=torch.float32, device=params[0].device
        )
        dist.all_reduce(used, group=self.group)
        for i, (p, count) in enumerate(zip(params, used.tolist())):
            if count == 0:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            start = time.perf_counter_ns()
            self.comm.all_reduce(p.grad)
            p.grad.div_(self.world_size)
            if self.tracer is not None:
                self.tracer.add_span(
                    "all_reduce",
                    start,
                    time.perf_counter_ns(),
                    kind="comm",
                    param=i,
                    bytes=p.grad.nbytes,
                )

"""The collectives ZeRO runs on its flat units: torch's (async) or this course's ring.

The stages need three, each started now and waited for later:

    reduce_scatter(buffer) -> Future of this rank's part of the sum
    all_gather(part, whole) -> Future of `whole`, every rank's part in rank order
    all_reduce(buffer)      -> Future of `buffer`, summed over ranks

`UnitCollectives` names that interface; `unit_collectives(group, algorithm, tracer)`
gives the one used today. Nothing else in parcourse.zero calls torch.distributed's
collectives during a step.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from parcourse._compat import all_gather_single, reduce_scatter_single
from parcourse.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from parcourse.trace import Tracer

Algorithm = Literal["auto", "torch", "ring"]


class UnitCollectives(Protocol):
    """Collectives started in the order they are asked for, the same on every rank."""

    def reduce_scatter(self, buffer: torch.Tensor) -> Future[torch.Tensor]: ...

    def all_gather(self, part: torch.Tensor, whole: torch.Tensor) -> Future[torch.Tensor]: ...

    def all_reduce(self, buffer: torch.Tensor) -> Future[torch.Tensor]: ...


def unit_collectives(group: dist.ProcessGroup, algorithm: Algorithm,
                     tracer: Tracer | None) -> UnitCollectives:
    """torch's collectives or the ring (`algorithm`; "auto": the ring on gloo)."""
    return _Comm(group, algorithm, tracer)


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

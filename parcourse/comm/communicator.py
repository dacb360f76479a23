"""One communication object for every strategy: `Comm(group, tracer=, link=, algorithm=)`.

Data parallelism, ZeRO, tensor parallelism and the pipeline runtime all talk
through a `Comm`, so what it adds (bytes counted, a simulated link, CUDA tensors
staged over gloo) reaches every strategy from one place.

- `algorithm`: "torch" (torch.distributed's collectives, run by the backend's
  own threads), "ring" (this course's, built from send/recv: it counts the bytes
  it sends and can go over a simulated link), or "auto": the ring on gloo, whose
  own reduce-scatter and all-gather are slow (docs/zero.md), torch's otherwise.
- The collectives: `all_reduce(tensor, op)` in place, `reduce_scatter(buffer)`
  (this rank's part of the sum), `all_gather(part, whole)`. With
  `async_op=True`, as in torch.distributed, each returns a `Pending` at once:
  torch's run on the backend, the ring on this object's communication thread.
  Everything goes out in the order it is asked for, the same on every rank.
- `send` / `recv`: point to point, through the messenger.

`tracer`: the ring's messages are counted on it (`bytes_sent`) and each ring
step is a span; torch's collectives cannot be looked into.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from parcourse._compat import all_gather_single, reduce_scatter_single
from parcourse.comm.common import Op, backend_for, group_info
from parcourse.comm.link import Network
from parcourse.comm.messenger import Messenger, messenger
from parcourse.comm.ring_fast import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from parcourse.comm.turns import Turns
from parcourse.trace import Tracer

Algorithm = Literal["torch", "ring", "auto"]
ALGORITHMS: tuple[str, ...] = ("torch", "ring", "auto")
_TORCH_OP = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class Pending:
    """A collective in flight, whichever algorithm runs it (the one future type).

    `result()` waits for it and returns its output tensor; afterwards `finished_ns`
    says when it finished (`time.perf_counter_ns()`): exactly, for the ring and for
    a `Comm(timed=True)`; otherwise when `result()` saw it done.
    """

    __slots__ = ("out", "finished_ns", "_work", "_times", "_thread")

    def __init__(
        self,
        out: torch.Tensor | None,
        *,
        work: dist.Work | None = None,
        times: torch.futures.Future | None = None,
        thread: Future[tuple[torch.Tensor, int]] | None = None,
    ) -> None:
        self.out, self.finished_ns = out, 0
        self._work, self._times, self._thread = work, times, thread

    def result(self, timeout: float | None = None) -> torch.Tensor:
        if self._thread is not None:
            self.out, self.finished_ns = self._thread.result(timeout)
        else:
            assert self._work is not None
            self._work.wait()
            # The callback's time, when asked for (it ran on the backend's thread the
            # moment the collective completed); else now.
            self.finished_ns = (
                self._times.wait() if self._times is not None else time.perf_counter_ns()
            )
        assert self.out is not None
        return self.out

    wait = result


def _blocking(collective: Callable[..., Any]) -> Callable[..., Any]:
    """A collective that adds the seconds its blocking calls take to `Comm.blocked_s`."""

    @functools.wraps(collective)
    def timed(self: Comm, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        if async_op:
            return collective(self, *args, async_op=True, **kwargs)
        start = time.perf_counter()
        try:
            return collective(self, *args, **kwargs)
        finally:
            self.blocked_s += time.perf_counter() - start

    return timed


class Comm:
    """The collectives and messages of one process group, torch's or the course's ring.

    `timed=True`: torch's async collectives record when they finish (a callback on
    the backend's thread), for a trace that shows them overlapping other work.
    `blocked_s`: the seconds this rank has spent in its blocking collectives (all-reduce,
    reduce-scatter, all-gather) through this object, so that simulated compute can leave
    them out of the work it pads (`comm.pacing.Pacer`); `before_blocking()`, if
    set, is what tensor parallelism calls before each of its collectives, outside their
    span and not counted (the pacer's `pace`). `turns`: the rank's device when two
    threads take turns on it (`comm.turns.Turns`, DualPipe's overlapped pair, set by
    `PipelineRuntime(turns=)`'s caller): the all-to-all hands the turn on while it waits.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        tracer: Tracer | None = None,
        link: Network | None = None,
        algorithm: Algorithm = "torch",
        timed: bool = False,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose 'torch', 'ring' or 'auto'")
        self.group, self.rank, self.size = group_info(group)
        self._gloo = backend_for(self.group, "cuda") == "gloo"  # gloo alone: CUDA staged
        if algorithm == "auto":  # gloo's own reduce-scatter and all-gather are slow (docs/zero.md)
            ring = link is not None or self._gloo
            algorithm = "ring" if ring else "torch"
        if link is not None and algorithm != "ring":
            raise ValueError(
                "a simulated link needs algorithm='ring' (torch's collectives "
                "cannot be slowed down)"
            )
        self.algorithm: Literal["torch", "ring"] = algorithm
        self.tracer, self.link, self.timed = tracer, link, timed
        self._wires: dict[bool, dist.ProcessGroup | Messenger] = {}
        self._thread: ThreadPoolExecutor | None = None
        self.blocked_s = 0.0
        self.before_blocking: Callable[[], None] | None = None
        self.turns: Turns | None = None

    @functools.cached_property
    def ranks(self) -> tuple[int, ...]:
        """The group's members as global ranks, in the group's order."""
        return tuple(dist.get_process_group_ranks(self.group))

    def __repr__(self) -> str:
        return (
            f"Comm(rank {self.rank} of {self.size}, algorithm={self.algorithm!r}, "
            f"link={self.link!r})"
        )

    # -- collectives

    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: Op = ..., *, async_op: Literal[False] = ...
    ) -> torch.Tensor: ...
    @overload
    def all_reduce(
        self, tensor: torch.Tensor, op: Op = ..., *, async_op: Literal[True]
    ) -> Pending: ...

    @_blocking
    def all_reduce(
        self, tensor: torch.Tensor, op: Op = "sum", *, async_op: bool = False
    ) -> torch.Tensor | Pending:
        """`tensor` reduced over the group, in place (and returned)."""
        if self.algorithm == "ring" and tensor.is_meta:
            return self._shape_only(tensor, async_op)
        if self.algorithm == "ring":

            def ring() -> torch.Tensor:
                return ring_all_reduce(tensor, self.group, op, tracer=self.tracer, link=self.link)

            return self._on_thread(ring) if async_op else ring()
        if op == "avg" and not async_op:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
            return tensor.div_(self.size)
        if op == "avg":
            raise ValueError("op 'avg' with async_op=True: use 'sum' and divide")
        work = dist.all_reduce(tensor, op=_TORCH_OP[op], group=self.group, async_op=async_op)
        return self._pending(work, tensor) if async_op else tensor

    @overload
    def reduce_scatter(
        self, buffer: torch.Tensor, *, async_op: Literal[False] = ...
    ) -> torch.Tensor: ...
    @overload
    def reduce_scatter(self, buffer: torch.Tensor, *, async_op: Literal[True]) -> Pending: ...

    @_blocking
    def reduce_scatter(
        self, buffer: torch.Tensor, *, async_op: bool = False
    ) -> torch.Tensor | Pending:
        """This rank's part of `buffer` summed over ranks: rank r's is chunk r of N equal
        ones. `buffer` (contiguous, numel divisible by N) is the ring's scratch: its
        contents afterwards are undefined."""
        if self.algorithm == "ring" and buffer.is_meta:
            return self._shape_only(buffer.view(-1)[: buffer.numel() // self.size], async_op)
        if self.algorithm == "ring":

            def ring() -> torch.Tensor:
                return ring_reduce_scatter(
                    buffer, self.group, tracer=self.tracer, link=self.link, scratch=True
                )

            return self._on_thread(ring) if async_op else ring()
        out = torch.empty(buffer.numel() // self.size, dtype=buffer.dtype, device=buffer.device)
        work = reduce_scatter_single(out, buffer, group=self.group, async_op=async_op)
        return self._pending(work, out) if async_op else out

    @overload
    def all_gather(
        self, part: torch.Tensor, whole: torch.Tensor, *, async_op: Literal[False] = ...
    ) -> torch.Tensor: ...
    @overload
    def all_gather(
        self, part: torch.Tensor, whole: torch.Tensor, *, async_op: Literal[True]
    ) -> Pending: ...

    @_blocking
    def all_gather(
        self, part: torch.Tensor, whole: torch.Tensor, *, async_op: bool = False
    ) -> torch.Tensor | Pending:
        """Every rank's `part`, in rank order, into the contiguous 1-D `whole` (returned);
        `part` may be this rank's own chunk of `whole`."""
        if self.algorithm == "ring" and whole.is_meta:
            return self._shape_only(whole, async_op)
        if self.algorithm == "ring":

            def ring() -> torch.Tensor:
                return ring_all_gather(
                    part, self.group, tracer=self.tracer, link=self.link, out=whole
                )

            return self._on_thread(ring) if async_op else ring()
        work = all_gather_single(whole, part, group=self.group, async_op=async_op)
        return self._pending(work, whole) if async_op else whole

    # -- point to point

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Any:
        """Send `tensor` to rank `peer` of the group; returns something to `wait()` on."""
        return self._wire(tensor).send([tensor], peer, tag)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> Any:
        """Receive into `tensor` from rank `peer`; `wait()` on what it returns."""
        return self._wire(tensor).recv([tensor], peer, tag)

    def _wire(self, like: torch.Tensor) -> dist.ProcessGroup | Messenger:
        """The group itself, or a messenger (`messenger`), for tensors like `like`."""
        staged = like.is_cuda and self._gloo
        wire = self._wires.get(staged)
        if wire is None:
            wire = self._wires[staged] = messenger(self.group, like, self.tracer, self.link)
        return wire

    def submit(self, run: Callable[[], torch.Tensor]) -> Pending:
        """Run `run` (a collective of your own, built from `send` / `recv`) on this
        object's communication thread, after everything asked for before it."""
        return self._on_thread(run)

    # -- the future

    @staticmethod
    def _shape_only(out: torch.Tensor, async_op: bool) -> torch.Tensor | Pending:
        """A meta tensor (a shape without data, as when PipelineRuntime finds its stages'
        output shapes) has no bytes for the ring to move: its result is its shape, as
        torch's collectives give on the meta device."""
        if not async_op:
            return out
        done: Future[tuple[torch.Tensor, int]] = Future()
        done.set_result((out, time.perf_counter_ns()))
        return Pending(out, thread=done)

    def _pending(self, work: dist.Work, out: torch.Tensor) -> Pending:
        if not self.timed:
            return Pending(out, work=work)  # no callback: nothing to time, nothing to wake up
        return Pending(
            out, work=work, times=work.get_future().then(lambda _: time.perf_counter_ns())
        )

    def _on_thread(self, run: Callable[[], torch.Tensor]) -> Pending:
        """Run the ring on this object's communication thread (one: messages go out in
        the order asked for); the future gives its output and when it finished."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, "parcourse-comm")

        def timed() -> tuple[torch.Tensor, int]:
            out = run()
            return out, time.perf_counter_ns()

        return Pending(None, thread=self._thread.submit(timed))

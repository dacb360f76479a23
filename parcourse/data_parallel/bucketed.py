"""Bucketed data parallelism with communication overlapping backward.

Backward dominates a training step and produces gradients last layer first. So
instead of waiting for all of them (naive), group parameters into buckets of
about `bucket_mb` megabytes in *reverse registration order* — the order
backward produces their gradients — and start a bucket's all-reduce as soon as
its last gradient arrives. While the ranks exchange that bucket, backward goes
on computing the next layers' gradients. PyTorch's DDP does this with 25 MB
buckets (Li et al., "PyTorch Distributed", VLDB 2020).

Buckets start strictly in bucket order, so every rank issues the same
collectives in the same order even when a parameter goes unused on some rank.
Each bucket also carries one "used" flag per parameter: a parameter no rank
used keeps `grad = None`, as it would in one process.

The all-reduce goes through a `Comm`: torch's (`async_op=True`, run by
gloo/NCCL's own threads) or this course's ring (`algorithm="ring"`, run on the
Comm's communication thread), which can go through a `SimulatedLink` so that
the overlap becomes visible on one machine.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm import Algorithm, Comm, Pending, SimulatedLink
from parcourse.data_parallel.base import GradSyncModule
from parcourse.data_parallel.compress import GradBucket
from parcourse.trace import Tracer


@dataclass
class Bucket:
    """Parameters whose gradients travel together, and their flat buffer.

    buffer = [grad of params[0] | grad of params[1] | ... | one used-flag per param]
    """

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor
    ready: set[int] = field(default_factory=set)
    launched_ns: int = 0
    done: Pending | _HookResult | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.buffer.element_size()

    def pack(self) -> torch.Tensor:
        """The gradients into the buffer (a missing one: zeros) and a used-flag each: what
        an all-reduce sums. Every rank sends the same layout, whichever it used."""
        for p, offset in zip(self.params, self.offsets):
            view = self.buffer[offset : offset + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
        used = [float(p.grad is not None) for p in self.params]  # one copy, not one per flag
        self.buffer[self.numel :].copy_(torch.tensor(used, dtype=self.buffer.dtype))
        return self.buffer

    def unpack(self, world_size: int) -> None:
        """The summed buffer back into the gradients, averaged over `world_size` ranks (1:
        a communication hook averaged them already); a parameter no rank used keeps no
        gradient, as in one process."""
        grads = self.buffer[: self.numel]
        counts = self.buffer[self.numel :].tolist()  # one read (one GPU sync), not one per flag
        for count, p, offset in zip(counts, self.params, self.offsets):
            if count == 0:
                p.grad = None  # no rank used it: as in one process
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p)
            # The average and the copy back in one pass over the bucket, not two.
            torch.div(grads[offset : offset + p.numel()].view_as(p), world_size, out=p.grad)


def group_by_size(params: list[nn.Parameter], bucket_mb: float) -> list[list[nn.Parameter]]:
    """Greedy: walk parameters in reverse order, close a group when it reaches
    bucket_mb (or the dtype or device changes). A parameter larger than a bucket
    gets a group of its own."""
    limit = bucket_mb * 2**20
    groups: list[list[nn.Parameter]] = []
    size = 0.0
    for p in reversed(params):
        fits = groups and size + p.numel() * p.element_size() <= limit
        same_kind = groups and (groups[-1][0].dtype, groups[-1][0].device) == (p.dtype, p.device)
        if not (fits and same_kind):
            groups.append([])
            size = 0.0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    return groups


def make_buckets(params: list[nn.Parameter], bucket_mb: float) -> list[Bucket]:
    """Buckets of about bucket_mb in reverse registration order (see group_by_size)."""
    buckets = []
    for i, group in enumerate(group_by_size(params, bucket_mb)):
        *offsets, total = itertools.accumulate((p.numel() for p in group), initial=0)
        buffer = torch.zeros(total + len(group), dtype=group[0].dtype, device=group[0].device)
        buckets.append(Bucket(i, group, offsets, total, buffer))
    return buckets


class BucketedDataParallel(GradSyncModule):
    """`BucketedDataParallel(model, group, bucket_mb=25.0, overlap=True)`.

    overlap=False starts every bucket only after backward has finished: the
    same bytes and buckets, no overlap — the comparison the lesson draws.
    """

    def __init__(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        algorithm: Algorithm = "torch",
        link: SimulatedLink | None = None,
        tracer: Tracer | None = None,
        broadcast_buffers: bool = True,
    ) -> None:
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        # The end time of each bucket's all-reduce only for a trace: timing it is a
        # callback on the backend's thread.
        comm = Comm(group, link=link, algorithm=algorithm, timed=tracer is not None)
        super().__init__(module, group, tracer, broadcast_buffers)
        self.comm = comm
        self.bucket_mb, self.overlap = bucket_mb, overlap
        self.buckets = make_buckets(self.sync_params, bucket_mb)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0  # the next bucket to launch: buckets start in order
        self._comm_hook: tuple[Any, Callable[[Any, GradBucket], Any]] | None = None
        self._synced = False  # a backward has synchronized: too late for a hook

    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], Any]) -> None:
        """As DDP's: each bucket's all-reduce becomes `hook(state, bucket)`, which returns a
        future (torch's, or the course's `Pending`) of the bucket's gradients **averaged**
        over the group (`bucket.buffer()`'s shape). torch's own hooks run unchanged
        (`default_hooks.bf16_compress_hook`, `powerSGD_hook.powerSGD_hook`); the course's
        are in `data_parallel.compress`. Once, before the first backward. The used-flags
        (a parameter no rank used keeps no gradient) go in one all-reduce of their own at
        the end of backward."""
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once (as DDP's)")
        if self._synced:
            raise RuntimeError(
                "register_comm_hook must be called before the first backward: the "
                "buckets already synchronized once without it"
            )
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {hook!r}")
        self._comm_hook = (state, hook)

    # -- backward: gradients arrive

    def grad_ready(self, param: torch.Tensor) -> None:
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        if self.overlap:
            while self._next < len(self.buckets) and self._complete(self.buckets[self._next]):
                self._launch(self.buckets[self._next])

    def _complete(self, bucket: Bucket) -> bool:
        return len(bucket.ready) == len(bucket.params)

    def _launch(self, bucket: Bucket) -> None:
        bucket.pack()
        bucket.launched_ns = time.perf_counter_ns()
        if self._comm_hook is None:
            bucket.done = self._start_all_reduce(bucket.buffer)
        else:
            state, hook = self._comm_hook
            last = bucket.index == len(self.buckets) - 1
            grads = bucket.buffer[: bucket.numel]
            bucket.done = _HookResult(
                hook(state, GradBucket(bucket.index, grads, bucket.params, last))
            )
        self._next = bucket.index + 1

    def _start_all_reduce(self, buffer: torch.Tensor) -> Pending:
        """Start summing `buffer` over ranks; the future's `finished_ns` is when it finished."""
        return self.comm.all_reduce(buffer, async_op=True)

    # -- end of backward

    def finish_gradient_sync(self) -> None:
        if self._next == 0 and not any(b.ready for b in self.buckets):
            return
        for bucket in self.buckets[self._next :]:  # incomplete buckets, or all of them
            self._launch(bucket)  # when overlap is off
        wait_start = time.perf_counter_ns()
        before = 0  # when the bucket before finished
        self._synced = True
        if self._comm_hook is not None:
            self._finish_hooked()
        for bucket in self.buckets:
            assert bucket.done is not None
            bucket.done.result()
            if self.tracer is not None:
                # The buckets' all-reduces run one after another (the ring on one
                # communication thread): each is drawn from when it could start, the one
                # before done, not from its launch, which a queue of them would stack.
                start = min(max(bucket.launched_ns, before), bucket.done.finished_ns)
                self.tracer.add_span(
                    "all_reduce",
                    start,
                    bucket.done.finished_ns,
                    kind="comm",
                    bucket=bucket.index,
                    bytes=bucket.nbytes,
                    launched_ns=bucket.launched_ns,
                )
            before = bucket.done.finished_ns
            bucket.unpack(self.world_size if self._comm_hook is None else 1)
            bucket.ready.clear()
            bucket.done = None
        if self.tracer is not None:
            self.tracer.add_span(
                "wait for buckets", wait_start, time.perf_counter_ns(), kind="idle"
            )
        self._next = 0

    def _finish_hooked(self) -> None:
        """Each hook's averaged gradients into its bucket, then every bucket's used-flags
        summed in one all-reduce."""
        for bucket in self.buckets:
            assert bucket.done is not None
            out = bucket.done.result()
            grads = bucket.buffer[: bucket.numel]
            if not isinstance(out, torch.Tensor) or out.numel() != bucket.numel:
                raise RuntimeError(
                    f"a communication hook must give the bucket's {bucket.numel} averaged "
                    f"gradients as one flat tensor, got {type(out).__name__} "
                    f"{tuple(getattr(out, 'shape', ()))}"
                )
            if out.data_ptr() != grads.data_ptr():
                grads.copy_(out.reshape(-1))
        flags = torch.cat([b.buffer[b.numel :] for b in self.buckets])
        self.comm.all_reduce(flags)
        at = 0
        for b in self.buckets:
            n = len(b.params)
            b.buffer[b.numel :].copy_(flags[at : at + n])
            at += n


class _HookResult:
    """A hook's future as the buckets wait on it: `result()` its tensor, `finished_ns`
    when the wait for it ended."""

    def __init__(self, future: Any) -> None:
        if not hasattr(future, "wait"):
            raise TypeError(
                f"a communication hook must return a future (with wait()), got "
                f"{type(future).__name__}"
            )
        self._future = future
        self._out: torch.Tensor | None = None
        self.finished_ns = 0

    def result(self) -> torch.Tensor:
        if self._out is None:
            value = self._future.wait()
            # torch's futures of a collective hold a list of tensors; a hook's, one tensor
            self._out = value[0] if isinstance(value, list) else value
            self.finished_ns = time.perf_counter_ns()
        assert self._out is not None
        return self._out

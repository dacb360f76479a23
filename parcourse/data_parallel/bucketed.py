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
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from parcourse.comm import Algorithm, Comm, Pending, SimulatedLink
from parcourse.data_parallel.base import GradSyncModule
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
    done: Pending | None = None

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
        """The summed buffer back into the gradients, averaged over `world_size` ranks; a
        parameter no rank used keeps no gradient, as in one process."""
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
        bucket.done = self._start_all_reduce(bucket.buffer)
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
            bucket.unpack(self.world_size)
            bucket.ready.clear()
            bucket.done = None
        if self.tracer is not None:
            self.tracer.add_span(
                "wait for buckets", wait_start, time.perf_counter_ns(), kind="idle"
            )
        self._next = 0

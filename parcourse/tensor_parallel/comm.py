"""The communication of tensor parallelism: Megatron's f and g, and their relatives.

Megatron-LM (Shoeybi et al., arXiv:1909.08053, sec. 3) splits a layer's matrix
multiply over the ranks of a tensor-parallel group, and two operators make the
split invisible to autograd:

- f: identity forward, all-reduce backward. Placed where a whole (replicated)
  activation enters a column-parallel layer: every rank computes with the same
  input, so in backward each holds only its part of that input's gradient, and
  the parts are summed.
- g: all-reduce forward, identity backward. Placed where a row-parallel layer's
  partial sums leave: summed forward; the gradient of a sum is the same on
  every rank, so backward has nothing to do.

Sequence parallelism (Korthikanti et al., arXiv:2205.05198, sec. 4.2.2) keeps the
activations between those layers cut along the sequence instead of whole on
every rank. An all-reduce is a reduce-scatter followed by an all-gather, so f and
g become an all-gather along the sequence (reduce-scatter in backward) and a
reduce-scatter along the sequence (all-gather in backward): on a ring, (N-1)/N x S
bytes each instead of 2(N-1)/N x S for the all-reduce, the same bytes in all.

Two more, for a column-parallel layer that must return its whole output and a
row-parallel layer given a whole input: gather the last dim (split in
backward) and split it (gather in backward).

Every collective goes through a `TPComm`, over a `Comm` (the group, its tracer, a
link, an algorithm): on the tracer each collective is a span (kind "comm") and
one event of the counter "tp_collective" (meta: op, phase, where, size in bytes
of the whole tensor), so a step's collectives can be counted and checked against
`parcourse.theory.tp_collectives`. With the course's ring (algorithm="ring") the
bytes each message carries are counted too ("bytes_sent").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from parcourse.comm import Comm
from parcourse.trace import CounterEvent, Tracer

Phase = Literal["forward", "backward"]
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter"]
SEQUENCE_DIM = 1  # activations are (B, T, C)


@dataclass
class TPComm:
    """The collectives of one tensor-parallel group, traced and counted: a thin layer
    over a `Comm` (parcourse.comm) that cuts and joins tensors along a dim and records
    each collective on the Comm's tracer.

    The Comm's `algorithm`: "torch" (torch.distributed's collectives) or "ring" (this
    course's, built from send/recv, which counts the bytes it sends and can go over a
    simulated link: give the model a Comm with that link). Tensor parallelism moves
    activations, small next to ZeRO's buffers, many times per step; at those sizes
    the ring's per-message cost in Python dominates: the tiny GPT's step on 2 ranks
    took about twice as long on the ring as on gloo's own collectives (60 vs 26 ms,
    while other jobs shared the machine). So "torch" by default, "ring" to count bytes.
    """

    comm: Comm

    @property
    def group(self) -> dist.ProcessGroup:
        return self.comm.group

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def tracer(self) -> Tracer | None:
        return self.comm.tracer

    @property
    def algorithm(self) -> str:
        return self.comm.algorithm

    def _traced(
        self, op: CollectiveOp, phase: Phase, where: str, nbytes: int
    ) -> AbstractContextManager[None]:
        if self.comm.before_blocking is not None:  # simulated compute's pacing
            self.comm.before_blocking()
        tracer = self.comm.tracer
        if tracer is None:
            return nullcontext()
        tracer.count("tp_collective", 1, op=op, phase=phase, where=where, size=nbytes)
        # its group's ranks, so that a drawing can tell waiting for a partner apart
        # (trace.with_collective_waits)
        return tracer.span(
            f"{op} ({phase})",
            kind="comm",
            op=op,
            phase=phase,
            where=where,
            size=nbytes,
            group=self.comm.ranks,
        )

    def all_reduce(
        self, x: torch.Tensor, phase: Phase, where: str, op: Literal["sum", "max"] = "sum"
    ) -> torch.Tensor:
        """A new tensor: `x` summed (or maxed) over the group. Out of place, so that a
        tensor autograd hands to several consumers is never changed under them."""
        out = x.clone(memory_format=torch.contiguous_format)
        with self._traced("all_reduce", phase, where, out.nbytes):
            self.comm.all_reduce(out, op)
        return out

    def all_gather(self, x: torch.Tensor, dim: int, phase: Phase, where: str) -> torch.Tensor:
        """Every rank's `x`, concatenated along `dim` in rank order."""
        d = dim % x.dim()
        shard = x.contiguous().view(-1)
        flat = torch.empty(shard.numel() * self.size, dtype=x.dtype, device=x.device)
        with self._traced("all_gather", phase, where, flat.nbytes):
            self.comm.all_gather(shard, flat)
        # The collective lays the ranks' tensors one after another, (N, *x.shape);
        # moving that axis next to `dim` and merging the two concatenates along `dim`.
        return flat.view(self.size, *x.shape).movedim(0, d).flatten(d, d + 1)

    def reduce_scatter(self, x: torch.Tensor, dim: int, phase: Phase, where: str) -> torch.Tensor:
        """This rank's chunk along `dim` of `x` summed over the group."""
        d = dim % x.dim()
        n = self.size
        if x.shape[d] % n:
            raise ValueError(
                f"{where}: dim {dim} of size {x.shape[d]} cannot be cut into {n} equal chunks"
            )
        # Chunk r of dim `d` first, so that the collective's rank-by-rank layout cuts it.
        parts = x.unflatten(d, (n, x.shape[d] // n)).movedim(d, 0).contiguous()  # (N, ...)
        with self._traced("reduce_scatter", phase, where, parts.nbytes):
            mine = self.comm.reduce_scatter(parts.view(-1))  # parts is a copy: scratch
        return mine.view(parts.shape[1:])

    def split(self, x: torch.Tensor, dim: int, where: str) -> torch.Tensor:
        """This rank's chunk of `x` along `dim` (no communication)."""
        if x.shape[dim] % self.size:
            raise ValueError(
                f"{where}: dim {dim} of size {x.shape[dim]} cannot be cut into "
                f"{self.size} equal chunks"
            )
        return x.chunk(self.size, dim)[self.rank]


# --------------------------------------------------------------------------- f and g


class _CopyToTP(torch.autograd.Function):
    """f (Megatron, arXiv:1909.08053, sec. 3): identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, where: str) -> torch.Tensor:
        ctx.comm, ctx.where = comm, where
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.comm.all_reduce(grad, "backward", ctx.where), None, None


class _ReduceFromTP(torch.autograd.Function):
    """g (Megatron, arXiv:1909.08053, sec. 3): all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, where: str) -> torch.Tensor:
        return comm.all_reduce(x, "forward", where)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, None, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim forward, keep this rank's chunk backward (Megatron's
    gather_from_tensor_model_parallel_region, arXiv:1909.08053, sec. 3)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, where: str) -> torch.Tensor:
        ctx.comm, ctx.where = comm, where
        return comm.all_gather(x, -1, "forward", where)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.comm.split(grad, -1, ctx.where).contiguous(), None, None


class _SplitLastDim(torch.autograd.Function):
    """Keep this rank's chunk of the last dim forward, all-gather backward (Megatron's
    scatter_to_tensor_model_parallel_region, arXiv:1909.08053, sec. 3)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, where: str) -> torch.Tensor:
        ctx.comm, ctx.where = comm, where
        return comm.split(x, -1, where).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.comm.all_gather(grad, -1, "backward", ctx.where), None, None


# --------------------------------------------------------------------------- sequence parallel


class _GatherSequence(torch.autograd.Function):
    """f under sequence parallelism (arXiv:2205.05198, sec. 4.2.2): all-gather along the
    sequence forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, where: str) -> torch.Tensor:
        ctx.comm, ctx.where = comm, where
        return comm.all_gather(x, SEQUENCE_DIM, "forward", where)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.comm.reduce_scatter(grad, SEQUENCE_DIM, "backward", ctx.where), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """g under sequence parallelism (arXiv:2205.05198, sec. 4.2.2): reduce-scatter along the
    sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TPComm, where: str) -> torch.Tensor:
        ctx.comm, ctx.where = comm, where
        return comm.reduce_scatter(x, SEQUENCE_DIM, "forward", where)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.comm.all_gather(grad, SEQUENCE_DIM, "backward", ctx.where), None, None


def copy_to_tp(x: torch.Tensor, comm: TPComm, where: str = "") -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward."""
    return x if comm.size == 1 else _CopyToTP.apply(x, comm, where)


def reduce_from_tp(x: torch.Tensor, comm: TPComm, where: str = "") -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return x if comm.size == 1 else _ReduceFromTP.apply(x, comm, where)


def gather_last_dim(x: torch.Tensor, comm: TPComm, where: str = "") -> torch.Tensor:
    """(..., n) on each rank -> (..., N x n), the same on every rank."""
    return x if comm.size == 1 else _GatherLastDim.apply(x, comm, where)


def split_last_dim(x: torch.Tensor, comm: TPComm, where: str = "") -> torch.Tensor:
    """(..., N x n) the same on every rank -> (..., n), this rank's chunk."""
    return x if comm.size == 1 else _SplitLastDim.apply(x, comm, where)


def gather_sequence(x: torch.Tensor, comm: TPComm, where: str = "") -> torch.Tensor:
    """(B, T / N, C) on each rank -> (B, T, C), the same on every rank."""
    return x if comm.size == 1 else _GatherSequence.apply(x, comm, where)


def reduce_scatter_sequence(x: torch.Tensor, comm: TPComm, where: str = "") -> torch.Tensor:
    """(B, T, C) partial sums on each rank -> (B, T / N, C), this rank's chunk of the sum."""
    return x if comm.size == 1 else _ReduceScatterSequence.apply(x, comm, where)


# --------------------------------------------------------------------------- counting


def count_collectives(
    counters: Iterable[CounterEvent], rank: int | None = None
) -> dict[tuple[str, str], tuple[int, int]]:
    """(op, phase) -> (how many, bytes of the tensors they worked on), from a tracer's or a
    trace's counters ("tp_collective"), for one rank or, with rank=None, all of them."""
    count: Counter[tuple[str, str]] = Counter()
    size: Counter[tuple[str, str]] = Counter()
    for e in counters:
        if e.name == "tp_collective" and (rank is None or e.rank == rank):
            key = (e.meta["op"], e.meta["phase"])
            count[key] += int(e.value)
            size[key] += int(e.meta["size"])
    return {key: (count[key], size[key]) for key in sorted(count)}

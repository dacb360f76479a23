"""The ring, readable: all-reduce = reduce-scatter, then all-gather, from send and recv.

The tensor is cut into N chunks (`chunk_bounds`). In each of N-1 reduce-scatter
steps every rank sends one chunk to its right neighbour and adds the one it
receives from its left into its own copy; afterwards rank r holds chunk r summed
over all ranks. In N-1 all-gather steps the finished chunks go once more around
the ring. Every rank sends 2(N-1)/N x S bytes whatever N is (Patarasuk & Yuan
2009; Baidu's "ring all-reduce", 2017).

This is the ring to read. `ring_fast.py` runs the same steps, faster (segments,
cached plans, kept buffers), and is tested to give the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from parcourse.comm.common import Op, check_args, comm_span, group_info, reduce_into
from parcourse.comm.link import Network
from parcourse.comm.messenger import messenger, settle
from parcourse.ranges import chunk_bounds
from parcourse.trace import Tracer

RingPhase = Literal["reduce-scatter", "all-gather"]


def ring_steps(rank: int, n: int, phases: Sequence[RingPhase]) -> list[tuple[str, int, int]]:
    """(phase, chunk sent to the right, chunk received from the left) for each step.

    reduce-scatter step s: send chunk (rank - s - 1), receive chunk (rank - s - 2)
    and reduce it in. After n - 1 steps the last chunk received, (rank - n) mod
    n = rank, has been through every rank: rank r owns chunk r, as in torch.
    all-gather step s: send chunk (rank - s), receive chunk (rank - s - 1).
    """
    steps: list[tuple[str, int, int]] = []
    for phase in phases:
        for s in range(n - 1):
            if phase == "reduce-scatter":
                steps.append((phase, (rank - s - 1) % n, (rank - s - 2) % n))
            else:
                steps.append((phase, (rank - s) % n, (rank - s - 1) % n))
    return steps


def turn(flat: torch.Tensor, phases: Sequence[RingPhase], op: Op = "sum",
         group: dist.ProcessGroup | None = None, *, tracer: Tracer | None = None,
         link: Network | None = None) -> None:
    """Run the ring's steps on the 1-D tensor `flat`, in place."""
    group, rank, n = group_info(group)
    bounds = chunk_bounds(flat.numel(), n)
    wire = messenger(group, flat, tracer, link)  # counts bytes, applies the link
    right, left = (rank + 1) % n, (rank - 1) % n
    sends = []
    for tag, (phase, out, into) in enumerate(ring_steps(rank, n, phases)):
        (a, b), (c, d) = bounds[out], bounds[into]
        with comm_span(tracer, f"{phase} {tag}", phase=phase, chunk=out):
            if b > a:  # a chunk may be empty when the tensor is smaller than the ring
                sends.append(wire.send([flat[a:b]], right, tag))
            if d > c:
                incoming = torch.empty(d - c, dtype=flat.dtype, device=flat.device)
                wire.recv([incoming], left, tag).wait()
                if phase == "reduce-scatter":
                    reduce_into(flat[c:d], incoming, op)  # add what the left has summed
                else:
                    flat[c:d] = incoming  # a finished chunk: keep it
    settle(wire, sends)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, op: Op = "sum",
               *, tracer: Tracer | None = None, link: Network | None = None
               ) -> torch.Tensor:
    """Ring all-reduce, in place: reduce-scatter, then all-gather. Returns `tensor`."""
    check_args(tensor, op)
    flat = tensor.flatten().clone()
    turn(flat, ("reduce-scatter", "all-gather"), op, group, tracer=tracer, link=link)
    if op == "avg":
        flat.div_(group_info(group)[2])
    return tensor.copy_(flat.view(tensor.shape))


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                   op: Op = "sum", *, tracer: Tracer | None = None,
                   link: Network | None = None) -> torch.Tensor:
    """This rank's chunk (`chunk_bounds`) of the reduction over ranks."""
    check_args(tensor, op)
    _, rank, n = group_info(group)
    flat = tensor.flatten().clone()
    turn(flat, ("reduce-scatter",), op, group, tracer=tracer, link=link)
    start, end = chunk_bounds(flat.numel(), n)[rank]
    return flat[start:end].div_(n) if op == "avg" else flat[start:end]


def all_gather(shard: torch.Tensor, numel: int, group: dist.ProcessGroup | None = None,
               *, tracer: Tracer | None = None, link: Network | None = None
               ) -> torch.Tensor:
    """Every rank's shard (chunk r of `numel` elements on rank r), in rank order."""
    check_args(shard, None)
    _, rank, n = group_info(group)
    flat = torch.empty(numel, dtype=shard.dtype, device=shard.device)
    start, end = chunk_bounds(numel, n)[rank]
    flat[start:end] = shard.flatten()
    turn(flat, ("all-gather",), "sum", group, tracer=tracer, link=link)
    return flat

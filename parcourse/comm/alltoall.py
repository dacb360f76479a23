"""All-to-all with a count per peer, from send / recv: what Ulysses' head cut and the
experts' dispatch and combine are built from.

`all_to_all(comm, x, sends, receives)`: `sends[j]` rows of x (dim 0, in rank order) go to
rank j, `receives[j]` rows come from it. Where `comm` runs the course's ring (gloo) it is
P - 1 rounds of send / recv, in round s to rank + s and from rank - s, each message counted
on the tracer and carried over the link; where it runs torch's (NCCL) it is
`all_to_all_single`. `AllToAll.apply` is the same under autograd: its backward is the
all-to-all the other way (a dispatch's backward is a combine, and a combine's a dispatch).

Where `comm.turns` is set (a `comm.turns.Turns`, the rank's device taken in turns by two
threads: DualPipe's overlapped pair), the ring's all-to-all hands the turn to the other
thread while it waits for its messages, and tags them by the thread's lane.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from parcourse.comm.communicator import Comm
from parcourse.comm.turns import lane


def all_to_all(comm: Comm, x: torch.Tensor, sends: list[int], receives: list[int]) -> torch.Tensor:
    """`sends[j]` rows of x (along dim 0, in rank order) to rank j, `receives[j]` rows from
    it into the result, in rank order. The course's own from send / recv where `comm` runs
    the ring (gloo: each message counted on its tracer, over its link): P - 1 rounds, in
    round s to rank + s and from rank - s; torch's `all_to_all_single` where it runs
    torch's (NCCL, whose messages run in order on one stream)."""
    if len(sends) != comm.size or len(receives) != comm.size:
        raise ValueError(
            f"all_to_all needs a count per rank of the group ({comm.size}), got "
            f"{len(sends)} to send and {len(receives)} to receive"
        )
    if sum(sends) != x.shape[0]:
        raise ValueError(f"all_to_all sends {sum(sends)} rows, x has {x.shape[0]}")
    x = x.contiguous()
    out = x.new_empty(sum(receives), *x.shape[1:])
    if comm.algorithm == "torch":
        if comm.turns is not None:
            raise ValueError(
                "a Comm with turns runs the course's all-to-all (send / recv, "
                "tagged by thread): torch's all_to_all_single would run two "
                "threads' calls in whatever order they come; make the Comm "
                "with algorithm='ring'"
            )
        dist.all_to_all_single(out, x, receives, sends, group=comm.group)
        return out
    at_x = [sum(sends[:j]) for j in range(comm.size)]
    at_out = [sum(receives[:j]) for j in range(comm.size)]
    me = comm.rank
    out.narrow(0, at_out[me], receives[me]).copy_(x.narrow(0, at_x[me], sends[me]))
    tag = _A2A_TAG * (1 + lane())  # two threads' all-to-alls at once: tags apart
    # With turns, the compute before it ends here: the messages leave after it
    with comm.turns.handed_on("all-to-all") if comm.turns is not None else nullcontext():
        works = []
        for step in range(1, comm.size):
            to, frm = (me + step) % comm.size, (me - step) % comm.size
            if sends[to]:
                works.append(comm.send(x.narrow(0, at_x[to], sends[to]), to, tag + step))
            if receives[frm]:
                works.append(comm.recv(out.narrow(0, at_out[frm], receives[frm]), frm, tag + step))
        for w in works:
            w.wait()
    return out


_A2A_TAG = 1000  # the all-to-all's messages: tags apart from the ring's (its steps), and
#                  in each lane (`turns.lane`) 1000 apart from the others'


class AllToAll(torch.autograd.Function):
    """`all_to_all`; backward: the same, the other way. `name`: a span on the comm's
    tracer around each (forward `name`, backward `name` + " grad"), for a timeline."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        comm: Comm,
        sends: list[int],
        receives: list[int],
        name: str | None = None,
    ) -> torch.Tensor:
        ctx.comm, ctx.sends, ctx.receives, ctx.name = comm, sends, receives, name
        with _span(comm, name):
            return all_to_all(comm, x, sends, receives)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        with _span(ctx.comm, ctx.name and f"{ctx.name} grad"):
            back = all_to_all(ctx.comm, grad, ctx.receives, ctx.sends)
        return back, None, None, None, None


def _span(comm: Comm, name: str | None) -> AbstractContextManager[None]:
    """A comm span `name` (also its label on a timeline), with the group's ranks: every
    rank runs its group's all-to-alls in one order, so a timeline can tell the wait for
    the last partner to enter one apart (`trace.with_collective_waits`)."""
    if comm.tracer is None or not name:
        return nullcontext()
    return comm.tracer.span(name, "comm", op="all-to-all", group=comm.ranks, label=name)

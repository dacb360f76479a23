"""The parameter server's all-reduce: everyone sends to a root, the root reduces and
sends the result back.

The root receives and sends (N-1) x S bytes through its own links, so its time
grows with N; its messages travel together, so it waits for latency only twice
(gather, then send back). The ring (`ring.py`) sends 2(N-1)/N x S per rank
instead, whatever N is; lesson 01 sets the two side by side.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parcourse.comm.common import Op, check_args, comm_span, group_info, reduce_into
from parcourse.comm.link import Network
from parcourse.comm.messenger import messenger, settle
from parcourse.trace import Tracer


def naive_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: Op = "sum",
    root: int = 0,
    *,
    tracer: Tracer | None = None,
    link: Network | None = None,
) -> torch.Tensor:
    """Parameter-server all-reduce, in place: gather at `root`, reduce, send back.

    The root receives N-1 tensors and sends N-1 results: (N-1) x S bytes each
    way through one rank, so its time grows with N while the others wait. All
    N-1 receives are posted at once, and all N-1 sends: latency is waited for
    twice, not 2(N-1) times (see `CostModel.all_reduce_s`).
    """
    check_args(tensor, op)
    group, rank, n = group_info(group)
    if not 0 <= root < n:
        raise ValueError(f"root must be a rank of the group (0..{n - 1}), got {root}")
    flat = tensor.flatten().clone()
    wire = messenger(group, flat, tracer, link)
    if n > 1 and flat.numel() and rank == root:
        others = [r for r in range(n) if r != root]
        with comm_span(tracer, "gather at root", phase="gather", label=f"recv {n - 1} + reduce"):
            parts = [torch.empty_like(flat) for _ in others]
            arrivals = [wire.recv([part], r, 0) for part, r in zip(parts, others)]
            for part, arrival in zip(parts, arrivals):
                arrival.wait()
                reduce_into(flat, part, op)
        with comm_span(tracer, "send result", phase="broadcast", label=f"send {n - 1}"):
            settle(wire, [wire.send([flat], r, 0) for r in others])
    elif n > 1 and flat.numel():
        with comm_span(tracer, "send to root", phase="gather", label="send"):
            settle(wire, [wire.send([flat], root, 0)])
        with comm_span(tracer, "wait for result", phase="broadcast", label="wait for result"):
            wire.recv([flat], root, 0).wait()
    if op == "avg":
        flat.div_(n)
    tensor.copy_(flat.view(tensor.shape))
    return tensor

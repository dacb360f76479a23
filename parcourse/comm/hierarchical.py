"""Hierarchical all-reduce: a reduce-scatter inside each node, an all-reduce of the shards
across nodes, an all-gather inside each node (Horovod's `--hierarchical-allreduce`; the
pattern NCCL follows between nodes). Built from the readable ring (ring.py).

With N ranks, n a node (consecutive global ranks, as `Topology` puts them) and k = N / n
nodes, local rank i of every node ends the reduce-scatter holding chunk i of the node's sum;
the k ranks with local index i, one a node, all-reduce that chunk between them; the
all-gather then spreads the finished chunks inside each node. Every rank sends
2 (n-1)/n S inside its node and 2 (k-1)/k S/n across nodes, all n of a node's ranks at once
over their own links. The flat ring sends the same 2 (N-1)/N S from every rank, and one
rank of each node sends all of its share across: the same bytes leave a node, but through
one link, in 2 (N-1) steps that each wait for the slow link's latency, against the
hierarchical 2 (k-1) (`theory.hierarchical_bytes`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from parcourse.comm.common import Op, check_args, comm_span
from parcourse.comm.link import Network
from parcourse.comm.ring import turn
from parcourse.ranges import chunk_bounds
from parcourse.trace import CounterEvent, Tracer

# The groups of each node and across nodes, made once per world and node size: making a
# group is a collective every rank of the world takes part in.
_GROUPS: dict[tuple[int, int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def check_nodes(world_size: int, ranks_per_node: int) -> None:
    """A clear error unless `ranks_per_node` cuts the world into whole nodes."""
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} must be >= 1 and divide the world size "
            f"{world_size} (whole nodes of consecutive ranks)"
        )


def node_groups(ranks_per_node: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's node, the ranks with this rank's local index, one a node), over the
    default group. Every rank must call it with the same `ranks_per_node`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    check_nodes(world, ranks_per_node)
    key = (id(dist.group.WORLD), world, ranks_per_node)
    if key not in _GROUPS:
        n = ranks_per_node
        nodes = [dist.new_group(list(range(s, s + n))) for s in range(0, world, n)]
        across = [dist.new_group(list(range(i, world, n))) for i in range(n)]
        _GROUPS[key] = (nodes[rank // n], across[rank % n])
    return _GROUPS[key]


def hierarchical_all_reduce(
    tensor: torch.Tensor,
    ranks_per_node: int,
    op: Op = "sum",
    *,
    tracer: Tracer | None = None,
    link: Network | None = None,
) -> torch.Tensor:
    """All-reduce `tensor` over every rank, in place, in three rings (inside, across,
    inside); returns `tensor`. Any number of elements: chunks may differ by one."""
    check_args(tensor, op)
    inside, across = node_groups(ranks_per_node)
    flat = tensor.flatten().clone()
    ring_op: Op = "sum" if op == "avg" else op
    local = dist.get_rank() % ranks_per_node
    with comm_span(tracer, "inside the node: reduce-scatter", level="inside"):
        turn(flat, ("reduce-scatter",), ring_op, inside, tracer=tracer, link=link)
    start, end = chunk_bounds(flat.numel(), ranks_per_node)[local]
    with comm_span(tracer, "across nodes: all-reduce", level="across"):
        # A view of this rank's chunk: the ring writes its result into `flat`.
        turn(flat[start:end], ("reduce-scatter", "all-gather"), ring_op, across,
             tracer=tracer, link=link)  # fmt: skip
    with comm_span(tracer, "inside the node: all-gather", level="inside"):
        turn(flat, ("all-gather",), "sum", inside, tracer=tracer, link=link)
    if op == "avg":
        flat.div_(dist.get_world_size())
    return tensor.copy_(flat.view(tensor.shape))


def bytes_by_level(
    counters: Iterable[CounterEvent], rank: int, ranks_per_node: int
) -> tuple[float, float]:
    """(bytes sent inside its node, bytes sent across nodes) by global rank `rank`, from a
    tracer's counters (`Tracer.data().counters`: each message's `bytes_sent` names the
    global rank it went `to`)."""
    inside = across = 0.0
    for c in counters:
        if c.name == "bytes_sent" and c.rank == rank and "to" in c.meta:
            if c.meta["to"] // ranks_per_node == rank // ranks_per_node:
                inside += c.value
            else:
                across += c.value
    return inside, across

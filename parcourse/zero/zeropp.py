"""ZeRO++: fewer bytes across nodes for ZeRO-3 (Wang et al. 2023, arXiv:2306.10209).

ZeRO-3 moves its weights twice a step (an all-gather in forward, one in backward) and
its gradients once (a reduce-scatter), each over every rank of the group, so on a
cluster most of its bytes cross the slow links between nodes. ZeRO++ has three tricks,
each an option of `ZeroStage3`:

- **qwZ** (`quantized_weights=True`): the weights travel as int8, block by block, with
  one fp32 scale per block (`quantize` / `dequantize`): 1 + 4/block bytes an element
  instead of 2 (fp16) or 4 (fp32). An element moves by at most half its block's step,
  max|block| / 254 (`error_bound`).
- **hpZ** (`hpz_partition_size=k`, a node's ranks): after forward's gather, each rank
  keeps a secondary copy of the weights sharded over its node only (1/k of them, not
  1/N); backward gathers from that copy, inside the node. It costs P/k bytes a rank.
- **qgZ** (`quantized_gradients=True`): the gradients' reduce-scatter becomes two
  quantized all-to-alls (`quantized_reduce_scatter`): inside the node first, so each
  rank holds its node's sum for 1/k of the parts, then across nodes between the ranks
  at the same place in their node. Each contribution is dequantized and added in fp32
  on arrival: the sum is never requantized hop after hop, as a quantized ring would.

What crosses nodes, for P parameters over N ranks in nodes of k, summed over ranks
(`theory.zero_pp_bytes_across`, and `bytes_across_nodes` measures it from the messages):
ZeRO-3 in fp32 sends 3 x (N-1)/k x 4P bytes; ZeRO++ sends (N-1)/k x P(1 + 4/block) for
forward's gather, nothing for backward's, and (N/k - 1) x P(1 + 4/block) for the
gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parcourse.comm import Comm, backend_for, global_rank
from parcourse.trace import CounterEvent

BLOCK = 256  # elements that share one scale


# --------------------------------------------------------------------- quantization


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (1-D) as (blocks, block), zero-padded at the end."""
    n = x.numel()
    rows = -(-n // block)
    padded = torch.zeros(rows * block, dtype=torch.float32, device=x.device)
    padded[:n] = x
    return padded.view(rows, block)


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise symmetric int8: (q, scales), q = round(x / scale) with scale =
    max|block| / 127 (1 for an all-zero block), so x is q x scale to within scale / 2."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    rows = _blocks(x.reshape(-1).float(), block)
    scales = rows.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.view(-1), scales


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, numel: int, block: int = BLOCK
) -> torch.Tensor:
    """The fp32 values `quantize` stands for, the first `numel` of them."""
    return (q.view(-1, block).float() * scales[:, None]).view(-1)[:numel]


def error_bound(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The most `dequantize(quantize(x))` moves each element: half its block's step,
    max|block| / 254 (plus fp32's rounding of the product, 2**-23 of the block's max)."""
    rows = _blocks(x.reshape(-1).float(), block)
    most = rows.abs().amax(dim=1, keepdim=True).expand_as(rows)
    return (most * (0.5 / 127 + 2**-23)).reshape(-1)[: x.numel()]


def encoded_nbytes(numel: int, block: int = BLOCK) -> int:
    """Bytes of `encode(x)` for x of `numel` elements: int8 values and fp32 scales."""
    blocks = -(-numel // block)
    return blocks * block + 4 * blocks


def encode(x: torch.Tensor, block: int = BLOCK, *, raw: torch.Tensor | None = None) -> torch.Tensor:
    """x quantized into one uint8 message: [int8 values | fp32 scales | `raw` fp32 as is]."""
    q, scales = quantize(x, block)
    pieces = [q.view(torch.uint8), scales.view(torch.uint8)]
    if raw is not None:
        pieces.append(raw.float().reshape(-1).view(torch.uint8))
    return torch.cat(pieces)


def decode(
    message: torch.Tensor, numel: int, block: int = BLOCK, raw: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in fp32, the `raw` fp32 values) from a message `encode` made."""
    blocks = -(-numel // block)
    q = message[: blocks * block].view(torch.int8)
    scales = message[blocks * block : blocks * block + 4 * blocks].view(torch.float32)
    tail = message[blocks * block + 4 * blocks : blocks * block + 4 * blocks + 4 * raw]
    return dequantize(q, scales, numel, block), tail.view(torch.float32)


# --------------------------------------------------------------------- nodes


@dataclass(frozen=True)
class Nodes:
    """Where a group's ranks sit: nodes of `ranks_per_node` consecutive global ranks.

    `members[n]` are the group ranks on node n, in order; this rank is `local` in its
    node `node`. Every node must hold the same number of the group's ranks."""

    ranks_per_node: int
    members: tuple[tuple[int, ...], ...]
    node: int
    local: int

    @classmethod
    def of(cls, group: dist.ProcessGroup, rank: int, world_size: int, ranks_per_node: int) -> Nodes:
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        by_node: dict[int, list[int]] = {}
        for r in range(world_size):
            by_node.setdefault(global_rank(group, r) // ranks_per_node, []).append(r)
        members = tuple(tuple(v) for _, v in sorted(by_node.items()))
        sizes = {len(m) for m in members}
        if len(sizes) > 1:
            raise ValueError(
                f"the group's ranks sit unevenly on nodes of {ranks_per_node} "
                f"({[list(m) for m in members]}): ZeRO++ needs the same "
                "number on every node"
            )
        node = next(i for i, m in enumerate(members) if rank in m)
        return cls(ranks_per_node, members, node, members[node].index(rank))

    @property
    def per_node(self) -> int:
        return len(self.members[0])

    def mates(self) -> tuple[int, ...]:
        """The group ranks on this rank's node."""
        return self.members[self.node]

    def same_place(self) -> tuple[int, ...]:
        """The group rank at this rank's place in every node, node by node."""
        return tuple(m[self.local] for m in self.members)


# Node groups made in this process, by parent group and ranks: a panel builds a model
# again on ranks that live on, and each new group would keep its gloo threads and sockets.
_NODE_GROUPS: dict[tuple[str, tuple[int, ...]], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def node_group(group: dist.ProcessGroup, nodes: Nodes) -> dist.ProcessGroup:
    """A process group of this rank's node (only its members call this), made once per
    parent group in this process."""
    ranks = tuple(global_rank(group, r) for r in nodes.mates())
    key = (getattr(group, "group_name", str(id(group))), ranks)
    parent, made = _NODE_GROUPS.get(key, (None, None))
    if parent is not group or made is None:  # first asked, or a new group under an old name
        made = dist.new_group(list(ranks), use_local_synchronization=True)
        _NODE_GROUPS[key] = (group, made)
    return made


def bytes_across_nodes(counters: Iterable[CounterEvent], ranks_per_node: int) -> int:
    """Bytes this trace's messages carried between nodes (`bytes_sent` counters, which
    name their global destination)."""
    return int(
        sum(
            c.value
            for c in counters
            if c.name == "bytes_sent"
            and "to" in c.meta
            and c.rank // ranks_per_node != c.meta["to"] // ranks_per_node
        )
    )


# --------------------------------------------------------------------- qgZ


_TAGS = (7001, 7002)  # the two all-to-alls' messages; the ring's tags are small counts


def _all_to_all(
    comm: Comm,
    blocks: dict[int, torch.Tensor],
    peers: tuple[int, ...],
    me: int,
    nbytes: int,
    tag: int,
) -> dict[int, torch.Tensor]:
    """Send blocks[peer] to each other peer; receive one message of nbytes from each."""
    device = next(iter(blocks.values())).device if blocks else torch.device("cpu")
    got = {p: torch.empty(nbytes, dtype=torch.uint8, device=device) for p in peers if p != me}
    if comm.algorithm == "torch" and backend_for(comm.group, device) != "gloo":
        # NCCL runs each send and receive on its stream in the order given: a send waits
        # for its receive, so all of them go in one group, or the ranks wait on each other.
        ops = [
            dist.P2POp(dist.isend, blocks[p], global_rank(comm.group, p), comm.group, tag)
            for p in got
        ]
        ops += [
            dist.P2POp(dist.irecv, got[p], global_rank(comm.group, p), comm.group, tag) for p in got
        ]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return got
    sends = [comm.send(blocks[p], p, tag) for p in got]
    arrivals = [comm.recv(got[p], p, tag) for p in got]
    for a in arrivals:
        a.wait()
    for s in sends:
        s.wait()
    return got


def quantized_reduce_scatter(
    comm: Comm, parts: torch.Tensor, width: int, nodes: Nodes, block: int = BLOCK
) -> torch.Tensor:
    """This rank's part of `parts` (N, width + flags) summed over the group, in fp32,
    by two quantized all-to-alls (inside the node, then across nodes at one place in
    each): the first `width` columns travel as int8 with a scale a block, the rest (a
    few flags) as fp32."""
    flags = parts.shape[1] - width
    me = comm.rank
    mates, places = nodes.mates(), nodes.same_place()
    rows = len(places)  # parts that end at this rank's place, one per node

    def message(block_rows: torch.Tensor) -> torch.Tensor:
        return encode(
            block_rows[:, :width].reshape(-1), block, raw=block_rows[:, width:].reshape(-1)
        )

    def read(msg: torch.Tensor, count: int) -> torch.Tensor:
        values, raw = decode(msg, count * width, block, count * flags)
        return torch.cat([values.view(count, width), raw.view(count, flags)], dim=1)

    # Inside the node: to the mate at place j, the parts of the ranks at place j. This
    # rank's own contribution stays exact: only what travels is quantized.
    outgoing, mine = {}, None
    for j, mate in enumerate(mates):
        wanted = parts[[m[j] for m in nodes.members]]
        if mate == me:
            mine = wanted.float()
        else:
            outgoing[mate] = message(wanted)
    assert mine is not None
    size = encoded_nbytes(rows * width, block) + 4 * rows * flags
    node_sum = mine
    for msg in _all_to_all(comm, outgoing, mates, me, size, _TAGS[0]).values():
        node_sum += read(msg, rows)
    # Across nodes: row n of the node's sum goes to the rank at this place in node n.
    outgoing = {peer: message(node_sum[n : n + 1]) for n, peer in enumerate(places) if peer != me}
    total = node_sum[nodes.node].clone()
    size = encoded_nbytes(width, block) + 4 * flags
    for msg in _all_to_all(comm, outgoing, places, me, size, _TAGS[1]).values():
        total += read(msg, 1)[0]
    return total

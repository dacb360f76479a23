"""The ring, fast: the same steps as `ring.py`, with the machinery speed needs.

`ring.py` is the ring to read: one chunk per message, a fresh buffer per step.
This one runs the same schedule (`ring_steps`) and gives the same bits (each
element is reduced in the same order; tests/test_collectives.py checks it), but:

- chunks larger than `SEGMENT_BYTES` travel as several messages (segments), so
  reducing one segment overlaps receiving the next, as gloo and NCCL do;
- which range goes where is worked out once per shape and cached (`_ring_plan`);
- the receive buffer is kept between calls (`_scratch`): fresh memory costs a
  page fault per page on every call;
- every view is made before the first message, and without a tracer, link or
  staging the messages go straight to the process group (`messenger`).

`python benchmarks/collectives.py` measures it against torch's all_reduce; these
are the collectives `parcourse.comm` exports as `ring_all_reduce`,
`ring_reduce_scatter` and `ring_all_gather`.
"""

from __future__ import annotations

import functools
import threading
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist

from parcourse.comm.common import Op, check_args, comm_span, group_info, reduce_into
from parcourse.comm.link import Network
from parcourse.comm.messenger import messenger, settle
from parcourse.comm.ring import RingPhase, ring_steps
from parcourse.ranges import chunk_bounds
from parcourse.trace import Tracer

_scratch_per_thread = threading.local()


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer reused across calls (per thread, dtype and device).

    A fresh buffer costs a page fault per page the first time it is touched,
    on every call, so the ring keeps one around. It grows to the largest chunk
    seen; it is the "temporary buffer" of memory accounting.
    """
    cache = _scratch_per_thread.__dict__.setdefault("buffers", {})
    key = (dtype, device)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


SEGMENT_BYTES = 2 << 20
"""Chunks larger than this travel as several messages (segments) of at most this size."""


class _Step(NamedTuple):
    """What the trace says of one message of a ring."""

    phase: str
    step: int
    chunk: int  # the chunk sent
    segment: int


_Planned = tuple[int, int, "tuple[int, int] | None"]  # segment sent, received, where it lands


@functools.lru_cache(maxsize=256)
def _ring_plan(
    numel: int,
    rank: int,
    n: int,
    phases: tuple[RingPhase, ...],
    k: int,
) -> tuple[tuple[tuple[int, int], ...], tuple[_Planned, ...], tuple[_Step, ...]]:
    """Every message of a ring, worked out once per shape: (segments, messages, steps).

    segments: [start, end) in the flat buffer of segment j of chunk c, at index
    c * k + j. messages: (segment sent, segment received, where it lands in
    the scratch buffer), one per message in order; in all-gather a message
    lands in place (None), in reduce-scatter it lands in scratch and is then
    reduced into its segment. steps: what the trace says of each message.
    """
    bounds = chunk_bounds(numel, n)
    segments = tuple((a + x, a + y) for a, b in bounds for x, y in chunk_bounds(b - a, k))
    # Segment j lands at the same place in scratch whichever chunk it is from (cut
    # as the largest chunk is), so the k segments in flight never overlap there.
    pieces = chunk_bounds(bounds[0][1] - bounds[0][0], k)
    messages, steps = [], []
    rs_steps = (n - 1) if phases[0] == "reduce-scatter" else 0
    for i, (phase, send_c, recv_c) in enumerate(ring_steps(rank, n, phases)):
        for j in range(k):
            sent, received = send_c * k + j, recv_c * k + j
            land = None
            if phase == "reduce-scatter":
                a, b = segments[received]
                land = (pieces[j][0], pieces[j][0] + b - a)
            messages.append((sent, received, land))
            steps.append(_Step(phase, i if i < rs_steps else i - rs_steps, send_c, j))
    return segments, tuple(messages), tuple(steps)


# One message's tensors: what goes to the right, where the message from the left
# lands, what that is reduced into (None in all-gather, which lands in place).
_Message = tuple["torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None"]


def _message_tensors(
    flat: torch.Tensor,
    scratch: torch.Tensor,
    segments: tuple[tuple[int, int], ...],
    plan: tuple[_Planned, ...],
) -> list[_Message]:
    """Every message's tensors, made before the first message is sent: views of `flat`
    and, where reduce-scatter lands, of `scratch`. Empty segments (a tensor smaller
    than the world) are None: both sides skip them."""
    views = [flat[a:b] if b > a else None for a, b in segments]
    messages: list[_Message] = []
    for sent, received, land in plan:
        segment = views[received]
        if land is None:  # all-gather: lands in place
            messages.append((views[sent], segment, None))
        else:  # reduce-scatter: lands in scratch, then is reduced into its segment
            into = None if segment is None else scratch[land[0] : land[1]]
            messages.append((views[sent], into, segment))
    return messages


_NO_SPAN = nullcontext()


def _ring(
    flat: torch.Tensor,
    phases: tuple[RingPhase, ...],
    op: str,
    group: dist.ProcessGroup,
    rank: int,
    n: int,
    tracer: Tracer | None,
    link: Network | None,
    segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """Run ring steps in place on a flat buffer cut by `chunk_bounds`: each step
    sends one chunk to the right, receives one from the left and, in
    reduce-scatter, reduces it in.

    A chunk larger than `segment_bytes` goes as k segments, one message each,
    as gloo and NCCL do: a segment is sent on as soon as it has been received
    (and reduced), so reducing one segment overlaps receiving the next, and the
    all-gather starts before the reduce-scatter's last chunk is complete. With
    a simulated link there is one message per chunk, as the cost model counts.

    Each message is sent before its receive is posted. Then our neighbour's
    message usually finds no receive posted yet: gloo queues it, and the
    "ready" notice we send when we post makes gloo's I/O thread (which polls
    the socket anyway) write it. Posting receives ahead instead makes the later
    send find the peer ready, and gloo then writes the whole message from this
    Python thread, which on a busy CPU has to wait for a core to do it. Each
    message has its own tag, so it can only land in the buffer meant for it.

    What does not depend on the data (which range goes where) is worked out
    once per shape and cached, every view is made before the first message,
    and without a tracer, link or staging the messages go straight to the
    process group. `python benchmarks/collectives.py` measures the result
    against torch's all_reduce.
    """
    if segment_bytes < 1:
        raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
    numel = flat.numel()
    largest = -(-numel // n)  # chunk 0, the largest
    k = 1 if link is not None else max(1, -(-largest * flat.element_size() // segment_bytes))
    segments, plan, steps = _ring_plan(numel, rank, n, phases, k)
    wire = messenger(group, flat, tracer, link)
    scratch = _scratch(largest, flat.dtype, flat.device) if "reduce-scatter" in phases else flat
    right, left = (rank + 1) % n, (rank - 1) % n
    messages = _message_tensors(flat, scratch, segments, plan)
    send, recv = wire.send, wire.recv
    sends, arrivals, posted, last = [], [], 0, len(messages)
    for i, (_, into, acc) in enumerate(messages):
        # Without a tracer, not even the span's name is made.
        span = (
            _NO_SPAN
            if tracer is None
            else comm_span(tracer, f"{steps[i].phase} {steps[i].step}", **steps[i]._asdict())
        )
        with span:
            # Message q carries what message q - k brought in: send every message
            # whose segment has arrived (all of the first step's at once).
            while posted < min(i + k, last):
                out, dest, _ = messages[posted]
                if out is not None:
                    sends.append(send([out], right, posted))
                arrivals.append(None if dest is None else recv([dest], left, posted))
                posted += 1
            if into is not None:
                arrival = arrivals[i]
                assert arrival is not None  # message i was received into `into`
                arrival.wait()
                if acc is not None:
                    reduce_into(acc, into, op)
    settle(wire, sends)


def ring_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: Op = "sum",
    *,
    tracer: Tracer | None = None,
    link: Network | None = None,
    segment_bytes: int = SEGMENT_BYTES,
) -> torch.Tensor:
    """Ring all-reduce, in place: reduce-scatter, then all-gather. Returns `tensor`.

    Any numel (chunks may differ by one element), any world size, non-contiguous
    tensors too. Each rank sends 2(N-1)/N x S bytes (fewer than that when the
    chunks are uneven, by at most a few elements). Chunks larger than
    `segment_bytes` travel as several messages, so that reducing one overlaps
    receiving the next.
    """
    check_args(tensor, op)
    group, rank, n = group_info(group)
    contiguous = tensor.is_contiguous()
    flat = tensor.view(-1) if contiguous else tensor.flatten().clone()
    if n > 1:
        _ring(
            flat, ("reduce-scatter", "all-gather"), op, group, rank, n, tracer, link, segment_bytes
        )
    if op == "avg":
        flat.div_(n)
    if not contiguous:
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def ring_reduce_scatter(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: Op = "sum",
    *,
    tracer: Tracer | None = None,
    link: Network | None = None,
    segment_bytes: int = SEGMENT_BYTES,
    scratch: bool = False,
) -> torch.Tensor:
    """Return this rank's chunk of the reduction over ranks.

    Rank r gets chunk r of `chunk_bounds(numel, N)`, as torch's reduce_scatter
    does when numel divides evenly. `tensor` is not changed, unless
    `scratch=True`: then the ring works in it (a contiguous buffer the caller
    throws away afterwards), which saves copying it.
    """
    check_args(tensor, op)
    group, rank, n = group_info(group)
    if scratch and not tensor.is_contiguous():
        raise ValueError("scratch=True needs a contiguous tensor")
    flat = tensor.view(-1) if scratch else tensor.flatten().clone()
    bounds = chunk_bounds(flat.numel(), n)
    if n > 1:
        _ring(flat, ("reduce-scatter",), op, group, rank, n, tracer, link, segment_bytes)
    start, end = bounds[rank]
    shard = flat[start:end].clone()
    return shard.div_(n) if op == "avg" else shard


def ring_all_gather(
    shard: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    numel: int | None = None,
    tracer: Tracer | None = None,
    link: Network | None = None,
    segment_bytes: int = SEGMENT_BYTES,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Concatenate every rank's flattened shard, in rank order, on every rank.

    With equal shards, leave `numel` out. With shards cut by `chunk_bounds`
    (uneven), pass the full `numel` so every rank knows every shard's size.
    `out`: a contiguous 1-D tensor to gather into (returned); `shard` may be its
    own chunk of it, which then is not copied.
    """
    check_args(shard, None)
    group, rank, n = group_info(group)
    numel = shard.numel() * n if numel is None else numel
    bounds = chunk_bounds(numel, n)
    start, end = bounds[rank]
    if end - start != shard.numel():
        raise ValueError(
            f"rank {rank}'s shard has {shard.numel()} elements, but chunk {rank} "
            f"of numel={numel} over {n} ranks has {end - start}"
        )
    if out is not None and (
        out.shape != (numel,) or not out.is_contiguous() or out.dtype != shard.dtype
    ):
        raise ValueError(
            f"out must be a contiguous 1-D {shard.dtype} tensor of {numel} "
            f"elements, got {out.dtype} {tuple(out.shape)}"
        )
    flat = torch.empty(numel, dtype=shard.dtype, device=shard.device) if out is None else out
    if flat[start:end].data_ptr() != shard.data_ptr() or not shard.is_contiguous():
        flat[start:end] = shard.flatten()
    if n > 1:
        _ring(flat, ("all-gather",), "sum", group, rank, n, tracer, link, segment_bytes)
    return flat

"""All-reduce, reduce-scatter and all-gather built from point-to-point messages.

Two ways to all-reduce a tensor of S bytes over N ranks:

- `naive_all_reduce`, the parameter server: everyone sends to a root, the root
  reduces and sends the result back. The root receives and sends (N-1) x S
  bytes through its own links, so its time grows with N; its messages travel
  together, so it waits for latency only twice (gather, then send back).
- `ring_all_reduce` = `ring_reduce_scatter` then `ring_all_gather`. The tensor is
  cut into N chunks; in each of N-1 steps every rank sends one chunk to its
  right neighbour and receives one from its left. Every rank sends
  2(N-1)/N x S bytes whatever N is: bandwidth-optimal, which is why Horovod and
  NCCL use it (Patarasuk & Yuan 2009; Baidu's "ring all-reduce", 2017). Its
  2(N-1) steps run one after another, so its latency, 2(N-1) alpha, does grow
  with N.

Messages go through the process group's own `send` and `recv` (peers are
ranks in the group; each call returns a Work to wait on, as `dist.isend` and
`dist.irecv` do), nothing else. Every message is counted (`bytes_sent` on the
tracer) and every round is a span with its chunk index, so the timeline shows
the ring turning. `SimulatedLink` adds latency and a bandwidth limit to every
message, to make communication cost visible on one machine where loopback is
nearly free; `CostModel` predicts what it adds.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist

from parcourse.trace import Tracer

Op = Literal["sum", "avg", "max"]
OPS: tuple[str, ...] = ("sum", "avg", "max")
DTYPES: tuple[torch.dtype, ...] = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64,
)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------- checks, chunks


def check_args(tensor: torch.Tensor, op: str) -> None:
    """Clear errors for what these collectives do not support."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if op not in OPS:
        raise ValueError(f"unsupported op {op!r}; choose one of {', '.join(OPS)}")
    if tensor.dtype not in DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise ValueError(f"unsupported dtype {tensor.dtype}; supported: {names}")
    if op == "avg" and tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"op 'avg' needs a floating-point tensor, got {tensor.dtype}; "
                         "use 'sum' and divide")


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """[start, end) of n chunks covering numel; the first numel % n chunks get one more.

    The same split as torch.tensor_split, so shards line up with what torch does.
    """
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _reduce_into(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    if op == "max":
        torch.maximum(acc, other, out=acc)
    else:  # sum and avg both add; avg divides once at the end
        acc.add_(other)


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


def group_info(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    """(group, this rank in it, its size); None means all ranks (WORLD)."""
    group = group or dist.group.WORLD
    if group is None:
        raise RuntimeError("torch.distributed is not initialized: run this inside a Pool, "
                           "under torchrun, or after init_process_group")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"this rank is not a member of the group (got {group!r})")
    # The group's own rank()/size(): dist.get_rank/get_world_size look the group
    # up and map ranks on every call.
    return group, group.rank(), group.size()


def global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    """The global rank of a rank in `group`: what torch.distributed's functions take
    (broadcast's src, isend/irecv's peer); the group's own send/recv take group ranks."""
    if group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


# --------------------------------------------------------------------------- the link


@dataclass(frozen=True)
class SimulatedLink:
    """Latency (alpha) and bandwidth (beta) for every message, as between machines.

    Each rank has one outgoing and one incoming link (full duplex). A message of
    b bytes occupies the sender's outgoing link and the receiver's incoming link
    for b / beta seconds each; messages on the same link queue. Latency is a
    delay, not busy time: the message arrives alpha after its last byte has
    left. So k messages sent together from one rank to another take
    alpha + k x b / beta, not k x (alpha + b / beta).

    What that gives the two all-reduces of S bytes over N ranks:

    - the parameter server: the N-1 messages to the root travel together and
      queue on its incoming link, alpha + (N-1) x S / beta; the N-1 results
      queue on its outgoing link, the same again: 2 alpha + 2(N-1) x S / beta;
    - the ring: each step sends a chunk (S/N) only once the previous step's
      chunk has arrived, so each of its 2(N-1) steps pays
      alpha + S / (N beta): 2(N-1) alpha + 2(N-1)/N x S / beta.

    `CostModel.all_reduce_s` predicts exactly these. The link only adds time
    (it sleeps until a message would have arrived); what this machine itself
    takes to move the bytes comes on top.
    """

    latency_s: float = 0.0
    bandwidth_Bps: float = math.inf

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        if not self.bandwidth_Bps > 0:
            raise ValueError(f"bandwidth_Bps must be > 0, got {self.bandwidth_Bps}")

    @classmethod
    def of(cls, latency_us: float = 0.0, bandwidth_GBps: float | None = None) -> SimulatedLink:
        """SimulatedLink.of(latency_us=50, bandwidth_GBps=1.0): friendlier units."""
        return cls(latency_us * 1e-6, bandwidth_GBps * 1e9 if bandwidth_GBps else math.inf)

    def busy_s(self, nbytes: int) -> float:
        """Seconds a message of `nbytes` occupies a link: nbytes / beta (no latency)."""
        return nbytes / self.bandwidth_Bps

    def seconds(self, nbytes: int) -> float:
        """One message alone on free links, from its first byte leaving to its arrival:
        alpha + nbytes / beta."""
        return self.latency_s + self.busy_s(nbytes)


def simulated_link(latency_us: float = 0.0,
                   bandwidth_gbps: float | None = None) -> SimulatedLink | None:
    """The link for these settings (as panels and the CLI take them), or None when both are off."""
    if not (latency_us or bandwidth_gbps):
        return None
    return SimulatedLink.of(latency_us=latency_us, bandwidth_GBps=bandwidth_gbps)


class _Wire:
    """One rank's two links: when each is free again.

    There is one per process and link (`_wire_for`), shared by every collective
    and thread, so that messages sent by separate calls (a pipeline's, a
    bucket's on the communication thread) queue on the same links. Times are
    `time.perf_counter()`, one clock for every process on this machine.
    """

    def __init__(self, link: SimulatedLink | None) -> None:
        self.link = link
        self.out_free = 0.0
        self.in_free = 0.0
        self._lock = threading.Lock()

    def depart(self, nbytes: int) -> tuple[float, float]:
        """Queue a message on the outgoing link; returns when its first byte leaves
        and when its last byte has left."""
        assert self.link is not None
        with self._lock:
            start = max(time.perf_counter(), self.out_free)
            self.out_free = start + self.link.busy_s(nbytes)
            return start, self.out_free

    def arrive(self, departed: float, nbytes: int) -> float:
        """A message whose first byte left its sender at `departed`: its first byte
        reaches us alpha later, and it then occupies our incoming link for
        nbytes / beta (after whatever is queued there). Returns when it has arrived."""
        assert self.link is not None
        with self._lock:
            start = max(departed + self.link.latency_s, self.in_free)
            self.in_free = start + self.link.busy_s(nbytes)
            return self.in_free


_wires: dict[SimulatedLink, _Wire] = {}
_wires_lock = threading.Lock()


def _wire_for(link: SimulatedLink | None) -> _Wire:
    """This process's wire for `link` (a fresh, unused one for no link)."""
    if link is None:
        return _Wire(None)
    with _wires_lock:
        return _wires.setdefault(link, _Wire(link))


def _sleep_until(moment: float) -> None:
    """Let simulated time really pass: sleep (freeing the core) until `moment`."""
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# --------------------------------------------------------------------------- messages


class _Arrival:
    """A receive posted through a messenger; `wait()` also moves what arrived from
    the host buffer into place (GPU staging) and, with a link, returns only when
    the message would have arrived over it."""

    def __init__(self, work: dist.Work, host: torch.Tensor, dest: torch.Tensor,
                 wire: _Wire) -> None:
        self.work, self.host, self.dest, self.wire = work, host, dest, wire

    def wait(self) -> None:
        self.work.wait()
        host, dest = self.host, self.dest
        if self.wire.link is not None:
            n = dest.nbytes
            _sleep_until(self.wire.arrive(host[:_STAMP].view(torch.float64).item(), n))
            dest.view(-1).view(torch.uint8).copy_(host[_STAMP:])
        elif host is not dest:
            dest.copy_(host)


_STAMP = 8  # bytes of the departure time at the head of a message over a simulated link
_stamped_per_thread = threading.local()


def _stamped(way: str, peer: int, tag: int, nbytes: int) -> torch.Tensor:
    """A host buffer for one message over a simulated link: the departure time,
    then `nbytes` of payload. Reused by the next message with the same (peer,
    tag) on this thread, so the message before it must be done by then: each
    message of a collective has its own (peer, tag), and a collective returns
    only when its messages are done. (Fresh memory for every message costs a
    page fault per page, which would add to the time measured.)"""
    cache = _stamped_per_thread.__dict__.setdefault("buffers", {})
    key = (way, peer, tag)
    buf = cache.get(key)
    if buf is None or buf.numel() < _STAMP + nbytes:
        buf = cache[key] = torch.empty(_STAMP + nbytes, dtype=torch.uint8)
    return buf[:_STAMP + nbytes]


class _Messenger:
    """A stand-in for the process group that counts bytes, stages GPU tensors
    through host memory and simulates the link.

    It has the process group's own `send(tensors, peer, tag)` and
    `recv(tensors, peer, tag)` (peers are ranks in the group; both return
    something to `wait()` on), so a collective runs the same code whether it
    talks to the group directly or through a messenger. `messenger()` hands
    out the group itself when there is nothing to count, stage or slow down,
    so the plain path (benchmarks, data parallel) has no wrapper at all.

    With a simulated link, each message carries the time its first byte left
    in 8 extra bytes at its head (not counted as bytes sent), so the receiver
    can add the latency and queue it on its incoming link.
    """

    def __init__(self, group: dist.ProcessGroup, tracer: Tracer | None,
                 link: SimulatedLink | None, staged: bool) -> None:
        self.group = group
        self.tracer = tracer
        self.wire = _wire_for(link)
        self.staged = staged
        self.sent_until = 0.0  # when the last byte of our last message has left

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work:
        (t,) = tensors
        t = t.contiguous()
        if self.wire.link is not None:
            payload = _stamped("out", peer, tag, t.nbytes)
            payload[_STAMP:].copy_(t.view(-1).view(torch.uint8))
            departed, self.sent_until = self.wire.depart(t.nbytes)
            payload[:_STAMP].view(torch.float64)[0] = departed
        else:
            payload = t.cpu() if self.staged else t
        work = self.group.send([payload], peer, tag)
        if self.tracer is not None:
            self.tracer.count("bytes_sent", t.nbytes, peer=peer)
        return work

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Arrival:
        (dest,) = tensors
        if self.wire.link is not None:
            host = _stamped("in", peer, tag, dest.nbytes)
        elif self.staged:
            host = torch.empty(dest.shape, dtype=dest.dtype)
        else:
            host = dest
        return _Arrival(self.group.recv([host], peer, tag), host, dest, self.wire)

    def settle(self) -> None:
        """With a link: wait until the last byte of our last message has left."""
        if self.wire.link is not None:
            _sleep_until(self.sent_until)


def messenger(group: dist.ProcessGroup, like: torch.Tensor, tracer: Tracer | None = None,
              link: SimulatedLink | None = None) -> dist.ProcessGroup | _Messenger:
    """What a collective sends through: the group itself, or a messenger when
    bytes are counted (tracer), a link is simulated, or CUDA tensors go over
    gloo (which moves CPU tensors only, so they are staged through host memory)."""
    staged = like.is_cuda and dist.get_backend(group) == "gloo"
    if tracer is None and link is None and not staged:
        return group
    return _Messenger(group, tracer, link, staged)


def _settle(wire: dist.ProcessGroup | _Messenger, sends: list[dist.Work]) -> None:
    """Wait until every send has left (and, with a link, until the link is free)."""
    for w in sends:
        w.wait()
    if isinstance(wire, _Messenger):
        wire.settle()


def _span(tracer: Tracer | None, name: str, **meta: object) -> AbstractContextManager[None]:
    return nullcontext() if tracer is None else tracer.span(name, kind="comm", **meta)


# --------------------------------------------------------------------------- the ring

RingPhase = Literal["reduce-scatter", "all-gather"]


def ring_steps(rank: int, n: int, phases: Sequence[RingPhase]) -> list[tuple[str, int, int]]:
    """(phase, chunk sent to the right, chunk received from the left) for each step.

    reduce-scatter step s: send chunk (rank - s - 1), receive chunk (rank - s - 2)
    and reduce it in. After n - 1 steps the last chunk received, (rank - n) mod
    n = rank, has been through every rank: rank r owns chunk r, as in torch.
    all-gather step s: send chunk (rank - s), receive chunk (rank - s - 1).
    """
    steps = []
    for phase in phases:
        for s in range(n - 1):
            if phase == "reduce-scatter":
                steps.append((phase, (rank - s - 1) % n, (rank - s - 2) % n))
            else:
                steps.append((phase, (rank - s) % n, (rank - s - 1) % n))
    return steps


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
def _ring_plan(numel: int, rank: int, n: int, phases: tuple[RingPhase, ...], k: int,
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


_NO_SPAN = nullcontext()


def _ring(flat: torch.Tensor, phases: tuple[RingPhase, ...], op: str, group: dist.ProcessGroup,
          rank: int, n: int, tracer: Tracer | None, link: SimulatedLink | None,
          segment_bytes: int = SEGMENT_BYTES) -> None:
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
    # Every message's tensors, made before the first message: (what goes to the
    # right, where the message from the left lands, what that is reduced into).
    # Empty segments (a tensor smaller than the world) are None: both sides skip them.
    views = [flat[a:b] if b > a else None for a, b in segments]
    messages = []
    for sent, received, land in plan:
        segment = views[received]
        if land is None:  # all-gather: lands in place
            messages.append((views[sent], segment, None))
        else:  # reduce-scatter: lands in scratch, then is reduced into its segment
            into = None if segment is None else scratch[land[0]:land[1]]
            messages.append((views[sent], into, segment))
    send, recv = wire.send, wire.recv
    sends, arrivals, posted, last = [], [], 0, len(messages)
    for i, (_, into, acc) in enumerate(messages):
        # Without a tracer, not even the span's name is made.
        span = _NO_SPAN if tracer is None else _span(
            tracer, f"{steps[i].phase} {steps[i].step}", **steps[i]._asdict())
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
                arrivals[i].wait()
                if acc is not None:
                    _reduce_into(acc, into, op)
    _settle(wire, sends)


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                    op: Op = "sum", *, tracer: Tracer | None = None,
                    link: SimulatedLink | None = None,
                    segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
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
        _ring(flat, ("reduce-scatter", "all-gather"), op, group, rank, n, tracer, link,
              segment_bytes)
    if op == "avg":
        flat.div_(n)
    if not contiguous:
        tensor.copy_(flat.view(tensor.shape))
    return tensor


def ring_reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                        op: Op = "sum", *, tracer: Tracer | None = None,
                        link: SimulatedLink | None = None,
                        segment_bytes: int = SEGMENT_BYTES,
                        scratch: bool = False) -> torch.Tensor:
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


def ring_all_gather(shard: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    numel: int | None = None, tracer: Tracer | None = None,
                    link: SimulatedLink | None = None,
                    segment_bytes: int = SEGMENT_BYTES,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate every rank's flattened shard, in rank order, on every rank.

    With equal shards, leave `numel` out. With shards cut by `chunk_bounds`
    (uneven), pass the full `numel` so every rank knows every shard's size.
    `out`: a contiguous 1-D tensor to gather into (returned); `shard` may be its
    own chunk of it, which then is not copied.
    """
    check_args(shard, "sum")
    group, rank, n = group_info(group)
    numel = shard.numel() * n if numel is None else numel
    bounds = chunk_bounds(numel, n)
    start, end = bounds[rank]
    if end - start != shard.numel():
        raise ValueError(f"rank {rank}'s shard has {shard.numel()} elements, but chunk {rank} "
                         f"of numel={numel} over {n} ranks has {end - start}")
    if out is not None and (out.shape != (numel,) or not out.is_contiguous()
                            or out.dtype != shard.dtype):
        raise ValueError(f"out must be a contiguous 1-D {shard.dtype} tensor of {numel} "
                         f"elements, got {out.dtype} {tuple(out.shape)}")
    flat = torch.empty(numel, dtype=shard.dtype, device=shard.device) if out is None else out
    if flat[start:end].data_ptr() != shard.data_ptr() or not shard.is_contiguous():
        flat[start:end] = shard.flatten()
    if n > 1:
        _ring(flat, ("all-gather",), "sum", group, rank, n, tracer, link, segment_bytes)
    return flat


# --------------------------------------------------------------------------- the parameter server


def naive_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                     op: Op = "sum", root: int = 0, *, tracer: Tracer | None = None,
                     link: SimulatedLink | None = None) -> torch.Tensor:
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
        with _span(tracer, "gather at root", phase="gather", label=f"recv {n - 1} + reduce"):
            parts = [torch.empty_like(flat) for _ in others]
            arrivals = [wire.recv([part], r, 0) for part, r in zip(parts, others)]
            for part, arrival in zip(parts, arrivals):
                arrival.wait()
                _reduce_into(flat, part, op)
        with _span(tracer, "send result", phase="broadcast", label=f"send {n - 1}"):
            _settle(wire, [wire.send([flat], r, 0) for r in others])
    elif n > 1 and flat.numel():
        with _span(tracer, "send to root", phase="gather", label="send"):
            _settle(wire, [wire.send([flat], root, 0)])
        with _span(tracer, "wait for result", phase="broadcast", label="wait for result"):
            wire.recv([flat], root, 0).wait()
    if op == "avg":
        flat.div_(n)
    tensor.copy_(flat.view(tensor.shape))
    return tensor

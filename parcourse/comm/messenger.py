"""The messenger: send and recv that count bytes, stage CUDA tensors over gloo and
apply a simulated link.

It has the process group's own `send(tensors, peer, tag)` and
`recv(tensors, peer, tag)` (peers are ranks in the group; both return something
to `wait()` on), so a collective runs the same code whether it talks to the
group directly or through a messenger. `messenger()` hands out the group itself
when there is nothing to count, stage or slow down, so the plain path
(benchmarks, data parallelism) has no wrapper at all.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist

from parcourse.comm.common import backend_for, global_rank
from parcourse.comm.link import Network, Wire, link_between, sleep_until, wire_for
from parcourse.trace import Tracer

STAMP = 8  # bytes of the departure time at the head of a message over a simulated link
_stamped_per_thread = threading.local()


def _stamped(group: dist.ProcessGroup, way: str, peer: int, tag: int, nbytes: int) -> torch.Tensor:
    """A host buffer for one message over a simulated link: the departure time,
    then `nbytes` of payload. Reused by the next message with the same (group,
    peer, tag) on this thread, so the message before it must be done by then: each
    message of a collective has its own (peer, tag), and a collective returns
    only when its messages are done. The group is part of the key: the groups of a
    mesh use the same small tags with the same peers (a ring's steps count from 0, a
    pipeline's messages from 1), and a pipeline's receive posted early waits beside
    the ring's. (Fresh memory for every message costs a page fault per page, which
    would add to the time measured.) A group's buffers go with the group."""
    groups = _stamped_per_thread.__dict__.setdefault("buffers", weakref.WeakKeyDictionary())
    cache = groups.setdefault(group, {})
    key = (way, peer, tag)
    buf = cache.get(key)
    if buf is None or buf.numel() < STAMP + nbytes:
        buf = cache[key] = torch.empty(STAMP + nbytes, dtype=torch.uint8)
    return buf[: STAMP + nbytes]


class Arrival:
    """A receive posted through a messenger; `wait()` also moves what arrived from
    the host buffer into place (GPU staging) and, with a link, returns only when
    the message would have arrived over it.

    `departed`: after `wait()`, over a simulated link, when the message's first byte
    left its sender (`time.perf_counter()` seconds, one clock for every process on the
    machine): a receiver that waited from before then was waiting for the sender, and
    from then on for the link. None over a real link, where no rank can see it."""

    def __init__(self, work: dist.Work, host: torch.Tensor, dest: torch.Tensor, wire: Wire) -> None:
        self.work, self.host, self.dest, self.wire = work, host, dest, wire
        self.departed: float | None = None

    def wait(self) -> None:
        self.work.wait()
        host, dest = self.host, self.dest
        if self.wire.link is not None:
            n = dest.nbytes
            self.departed = host[:STAMP].view(torch.float64).item()
            sleep_until(self.wire.arrive(self.departed, n))
            dest.view(-1).view(torch.uint8).copy_(host[STAMP:])
        elif host is not dest:
            dest.copy_(host)


class Messenger:
    """A stand-in for the process group that counts bytes, stages GPU tensors
    through host memory and simulates the link.

    With a simulated link, each message carries the time its first byte left
    in 8 extra bytes at its head (not counted as bytes sent), so the receiver
    can add the latency and queue it on its incoming link. With a `Topology`, each
    peer's link is the one between this rank's node and the peer's.
    """

    def __init__(
        self, group: dist.ProcessGroup, tracer: Tracer | None, link: Network | None, staged: bool
    ) -> None:
        self.group = group
        self.tracer = tracer
        self.network = link
        self._me = dist.get_rank()
        self._wires: dict[int, Wire] = {}
        self.staged = staged
        self.sent_until = 0.0  # when the last byte of our last message has left

    def wire(self, peer: int) -> Wire:
        """This rank's wire towards `peer` (a rank of the group)."""
        wire = self._wires.get(peer)
        if wire is None:
            link = link_between(self.network, self._me, global_rank(self.group, peer))
            wire = self._wires[peer] = wire_for(link)
        return wire

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> dist.Work:
        (t,) = tensors
        t = t.contiguous()
        wire = self.wire(peer)
        if wire.link is not None:
            payload = _stamped(self.group, "out", peer, tag, t.nbytes)
            payload[STAMP:].copy_(t.view(-1).view(torch.uint8))
            departed, until = wire.depart(t.nbytes)
            self.sent_until = max(self.sent_until, until)
            payload[:STAMP].view(torch.float64)[0] = departed
        else:
            payload = t.cpu() if self.staged else t
        work = self.group.send([payload], peer, tag)
        if self.tracer is not None:
            self.tracer.count("bytes_sent", t.nbytes, peer=peer, to=global_rank(self.group, peer))
        return work

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> Arrival:
        (dest,) = tensors
        wire = self.wire(peer)
        if wire.link is not None:
            host = _stamped(self.group, "in", peer, tag, dest.nbytes)
        elif self.staged:
            host = torch.empty(dest.shape, dtype=dest.dtype)
        else:
            host = dest
        return Arrival(self.group.recv([host], peer, tag), host, dest, wire)

    def settle(self) -> None:
        """With a link: wait until the last byte of our last message has left."""
        if self.network is not None:
            sleep_until(self.sent_until)


def messenger(
    group: dist.ProcessGroup,
    like: torch.Tensor,
    tracer: Tracer | None = None,
    link: Network | None = None,
) -> dist.ProcessGroup | Messenger:
    """What a collective sends through: the group itself, or a messenger when
    bytes are counted (tracer), a link is simulated, or CUDA tensors go over
    gloo (which moves CPU tensors only, so they are staged through host memory).
    `link`: one `SimulatedLink` for every pair of ranks, or a `Topology`."""
    staged = like.is_cuda and backend_for(group, like.device) == "gloo"
    if tracer is None and link is None and not staged:
        return group
    return Messenger(group, tracer, link, staged)


def settle(wire: dist.ProcessGroup | Messenger, sends: list[dist.Work]) -> None:
    """Wait until every send has left (and, with a link, until the link is free)."""
    for w in sends:
        w.wait()
    if isinstance(wire, Messenger):
        wire.settle()

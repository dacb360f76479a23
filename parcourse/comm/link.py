"""The simulated link: latency and bandwidth for every message, as between machines.

On one machine, messages between processes go through memory and cost little. A
`SimulatedLink` makes every message pay a latency (alpha) and a bandwidth limit
(beta), so that communication cost becomes visible and comparable with the theory
(`parcourse.theory.CostModel`). The messenger (`parcourse.comm.messenger`) applies
it to every message; `Wire` keeps, per process and link, when each of this rank's
two links is free again.

A `Topology` is the two-level network of a cluster: consecutive `ranks_per_node`
ranks share a node and talk over a fast link (NVLink's place), ranks on different
nodes over a slow one (InfiniBand's place). Each message picks its link from the
two ranks it travels between (`link_between`), so a ring that spans nodes pays the
slow hop and a tensor-parallel group inside a node does not.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass


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


@dataclass(frozen=True)
class Topology:
    """Two levels: `inside` a node (consecutive `ranks_per_node` global ranks) and
    `between` nodes. Each rank has one pair of links of each kind, so traffic inside a
    node and traffic between nodes queue separately, as on NVLink and a network card.

    `Topology.of(4)` takes defaults shaped like a real node (NVLink is some 20x
    InfiniBand's bandwidth and a tenth of its latency), scaled down so that a laptop
    shows the difference in milliseconds.
    """

    ranks_per_node: int
    inside: SimulatedLink
    between: SimulatedLink

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    @classmethod
    def of(
        cls,
        ranks_per_node: int,
        inside: SimulatedLink | None = None,
        between: SimulatedLink | None = None,
    ) -> Topology:
        return cls(
            ranks_per_node,
            inside or SimulatedLink.of(latency_us=20, bandwidth_GBps=4.0),
            between or SimulatedLink.of(latency_us=1000, bandwidth_GBps=0.1),
        )

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def link(self, rank: int, peer: int) -> SimulatedLink:
        """The link between two global ranks."""
        return self.inside if self.node(rank) == self.node(peer) else self.between


Network = SimulatedLink | Topology  # what a message can travel over


def link_between(network: Network | None, rank: int, peer: int) -> SimulatedLink | None:
    """The link a message from global rank `rank` to `peer` takes (None: no simulation)."""
    if isinstance(network, Topology):
        return network.link(rank, peer)
    return network


def simulated_link(
    latency_us: float = 0.0, bandwidth_gbps: float | None = None
) -> SimulatedLink | None:
    """The link for these settings (as panels and the CLI take them), or None when both are off."""
    if not (latency_us or bandwidth_gbps):
        return None
    return SimulatedLink.of(latency_us=latency_us, bandwidth_GBps=bandwidth_gbps)


class Wire:
    """One rank's two links: when each is free again.

    There is one per process and link (`wire_for`), shared by every collective
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


_wires: dict[SimulatedLink, Wire] = {}
_wires_lock = threading.Lock()


def wire_for(link: SimulatedLink | None) -> Wire:
    """This process's wire for `link` (a fresh, unused one for no link)."""
    if link is None:
        return Wire(None)
    with _wires_lock:
        return _wires.setdefault(link, Wire(link))


def sleep_until(moment: float) -> None:
    """Let simulated time really pass: sleep (freeing the core) until `moment`."""
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)

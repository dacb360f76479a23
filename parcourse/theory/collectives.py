"""Lesson 01's formulas for one all-reduce of S bytes over N ranks: the bytes each rank
sends (`bytes_sent_per_rank`), the alpha-beta model of its time (`CostModel`) and its fit to
measured times (`fit_cost_model`), and nccl-tests' two bandwidths (`bus_bandwidth`). Lesson
02 prices data parallelism's all-reduce with the same `CostModel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from parcourse.comm import chunk_bounds, ring_steps


def bytes_sent_per_rank(
    algo: Literal["ring", "naive"],
    nbytes: int,
    world_size: int,
    rank: int = 0,
    root: int = 0,
    itemsize: int | None = None,
) -> float:
    """Theory: bytes one rank sends in one all-reduce of `nbytes`.

    ring: 2(N-1)/N x S on every rank; naive: (N-1) x S at the root, S elsewhere.
    The ring cuts chunks between elements; given their `itemsize`, the count is
    exact also when N does not divide the elements (chunks then differ by one,
    and each rank sends the chunks `ring_steps` names: a few elements more or
    less than 2(N-1)/N x S).
    """
    n = world_size
    if n == 1:
        return 0.0
    if algo == "naive":
        return (n - 1) * nbytes if rank == root else float(nbytes)
    if itemsize is None or (nbytes // itemsize) % n == 0:
        return 2 * (n - 1) / n * nbytes
    bounds = chunk_bounds(nbytes // itemsize, n)
    sent = [c for _, c, _ in ring_steps(rank, n, ("reduce-scatter", "all-gather"))]
    return float(sum(bounds[c][1] - bounds[c][0] for c in sent) * itemsize)


def hierarchical_bytes(
    nbytes: int, world_size: int, ranks_per_node: int, rank: int = 0, itemsize: int | None = None
) -> tuple[float, float]:
    """Theory: (bytes inside its node, bytes across nodes) one rank sends in a hierarchical
    all-reduce of `nbytes` (comm/hierarchical.py): 2 (n-1)/n S inside and 2 (k-1)/k S/n
    across, n ranks a node and k = N / n nodes; exact for uneven chunks given `itemsize`
    (the node's ring on the whole tensor, the ring across on this rank's chunk of it)."""
    n, k = ranks_per_node, world_size // ranks_per_node
    local, node = rank % n, rank // n
    inside = bytes_sent_per_rank("ring", nbytes, n, local, itemsize=itemsize)
    if itemsize is None:
        return inside, bytes_sent_per_rank("ring", nbytes // n, k, node)
    start, end = chunk_bounds(nbytes // itemsize, n)[local]
    chunk = (end - start) * itemsize
    return inside, bytes_sent_per_rank("ring", chunk, k, node, itemsize=itemsize)


def flat_ring_bytes_across(
    nbytes: int, world_size: int, ranks_per_node: int, rank: int = 0, itemsize: int | None = None
) -> float:
    """Theory: bytes one rank sends across nodes in the flat ring over `world_size` ranks,
    n a node: the last rank of each node sends its whole 2 (N-1)/N S to the next node's
    first, the others none."""
    if world_size == ranks_per_node or rank % ranks_per_node != ranks_per_node - 1:
        return 0.0
    return bytes_sent_per_rank("ring", nbytes, world_size, rank, itemsize=itemsize)


@dataclass(frozen=True)
class CostModel:
    """The alpha-beta model: a message of b bytes arrives alpha + b / beta seconds
    after it starts to leave; messages sent together pay alpha once (as on a
    `SimulatedLink`)."""

    alpha_s: float
    beta_Bps: float

    def all_reduce_s(self, algo: Literal["ring", "naive"], nbytes: float, world_size: int) -> float:
        """Predicted time of one all-reduce of `nbytes` over `world_size` ranks.

        ring: 2(N-1) steps, one after another, each alpha + (S/N) / beta:
        2(N-1) alpha + 2(N-1)/N x S / beta.
        naive: the N-1 tensors reach the root together and queue on its incoming
        link, then the N-1 results queue on its outgoing link:
        2 alpha + 2(N-1) x S / beta.
        """
        latencies, nbytes_in_turn = _shape(algo, nbytes, world_size)
        return latencies * self.alpha_s + nbytes_in_turn / self.beta_Bps


def _shape(algo: str, nbytes: float, n: int) -> tuple[int, float]:
    """(latencies paid one after another, bytes through one link one after another)."""
    if algo not in ("ring", "naive"):
        raise ValueError(f"unknown algorithm {algo!r}; choose 'ring' or 'naive'")
    if n == 1:
        return 0, 0.0
    if algo == "ring":
        return 2 * (n - 1), 2 * (n - 1) * nbytes / n
    return 2, 2 * (n - 1) * float(nbytes)


def fit_cost_model(
    algo: Literal["ring", "naive"], world_size: int, sizes: Sequence[int], seconds: Sequence[float]
) -> CostModel:
    """Fit alpha and beta of `CostModel.all_reduce_s` to measured times by least squares.

    t = latencies x alpha + bytes x (1/beta) is linear in (alpha, 1/beta). Needs
    at least two ranks and two distinct sizes; both are kept >= 0.
    """
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError("need times for at least two distinct sizes")
    if world_size < 2:
        raise ValueError("one rank sends nothing: there is no alpha or beta to fit")
    rows = [_shape(algo, s, world_size) for s in sizes]
    a = torch.tensor(rows, dtype=torch.float64)
    t = torch.tensor(list(seconds), dtype=torch.float64).unsqueeze(1)
    # Weight by 1/t so small messages (latency-bound) count as much as large ones.
    w = 1 / t
    alpha, inv_beta = torch.linalg.lstsq(a * w, t * w).solution.flatten().tolist()
    alpha, inv_beta = max(alpha, 0.0), max(inv_beta, 1e-15)
    return CostModel(alpha, 1 / inv_beta)


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in bytes/s, as nccl-tests define them.

    algbw = S / t. busbw = algbw x 2(N-1)/N: what each link carried, comparable
    across world sizes and with the link's own bandwidth.
    """
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size

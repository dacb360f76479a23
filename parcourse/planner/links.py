"""What this machine's links cost the course's ranks, measured: gloo's messages and
collectives as a step meets them (rank functions, run on a `Pool`; `here.measured_here`
and `here.scaled` build the planner's "this machine" from them).

- `measure_links`: a message's latency and bandwidth, and each tiny collective by group
  size, back to back; with more ranks than cores, again while the other ranks compute.
- `measure_paced`: tensor parallelism's collectives as a step with its compute simulated
  meets them, each after an idle gap (`here.scaled`).

The costs of a rank's own work, and what a wait costs it, are in `costs`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from parcourse.launch.cpus import usable_cpus

if TYPE_CHECKING:
    import torch


def measure_links(
    ctx: Any,
    big: int = 1 << 18,
    repeats: int = 30,
    loaded_window_s: float = 0.2,
    loaded_windows: int = 3,
) -> dict[str, Any]:
    """gloo's costs here, on the pool's ranks (a rank function), each measured as a
    step meets it, with every rank at it at once (on shared cores, a message waits for
    its receiver to get a core): a message's one-way latency (ping-pong between ranks
    2k and 2k + 1, all pairs together), the bandwidth of a large one, and a tiny
    all-reduce's seconds for each group size that divides the world size (the ranks cut
    into groups of that size, every group reducing at once): what a collective costs
    beyond its bytes, torch's ("collective_s": tensor parallelism's, the loss's mean;
    its all-gather and reduce-scatter, "gather_s" and "scatter_s", which sequence
    parallelism calls) and the course's ring of messages that data parallelism reduces
    with on gloo ("ring_s", `Comm(algorithm="auto")`). Rank 0's figures, on every rank; and the
    processor time a small message takes, its sender's and receiver's together
    ("message_cpu_s", over every rank), and a collective's on each member
    ("collective_cpu_s", "ring_cpu_s": gloo's threads too): on shared cores they take
    cores from the ranks computing.

    With more ranks than cores, the same again while the other ranks compute, as a
    pipeline's stages do while one of them sends or reduces: a woken receiver waits for a
    core ("loaded": "p2p_s", and "collective_s" for each group size below the world's).
    `loaded_windows` windows of `loaded_window_s` seconds each, their median."""
    import torch.distributed as dist

    out: dict[str, Any] = {
        "collective_s": {},
        "ring_s": {},
        "gather_s": {},
        "scatter_s": {},
        "collective_cpu_s": {},
        "ring_cpu_s": {},
    }
    out.update(_message_costs(ctx, big, repeats))
    for size in range(2, ctx.world_size + 1):
        if ctx.world_size % size == 0:
            _collectives_of(ctx, size, repeats, out)
    if ctx.world_size > usable_cpus() and ctx.world_size > 2:
        out["loaded"] = _loaded(ctx, loaded_window_s, loaded_windows)
    shared: list[Any] = [out]
    dist.broadcast_object_list(shared, src=0, group=ctx.group)
    return shared[0]


def _message_costs(ctx: Any, big: int, repeats: int) -> dict[str, float]:
    """A message's processor time, both ends, over every rank ("message_cpu_s"), its
    one-way latency ("p2p_s") and the bandwidth of one of `big` numbers ("bandwidth_Bps"),
    in ping-pong (`_pingpong`); for a world of one, free."""
    import torch
    import torch.distributed as dist

    if ctx.world_size == 1:
        return {"p2p_s": 0.0, "bandwidth_Bps": float("inf")}
    small, cpu = _pingpong(ctx, 16, repeats)
    mean = torch.tensor([cpu / ctx.world_size])
    dist.all_reduce(mean, group=ctx.group)
    out = {"message_cpu_s": mean.item()}  # the processor time of a message, both ends
    large, _ = _pingpong(ctx, big, repeats)
    out["p2p_s"] = small
    out["bandwidth_Bps"] = 4 * big / max(large - small, 1e-9)
    return out


def _pingpong(ctx: Any, n: int, repeats: int) -> tuple[float, float]:
    """A message of `n` numbers: its one-way seconds, and a send's and a receive's
    processor time, over `repeats` round trips between ranks 2k and 2k + 1."""
    import time

    import torch
    import torch.distributed as dist

    t = torch.zeros(n)
    dist.barrier(group=ctx.group)
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        _round_trip(ctx, t)
    return (
        (time.perf_counter() - start) / repeats / 2,
        (time.process_time() - cpu_start) / repeats,
    )


def _collectives_of(ctx: Any, size: int, repeats: int, out: dict[str, Any]) -> None:
    """Each tiny collective's seconds a call in groups of `size`, every group at once,
    into `out` under `measure_links`' keys; for torch's all-reduce and the course's ring,
    a member's processor time too (the mean over the ranks)."""
    import time

    import torch
    import torch.distributed as dist

    from parcourse.comm import Comm

    with _groups_of(ctx, size) as group:
        t = torch.zeros(16)
        ring = Comm(group, algorithm="auto")
        tp = Comm(group)  # torch's, as tensor parallelism calls them
        whole = torch.zeros(16 * size)
        for key, reduce in (
            ("collective_s", lambda: dist.all_reduce(t, group=group)),
            ("ring_s", lambda: ring.all_reduce(t)),
            ("gather_s", lambda: tp.all_gather(t, whole)),
            ("scatter_s", lambda: tp.reduce_scatter(whole)),
        ):  # scratch
            for _ in range(3):
                reduce()
            dist.barrier(group=ctx.group)
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(repeats):
                reduce()
            out[key][size] = (time.perf_counter() - start) / repeats
            if key in ("collective_s", "ring_s"):
                spent = torch.tensor([(time.process_time() - cpu_start) / repeats / ctx.world_size])
                dist.all_reduce(spent, group=ctx.group)  # a member's processor time
                out[key.replace("_s", "_cpu_s")][size] = spent.item()  # the mean


def _loaded(ctx: Any, window_s: float, windows: int) -> dict[str, Any]:
    """A message's latency ("p2p_s") and torch's tiny all-reduce by group size below the
    world's ("collective_s"), each while the other ranks compute
    (`_while_others_compute`): the median of `windows` windows of `window_s` seconds."""
    import statistics

    import torch.distributed as dist

    def median(members: int, op: Any) -> float:
        return statistics.median(
            _while_others_compute(ctx, members, op, window_s) for _ in range(windows)
        )

    # ranks 0 and 1: rank 0 carries the flag, rank 1 returns it
    loaded: dict[str, Any] = {
        "p2p_s": median(2, lambda go: _round_trip(ctx, go)) / 2,
        "collective_s": {},
    }
    for size in range(2, ctx.world_size):
        if ctx.world_size % size == 0:
            with _groups_of(ctx, size, ranks=list(range(size))) as group:  # the sum
                loaded["collective_s"][size] = median(  # carries rank 0's flag
                    size, lambda go, g=group: dist.all_reduce(go, group=g)
                )
    return loaded


def _round_trip(ctx: Any, tensor: torch.Tensor) -> None:
    """`tensor` there and back between ranks 2k and 2k + 1 (the even one sends first);
    the last rank of an odd world has no partner and does nothing."""
    import torch.distributed as dist

    peer = ctx.rank ^ 1
    if peer >= ctx.world_size:
        return
    first, then = (dist.send, dist.recv) if ctx.rank % 2 == 0 else (dist.recv, dist.send)
    first(tensor, peer, group=ctx.group)
    then(tensor, peer, group=ctx.group)


@contextmanager
def _groups_of(ctx: Any, size: int, ranks: list[int] | None = None) -> Iterator[Any]:
    """This rank's group with the pool's ranks cut into groups of `size` (every group made
    on every rank, as `new_group` asks), or, with `ranks`, the one group of those ranks
    (None on the others); destroyed on leaving normally, every rank there first: a gloo
    group keeps its threads and connections until it is destroyed, and a benchmark that
    measures before each of a hundred configurations would otherwise pile up hundreds of
    threads a rank and slow the machine it measures. On an error nothing waits for the
    other ranks (the pool replaces every rank after a failure)."""
    import torch.distributed as dist

    cuts = (
        [ranks]
        if ranks is not None
        else [list(range(g * size, (g + 1) * size)) for g in range(ctx.world_size // size)]
    )
    groups = [dist.new_group(cut) for cut in cuts]
    mine = next((g for g, cut in zip(groups, cuts) if ctx.rank in cut), None)
    yield mine
    dist.barrier(group=ctx.group)
    if mine is not None:
        dist.destroy_process_group(mine)


def _while_others_compute(
    ctx: Any, members: int, op: Any, window_s: float, lag_s: float = 0.03
) -> float:
    """Seconds per call of `op(flag)` on ranks below `members`, called for `window_s`
    while every other rank multiplies matrices (from just before the window to just
    after it). Rank 0 says when to stop: the flag it passes through `op` turns 0."""
    import time

    import torch
    import torch.distributed as dist

    dist.barrier(group=ctx.group)
    start = time.perf_counter()
    seconds = 0.0
    if ctx.rank < members:
        time.sleep(lag_s)  # the others are computing by now
        calls, t0 = 0, time.perf_counter()
        while True:
            go = torch.tensor([float(ctx.rank == 0 and time.perf_counter() - t0 < window_s)])
            op(go)
            if go.item() == 0:
                break
            calls += 1
        seconds = (time.perf_counter() - t0) / max(calls, 1)
    else:
        a = torch.randn(96, 96)
        while time.perf_counter() - start < window_s + 3 * lag_s:
            a @ a
    dist.barrier(group=ctx.group)
    return seconds


def measure_paced(
    ctx: Any, sizes: tuple[int, ...] | None = None, gap_s: float = 0.005, repeats: int = 40
) -> dict[str, dict[int, float]]:
    """torch's tiny all-reduce, all-gather and reduce-scatter as tensor parallelism meets
    them in a step with its compute simulated (a rank function; `here.scaled`): each
    call after `gap_s` asleep, the simulated device computing while the core idles, the
    three in turn (so a slow moment of the machine falls on all three), every group of
    each size in `sizes` at once (by default each size that divides the world size).
    `measure_links` times them back to back, each finding the last one's threads awake
    and its caches warm; after a sleep, gloo's threads wake first. Seen here: a group of 2
    up to twice its back-to-back figures, a group of 4 about the same; measured just
    before a configuration runs and just after, they put every configuration of one run
    of `benchmarks/planner.py --only scaled` within 10% of its measured step. The mean
    seconds a call over every rank, by size, under `measure_links`' keys:
    {"collective_s", "gather_s", "scatter_s"} (an all-reduce's figure also prices the
    loss's mean over data parallelism's replicas)."""
    import time

    import torch
    import torch.distributed as dist

    from parcourse.comm import Comm

    if not gap_s >= 0 or repeats < 1:
        raise ValueError(f"gap_s must be >= 0 and repeats >= 1, got {gap_s} and {repeats}")
    if sizes is None:
        sizes = tuple(k for k in range(2, ctx.world_size + 1) if ctx.world_size % k == 0)
    for size in sizes:
        if not 1 < size <= ctx.world_size or ctx.world_size % size:
            raise ValueError(
                f"a group of {size} does not cut {ctx.world_size} ranks into "
                "equal groups of 2 or more"
            )
    out: dict[str, dict[int, float]] = {"collective_s": {}, "gather_s": {}, "scatter_s": {}}
    for size in sizes:
        seconds = dict.fromkeys(out, 0.0)
        with _groups_of(ctx, size) as group:
            comm = Comm(group)  # torch's, as tensor parallelism calls them
            part, whole = torch.zeros(16), torch.zeros(16 * size)
            ops = {
                "collective_s": lambda c=comm: c.all_reduce(part),
                "gather_s": lambda c=comm: c.all_gather(part, whole),
                "scatter_s": lambda c=comm: c.reduce_scatter(whole),
            }  # scratch
            for op in ops.values():
                op()
                op()
            dist.barrier(group=ctx.group)
            for _ in range(repeats):
                for key, op in ops.items():
                    time.sleep(gap_s)
                    start = time.perf_counter()
                    op()
                    seconds[key] += time.perf_counter() - start
        mean = torch.tensor([seconds[key] / repeats / ctx.world_size for key in out])
        dist.all_reduce(mean, group=ctx.group)  # the mean over every rank
        for key, value in zip(out, mean.tolist()):
            out[key][size] = value
    return out


__all__ = ["measure_links", "measure_paced"]

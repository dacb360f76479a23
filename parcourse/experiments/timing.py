"""One timing harness for every "ours beside torch's" comparison.

Configurations take turns in one run, one call each per round, after a barrier, so that
a change in the machine's load (this machine is shared and noisy) hits all of them alike;
the order swaps every round, so that none always runs right after the barrier. Each
rank times its own calls; a step lasts as long as its slowest rank, so the caller takes,
for each round, the slowest rank's time (`slowest_rank`) and reports the median
(`median_of_slowest`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

Name = TypeVar("Name", bound=Hashable)  # what names a configuration: a str, a tuple


@contextmanager
def one_thread() -> Iterator[None]:
    """Time in one thread, as each rank does: torch's default of one thread per core
    spends small operations waking the others, and on a machine busy with other work its
    waiting threads slow a run several times over, and unevenly (a notebook's kernel
    keeps torch's default)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def take_turns(
    group: dist.ProcessGroup | None,
    steps: Mapping[Name, Callable[[int], Any]],
    rounds: int,
    *,
    warmup: int = 1,
    device: torch.device | None = None,
) -> dict[Name, list[float]]:
    """Seconds per call of each named step on this rank, for `rounds` timed rounds.

    `steps[name](round)` runs one step of that configuration (the round number lets a
    step choose its batch). The first `warmup` rounds run untimed. On a CUDA `device`
    the clock stops after the GPU has finished."""
    times: dict[Name, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for i in range(warmup + rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            dist.barrier(group=group)
            start = time.perf_counter()
            steps[name](i)
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def slowest_rank(per_rank: list[dict[Any, list[float]]], key: Any) -> list[float]:
    """Each repetition lasts as long as its slowest rank."""
    return [max(ts) for ts in zip(*(r[key] for r in per_rank))]


def median_of_slowest(per_rank: list[dict[Any, list[float]]], key: Any) -> float:
    """The median over repetitions of the slowest rank's time: what a step costs."""
    return statistics.median(slowest_rank(per_rank, key))

"""Run one function on N real processes, one per rank, and bring the results back.

    run = launch(fn, 4, x)        # fn(ctx, x) on ranks 0..3; cold start
    with Pool(4) as pool:         # ranks stay up between calls: milliseconds per run
        run = pool.run(fn, x)

lessons/00_launching_ranks.ipynb uses it step by step; the README's section "Where it
runs" covers torchrun and Slurm. By job:
- plan.py: where each rank runs (backend, device, threads), checked before any
  process starts; `RankContext`, what a rank function gets; `Run`, what comes back.
- messages.py: what the caller and the ranks say to each other (typed dataclasses).
- worker.py: the rank side: join the process group, run tasks, answer.
- pool.py: `Pool` and `launch`: start ranks, run, wait (one loop), fail cleanly;
  processes.py: the rank processes (started from a forkserver, killed).
- errors.py: `RankError`, `RankDied`, `RankTimeout`, `SerializationError`.
- registry.py: the live pools of this process (`limit_pools`, `live_pools`,
  `close_pools`); shared.py: the pools shared by size (`shared_pool`).
- progress.py: the line that says what every rank is doing while the caller waits.
- `profile=` (parcourse/profiler.py): each rank under torch.profiler, its `RankProfile`
  in `Run.profiles`, and `Run.to_chrome` writing it beside the course's spans.
- cpus.py: the CPUs this process may use (affinity and cgroup quota) and the ranks a
  lesson starts on them (`usable_cpus`, `lesson_ranks`).
- external.py: under torchrun or Slurm, this process is a rank already.
- hosts.py: several hosts on one Linux machine (network namespaces, root), a torchrun
  agent in each, for running the course across a real, rate-limited link.
"""

from parcourse.launch.cpus import lesson_ranks, usable_cpus
from parcourse.launch.errors import (
    LaunchError,
    RankDied,
    RankError,
    RankTimeout,
    SerializationError,
    group_ranks,
)
from parcourse.launch.external import external_env
from parcourse.launch.plan import Backend, Device, RankContext, Run
from parcourse.launch.pool import DEFAULT_TIMEOUT_S, Pool, launch
from parcourse.launch.progress import describe_progress
from parcourse.launch.registry import PoolInfo, close_pools, limit_pools, live_pools
from parcourse.launch.shared import close_shared_pools, shared_pool
from parcourse.profiler import Profile, RankProfile

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Backend",
    "Device",
    "LaunchError",
    "Pool",
    "PoolInfo",
    "Profile",
    "RankContext",
    "RankDied",
    "RankError",
    "RankProfile",
    "RankTimeout",
    "Run",
    "SerializationError",
    "close_pools",
    "close_shared_pools",
    "describe_progress",
    "external_env",
    "group_ranks",
    "launch",
    "lesson_ranks",
    "limit_pools",
    "live_pools",
    "shared_pool",
    "usable_cpus",
]

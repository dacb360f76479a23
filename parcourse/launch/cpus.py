"""The CPUs this process may use, and how many ranks a lesson starts on them.

`os.cpu_count()` counts the machine's processors, not the ones this process is given: a
class server's student (a container or systemd's CPU quota), a notebook pinned with
`taskset`, Colab and Binder (2 CPUs of a larger machine) all see more than they get.
`usable_cpus()` reads what is really given: the affinity mask (`os.sched_getaffinity`)
and the cgroup's CPU quota (cgroup v2's `cpu.max`, v1's `cpu.cfs_quota_us`), the
smaller of the two.

`lesson_ranks(world_size, default)`: the ranks a lesson runs. A learner's own number is
kept (with a warning when it puts many ranks on each CPU). Left as None, the lesson's
default, or fewer where there are fewer than `default / per_cpu` CPUs, so that Run All
stays inside the time it was measured in. Simulated compute sleeps rather than computes
(it does not load the cores), so only the number of ranks follows the CPUs; the durations
stay as the lesson sets them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _cgroup_paths() -> list[tuple[str, Path]]:
    """(cgroup version, this process' cgroup folder) for each hierarchy with a cpu
    controller, read from /proc/self/cgroup; [] where there is none (macOS, Windows)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # the unified (v2) hierarchy
            root = CGROUP / "unified" if (CGROUP / "unified").is_dir() else CGROUP
            found.append(("v2", root / path.lstrip("/")))
        elif "cpu" in controllers.split(","):
            root = next(
                (
                    CGROUP / name
                    for name in (controllers, "cpu", "cpu,cpuacct")
                    if (CGROUP / name).is_dir()
                ),
                CGROUP / "cpu",
            )
            found.append(("v1", root / path.lstrip("/")))
    return found


def cgroup_cpu_quota() -> float | None:
    """The CPUs the cgroup's quota allows (1.5 for 150 ms of each 100 ms), the smallest
    along this process' cgroup and its parents; None when nothing limits it."""
    quotas = []
    for version, folder in _cgroup_paths():
        for level in (folder, *folder.parents):
            if not level.is_relative_to(CGROUP):
                break
            try:
                if version == "v2":
                    text = (level / "cpu.max").read_text().split()
                    if text and text[0] != "max":
                        quotas.append(int(text[0]) / int(text[1]))
                else:
                    quota = int((level / "cpu.cfs_quota_us").read_text())
                    period = int((level / "cpu.cfs_period_us").read_text())
                    if quota > 0 and period > 0:
                        quotas.append(quota / period)
            except (OSError, ValueError, IndexError):
                continue
    return min(quotas) if quotas else None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, capped by its cgroup's CPU
    quota (rounded down, at least 1)."""
    try:
        mask = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity to read
        mask = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(mask, math.floor(quota + 1e-9) if quota is not None else mask))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def lesson_ranks(
    world_size: int | None,
    default: int,
    *,
    sizes: Iterable[int] | None = None,
    per_cpu: int = 2,
    cpus: int | None = None,
    say: bool = True,
) -> int:
    """The number of ranks a lesson starts, said in one line.

    `world_size`: the learner's choice (kept); None: `default`, or on fewer than
    `default / per_cpu` CPUs the largest of `sizes` (the sizes the lesson runs at,
    default 1..default) with at most `per_cpu` ranks a CPU (at least the smallest size).
    `per_cpu`: how many ranks a CPU carries within the lesson's time (2 where ranks
    compute; more where they mostly sleep through simulated compute). `cpus`: defaults
    to `usable_cpus()`.
    """
    cpus = usable_cpus() if cpus is None else cpus
    chosen = world_size
    if chosen is None:
        allowed = sorted(set(sizes) if sizes is not None else range(1, default + 1))
        fits = [n for n in allowed if n <= default and n <= per_cpu * cpus]
        chosen = fits[-1] if fits else allowed[0]
    elif not isinstance(chosen, int) or isinstance(chosen, bool) or chosen < 1:
        raise ValueError(
            f"world_size must be a whole number of ranks, 1 or more "
            f"(or None for the lesson's default), got {world_size!r}"
        )
    here = f"{_plural(cpus, 'CPU')} here"
    if chosen <= cpus:
        line = f"{here}: running {_plural(chosen, 'rank')}, a core each"
    else:
        line = (
            f"{here}: running {_plural(chosen, 'rank')} on {_plural(cpus, 'core')}, "
            "timings are shared"
        )
    if world_size is None and chosen < default:
        line += f" (fewer than the lesson's {default}: set world_size to choose)"
    elif world_size is not None and chosen > per_cpu * cpus:
        line += " (more ranks than this lesson's cells were timed with: expect it slower)"
    if say:
        print(line)
    return chosen

"""How a run fails, as exceptions that name the rank, and the one-line summaries of
what several ranks were doing."""

from __future__ import annotations

import re
import signal


class LaunchError(RuntimeError):
    """A run failed; subclasses say how."""


class RankError(LaunchError):
    """A rank raised an exception. `rank`, `exc_type` and `remote_traceback` say where."""

    def __init__(
        self,
        rank: int,
        exc_type: str,
        message: str,
        remote_traceback: str,
        others: dict[int, str] | None = None,
    ) -> None:
        self.rank, self.exc_type, self.remote_traceback = rank, exc_type, remote_traceback
        self.others = others or {}
        text = f"rank {rank} raised {exc_type}: {message}\n\n--- traceback from rank {rank} ---\n"
        text += remote_traceback.rstrip()
        if self.others:
            others_text = "; ".join(f"rank {r}: {m}" for r, m in self.others.items())
            text += "\n\nother ranks: " + others_text
        super().__init__(text)


class RankDied(LaunchError):
    """A rank's process ended without returning (a signal, os._exit, a crash)."""

    def __init__(self, rank: int, exitcode: int | None, last: str, others: dict[int, str]) -> None:
        self.rank, self.exitcode = rank, exitcode
        if exitcode is not None and exitcode < 0:
            how = f"was killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
        else:
            how = f"exited with code {exitcode}"
        text = f"rank {rank} {how} while {last or 'running'}"
        if others:
            text += "; other ranks: " + "; ".join(f"rank {r}: {m}" for r, m in others.items())
        super().__init__(text)


class RankTimeout(LaunchError, TimeoutError):
    """Ranks were still running at the timeout. `running` maps rank -> last span entered."""

    def __init__(self, timeout: float, running: dict[int, str], stacks: dict[int, str]) -> None:
        self.timeout, self.running, self.stacks = timeout, running, stacks
        text = f"timed out after {timeout:g} s; still running: {ranks_text(list(running))}"
        for line in group_ranks({r: where or "no span entered" for r, where in running.items()}):
            text += f"\n  {line}"
        # Ranks stuck at the same line show one stack: "ranks 0, 2, 3" and it once.
        by_stack: dict[str, list[int]] = {}
        for r, stack in stacks.items():
            by_stack.setdefault(_same_stack(stack), []).append(r)
        for stack, ranks in by_stack.items():
            text += f"\n\n--- where {ranks_text(ranks)} {'was' if len(ranks) == 1 else 'were'}"
            text += f" stuck ---\n{stack.rstrip()}"
        super().__init__(text)


class SerializationError(LaunchError):
    """The function, its arguments or a rank's result could not be pickled."""


def ranks_text(ranks: list[int]) -> str:
    """[3] -> "rank 3"; [0, 2, 3] -> "ranks 0, 2, 3"."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in sorted(ranks))}"


def _same_stack(stack: str) -> str:
    """A faulthandler stack without what differs between processes (the thread id) and
    without the launcher's own frames below the rank function (most recent call first)."""
    lines = stack.splitlines()
    below = next((i for i, line in enumerate(lines) if line.endswith(" in run_task")), None)
    text = "\n".join(lines[:below])
    return re.sub(r"(Current thread|Thread) 0x[0-9a-f]+", r"\1", text)


def group_ranks(statuses: dict[int, str] | list[str]) -> list[str]:
    """One line per distinct status: {0: "in 'a'", 1: "in 'b'", 2: "in 'a'"} ->
    ["ranks 0, 2: in 'a'", "rank 1: in 'b'"], in order of the first rank."""
    items = statuses.items() if isinstance(statuses, dict) else enumerate(statuses)
    by_status: dict[str, list[int]] = {}
    for r, status in items:
        by_status.setdefault(status, []).append(r)
    return [f"{ranks_text(ranks)}: {status}" for status, ranks in by_status.items()]

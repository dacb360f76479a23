"""The rank processes themselves: how they are started, the caller's handles on each,
and how they are killed.

They come from a forkserver with torch and parcourse preloaded (spawn where forkserver
is missing), never from fork: a parent that already ran a matmul deadlocks forked
children in OpenMP, and CUDA cannot be used after fork."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class RankProcess:
    """The caller's handles on one rank process."""

    process: Any
    conn: Any  # the pipe for messages
    lifeline: Any  # closing it tells the rank its parent is gone
    status: Any  # shared memory: what the rank is doing
    stack_file: str  # where it writes its stack on SIGUSR1

    def status_text(self) -> str:
        return self.status.value.decode("utf-8", "replace")


def start_context() -> mp.context.BaseContext:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Takes effect only if the forkserver is not running yet; later calls are harmless.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "cloudpickle", "parcourse"])
        return ctx
    return mp.get_context("spawn")


@contextmanager
def main_not_reimported() -> Iterator[None]:
    """Start processes without re-running the caller's __main__ in them.

    multiprocessing re-imports the main script in every spawned or forkserver
    child, which re-runs a script's top level unless it is guarded by
    `if __name__ == "__main__":`. The ranks never need it (functions travel by
    value), so the start is made with a blank __main__ in view.
    """
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def stack_folder() -> str:
    """A new folder for one start's stack files, named after this process
    (parcourse-<pid>-...). Folders that processes now gone left behind are removed
    first: a caller killed together with its ranks (a kernel and its process group) has
    no one left to tidy up after it."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "parcourse" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:  # gone (another user's process raises PermissionError)
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except (PermissionError, OverflowError):
            pass
    return tempfile.mkdtemp(prefix=f"parcourse-{os.getpid()}-")


def kill_all(ranks: list[RankProcess]) -> None:
    for rank in ranks:
        if rank.process.is_alive():
            rank.process.kill()
    for rank in ranks:
        rank.process.join(timeout=5)
        for c in (rank.conn, rank.lifeline):
            c.close()
    for folder in {os.path.dirname(rank.stack_file) for rank in ranks}:
        shutil.rmtree(folder, ignore_errors=True)
    ranks.clear()

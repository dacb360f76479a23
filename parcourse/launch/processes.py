"""The rank processes themselves: how they are started, the caller's handles on each,
and how they are killed.

They come from a forkserver with torch and parcourse preloaded (spawn where forkserver
is missing), never from fork: a parent that already ran a matmul deadlocks forked
children in OpenMP, and CUDA cannot be used after fork."""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager, suppress
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


def start_context() -> mp.context.ForkServerContext | mp.context.SpawnContext:
    quick_kernel_shutdown()
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Takes effect only if the forkserver is not running yet; later calls are harmless.
        # torch._dynamo: torch.optim's optimizers import it at their first construction
        # (about 1.5 s of one core), which every new rank would otherwise pay again.
        ctx.set_forkserver_preload(
            ["torch", "torch.distributed", "torch._dynamo", "cloudpickle", "parcourse"]
        )
        return ctx
    return mp.get_context("spawn")


_WRAPPED: list[bool] = [False]


def quick_kernel_shutdown() -> None:
    """In a Jupyter kernel, let its shutdown end at once, and cleanly.

    At a shutdown request ipykernel signals every process below the kernel, SIGTERM and
    then SIGKILL, and sleeps between rounds until none is left. The forkserver is the
    kernel's own child, and nothing waits for it once it is gone, so it stays on the
    list as a zombie; multiprocessing's resource tracker ignores SIGTERM. The kernel was
    still at it when the client, after 2.5 s, sent it SIGTERM: every shutdown of a
    kernel that had run ranks took 2.6 s instead of under one, and it died without its exit
    handlers (multiprocessing's pymp-* folder stayed in the temporary folder). So the
    kernel's `do_shutdown`, which runs before the signals, first closes the pools (their
    ranks killed and waited for: none is left for a signal to be slow on) and asks both
    helpers to end, from threads that wait for them. It does not wait itself: the
    forkserver ends sooner by ipykernel's SIGTERM than by tearing torch down."""
    ipython = sys.modules.get("IPython")  # never imported here: only if already loaded
    kernel = getattr(ipython.get_ipython(), "kernel", None) if ipython is not None else None
    if kernel is None or _WRAPPED[0] or not hasattr(kernel, "do_shutdown"):
        return
    _WRAPPED[0] = True
    original = kernel.do_shutdown

    async def do_shutdown(restart: bool) -> Any:
        from parcourse.launch.registry import close_pools

        close_pools()
        stop_helpers()
        result = original(restart)
        return await result if inspect.isawaitable(result) else result

    kernel.do_shutdown = do_shutdown


def stop_helpers() -> None:
    """Ask multiprocessing's forkserver and resource tracker of this process to end,
    each from a thread of its own that then waits for it (neither stays a zombie). The
    forkserver ends at once, the tracker once the ranks, which hold its pipe too, are
    gone. A later start starts them again."""
    from multiprocessing import forkserver, resource_tracker

    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        stop = getattr(helper, "_stop", None)  # private; Python's own tests call it
        if stop is not None:
            threading.Thread(
                target=_quietly, args=(stop,), daemon=True, name="parcourse-stop-helper"
            ).start()


def _quietly(stop: Any) -> None:
    with suppress(OSError):
        stop()


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

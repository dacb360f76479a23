"""Run one function on N real processes, one per rank, and bring the results back.

    run = launch(fn, 4, x)        # fn(ctx, x) on ranks 0..3; cold start
    with Pool(4) as pool:         # ranks stay up between calls: milliseconds per run
        run = pool.run(fn, x)

How it works (lessons/00_launching_ranks.ipynb uses it step by step; the README's
section "Where it runs" covers torchrun and Slurm):
- Processes come from a forkserver with torch and parcourse preloaded (spawn
  where forkserver is missing), never from fork: a parent that already ran a
  matmul deadlocks forked children in OpenMP, and CUDA cannot be used after fork.
- The function travels by value (cloudpickle), so a function written in a
  notebook cell runs on the ranks.
- The caller owns the rendezvous: a TCPStore on 127.0.0.1 whose port the OS
  picks, so two launches at once never collide.
- Every rank ignores SIGINT (a kernel interrupt signals the whole process group)
  and uses one thread on CPU (two ranks with two threads each on two cores run
  several times slower than with one).
- Failures come back as exceptions naming the rank; after any failure every
  process of the run is killed, and a Pool starts fresh ranks for its next run.
- Under torchrun (RANK and WORLD_SIZE set) or a multi-task Slurm step, the same
  function runs in this process on the environment's process group.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for
from pathlib import Path
from typing import Any, Literal

import cloudpickle
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from parcourse.trace import Trace, TraceData, Tracer

Backend = Literal["auto", "gloo", "nccl"]
Device = Literal["auto", "cpu", "cuda"]

DEFAULT_TIMEOUT_S = 60.0
# After one rank fails, how long the others get to report before they are killed.
# Ranks blocked in a collective on the failed rank would otherwise wait forever.
_GRACE_S = 0.5
# Generous: the caller's timeout, not the backend's, decides when a run has hung.
_PG_TIMEOUT = datetime.timedelta(minutes=30)
_STATUS_BYTES = 160


# --------------------------------------------------------------------------- errors


class LaunchError(RuntimeError):
    """A run failed; subclasses say how."""


class RankError(LaunchError):
    """A rank raised an exception. `rank`, `exc_type` and `remote_traceback` say where."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str,
                 others: dict[int, str] | None = None) -> None:
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
        text = f"timed out after {timeout:g} s; still running: {_ranks_text(list(running))}"
        for line in group_ranks({r: where or "no span entered" for r, where in running.items()}):
            text += f"\n  {line}"
        # Ranks stuck at the same line show one stack: "ranks 0, 2, 3" and it once.
        by_stack: dict[str, list[int]] = {}
        for r, stack in stacks.items():
            by_stack.setdefault(_same_stack(stack), []).append(r)
        for stack, ranks in by_stack.items():
            text += f"\n\n--- where {_ranks_text(ranks)} {'was' if len(ranks) == 1 else 'were'}"
            text += f" stuck ---\n{stack.rstrip()}"
        super().__init__(text)


def _ranks_text(ranks: list[int]) -> str:
    """[3] -> "rank 3"; [0, 2, 3] -> "ranks 0, 2, 3"."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in sorted(ranks))}"


def _same_stack(stack: str) -> str:
    """A faulthandler stack without what differs between processes (the thread id) and
    without the launcher's own frames below the rank function (most recent call first)."""
    lines = stack.splitlines()
    below = next((i for i, line in enumerate(lines) if line.endswith(" in _run_one")), None)
    text = "\n".join(lines[:below])
    return re.sub(r"(Current thread|Thread) 0x[0-9a-f]+", r"\1", text)


def group_ranks(statuses: dict[int, str] | list[str]) -> list[str]:
    """One line per distinct status: {0: "in 'a'", 1: "in 'b'", 2: "in 'a'"} ->
    ["ranks 0, 2: in 'a'", "rank 1: in 'b'"], in order of the first rank."""
    items = statuses.items() if isinstance(statuses, dict) else enumerate(statuses)
    by_status: dict[str, list[int]] = {}
    for r, status in items:
        by_status.setdefault(status, []).append(r)
    return [f"{_ranks_text(ranks)}: {status}" for status, ranks in by_status.items()]


class SerializationError(LaunchError):
    """The function, its arguments or a rank's result could not be pickled."""


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class _Plan:
    """Where each rank runs; decided (and checked) before any process starts."""

    world_size: int
    backend: str
    devices: tuple[str, ...]
    threads: int


def _plan(world_size: int, backend: str, device: str, threads: int | None) -> _Plan:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; choose 'auto', 'gloo' or 'nccl'")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; choose 'auto', 'cpu' or 'cuda'")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if n_gpu and backend != "gloo" else "cpu"
    if device == "cpu":
        if backend == "nccl":
            raise ValueError("the nccl backend needs GPUs; use backend='gloo' on CPU")
        return _Plan(world_size, "gloo", ("cpu",) * world_size, threads or 1)
    if n_gpu == 0:
        raise ValueError("device='cuda' but torch sees no GPU; use device='cpu'")
    if backend == "nccl" and n_gpu < world_size:
        raise ValueError(
            f"nccl needs one GPU per rank: {world_size} ranks, {n_gpu} GPU(s); "
            "use backend='gloo' (or 'auto') to let ranks share a GPU"
        )
    chosen = "nccl" if backend == "nccl" or (backend == "auto" and n_gpu >= world_size) else "gloo"
    devices = tuple(f"cuda:{r % n_gpu}" for r in range(world_size))
    return _Plan(world_size, chosen, devices, threads or 1)


# --------------------------------------------------------------------------- results


@dataclass
class RankContext:
    """What a rank function gets as its first argument."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup
    tracer: Tracer
    backend: str


@dataclass
class Run:
    """The outcome of one run: per-rank results, the merged trace, timings."""

    results: list[Any]
    trace: Trace
    wall_s: float
    world_size: int
    backend: str
    startup_s: float = 0.0
    rank_s: list[float] = field(default_factory=list)

    def __repr__(self) -> str:
        return (f"Run(world_size={self.world_size}, backend={self.backend!r}, "
                f"wall_s={self.wall_s:.3f}, results={self.results!r})")


def _dumps(obj: Any, what: str) -> bytes:
    try:
        return cloudpickle.dumps(obj)
    except Exception as e:  # pickling raises many types: TypeError, PicklingError, ...
        raise SerializationError(f"cannot send {what} to the ranks: {type(e).__name__}: {e}") from e


def _to_cpu(value: Any) -> Any:
    """Results come home on the CPU, so the caller never has to initialise CUDA."""
    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)


# --------------------------------------------------------------------------- the rank side


def _run_one(ctx: RankContext, payload: bytes) -> tuple[Any, ...]:
    """Execute one task on this rank; always returns a message, never raises."""
    t0 = time.perf_counter()
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        ctx.tracer.set_status(f"running {getattr(fn, '__name__', 'the function')}, "
                              "before its first span")
        value = fn(ctx, *args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - a SystemExit in rank code is an error too
        return ("error", ctx.rank, time.perf_counter_ns(), type(e).__name__, str(e),
                traceback.format_exc(), ctx.tracer.data())
    try:
        blob = cloudpickle.dumps(_to_cpu(value))
    except Exception as e:
        message = f"rank {ctx.rank} returned a {type(value).__name__} that cannot be pickled: {e}"
        return ("unpicklable", ctx.rank, message)
    return ("ok", ctx.rank, blob, ctx.tracer.data(), time.perf_counter() - t0)


def _exit_when_parent_dies(lifeline: Any, stack_file: str) -> None:
    """The parent holds the other end; EOF means it is gone, so this rank goes too
    (tidying up what the parent no longer can)."""
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    with contextlib.suppress(OSError):
        os.remove(stack_file)
        os.rmdir(os.path.dirname(stack_file))  # the last rank out removes the folder
    os._exit(1)


def _worker(rank: int, plan: _Plan, port: int, prefix: str, conn: Any, lifeline: Any,
            status: Any, stack_file: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_parent_dies, args=(lifeline, stack_file),
                     daemon=True).start()
    # On SIGUSR1 (sent at a timeout) write this rank's Python stack for the error message.
    faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=False)  # noqa: SIM115
    torch.set_num_threads(plan.threads)
    device = torch.device(plan.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    status.value = b"joining the process group"
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_PG_TIMEOUT)
        dist.init_process_group(plan.backend, store=dist.PrefixStore(prefix, store), rank=rank,
                                world_size=plan.world_size, timeout=_PG_TIMEOUT)
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", rank, time.perf_counter_ns(), type(e).__name__, str(e),
                   traceback.format_exc(), TraceData(rank)))
        return
    group = dist.group.WORLD
    conn.send(("ready", rank))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message[0] == "stop":
            break
        tracer = Tracer(rank, status=status)
        # Unpickling imports the modules the function needs (not preloaded: seconds, once).
        status.value = b"loading the function and importing its modules"
        ctx = RankContext(rank, plan.world_size, device, group, tracer, plan.backend)
        conn.send(_run_one(ctx, message[1]))
        status.value = b"idle"
    dist.destroy_process_group()


# --------------------------------------------------------------------------- the caller side


def _context() -> mp.context.BaseContext:
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Takes effect only if the forkserver is not running yet; later calls are harmless.
        ctx.set_forkserver_preload(["torch", "torch.distributed", "cloudpickle", "parcourse"])
        return ctx
    return mp.get_context("spawn")


@contextmanager
def _main_not_reimported() -> Iterator[None]:
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


@dataclass
class _Rank:
    process: Any
    conn: Any
    lifeline: Any
    status: Any
    stack_file: str


def _status(rank: _Rank) -> str:
    return rank.status.value.decode("utf-8", "replace")


Progress = Callable[[list[str], float], None]


# --------------------------------------------------------------------------- live pools
# Every pool of this process that holds ranks, least recently used first. Each rank is
# a process with its own copy of torch (~170 MB), so a notebook that keeps starting pools
# of new sizes fills a laptop's memory; limit_pools(n) closes the oldest instead.

_LIVE: dict[int, weakref.ref[Pool]] = {}
_LIMIT: list[int | None] = [None]


def limit_pools(n: int | None) -> int | None:
    """Keep at most `n` pools with live ranks in this process (None: no limit).

    Starting the ranks of one more pool closes the least recently used others; a
    closed pool starts fresh ranks at its next run (and counts again). Returns the
    previous limit. The course's panels set 2. Pools that `launch` makes for one run
    are closed right after it and close no others.
    """
    if n is not None and n < 1:
        raise ValueError(f"the limit must be >= 1 or None, got {n}")
    previous, _LIMIT[0] = _LIMIT[0], n
    pools = [p for p in _live() if p.counts]
    if n is not None:
        for old in pools[: max(0, len(pools) - n)]:
            old.close()
    return previous


def _live() -> list[Pool]:
    for key in [k for k, ref in _LIVE.items() if ref() is None]:
        del _LIVE[key]  # collected: its finalizer has stopped its ranks
    pools = [ref() for ref in _LIVE.values()]
    return [p for p in pools if p is not None and p._ranks]


def _touch(pool: Pool) -> None:
    if id(pool) in _LIVE:
        _LIVE[id(pool)] = _LIVE.pop(id(pool))  # now the most recently used


def _make_room(pool: Pool) -> None:
    limit = _LIMIT[0]
    if limit is None or not pool.counts:
        return
    others = [p for p in _live() if p is not pool and p.counts]
    for old in others[: max(0, len(others) - limit + 1)]:
        old.close()


@dataclass(frozen=True)
class PoolInfo:
    """One live pool: its ranks' process ids and the memory they hold."""

    pool: Pool
    pids: list[int]
    memory_bytes: int
    idle_s: float

    def __str__(self) -> str:
        n = len(self.pids)
        return (f"{n} rank{'s' * (n > 1)} ({self.pool.plan.backend}), pids "
                f"{', '.join(map(str, self.pids))}: {self.memory_bytes / 2**20:,.0f} MiB, "
                f"idle {self.idle_s:.0f} s")


def live_pools() -> list[PoolInfo]:
    """The pools of this process that hold ranks, least recently used first.

    Memory is each rank's unique set size (what closing it frees; pages shared with
    the forkserver, such as torch's code, are not counted twice).
    """
    import psutil

    infos = []
    for pool in _live():
        total = 0
        for pid in pool.pids:
            try:
                total += psutil.Process(pid).memory_full_info().uss
            except (psutil.Error, OSError):
                pass
        infos.append(PoolInfo(pool, pool.pids, total, time.monotonic() - pool.last_used))
    return infos


def close_pools() -> int:
    """Close every live pool of this process; returns how many were closed."""
    pools = _live()
    for pool in pools:
        pool.close()
    return len(pools)


class _LiveStatus:
    """A status line under the notebook cell that runs a pool, shown once a run has taken
    more than DELAY_S seconds, updated twice a second, removed when it ends.

    It is first shown empty and then updated (a display id): Jupyter shows the updates,
    and nbval, which ignores updates, sees one output with nothing in it to compare.
    """

    DELAY_S = 3.0

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.t0 = time.perf_counter()
        self.next = self.t0 + self.DELAY_S
        self.handle: Any = None

    @classmethod
    def in_notebook(cls, pool: Pool) -> _LiveStatus | None:
        ipython = sys.modules.get("IPython")  # never imported here: only if already loaded
        shell = ipython.get_ipython() if ipython is not None else None
        return cls(pool) if getattr(shell, "kernel", None) is not None else None

    def __call__(self, statuses: list[str], _elapsed: float) -> None:
        now = time.perf_counter()
        if now < self.next:
            return
        self.next = now + 0.5
        from IPython.display import display

        text = f"{now - self.t0:.0f} s: " + describe_progress(self.pool, statuses)
        if self.handle is None:
            self.handle = display({}, raw=True, display_id=True)
        self.handle.update({"text/plain": text}, raw=True)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.update({}, raw=True)


def describe_progress(pool: Pool, statuses: list[str]) -> str:
    """One line for a waiting caller: "starting 4 ranks: ranks 0, 1: joining the process
    group; ..." while ranks start, then "1 of 4 ranks done; ranks 0, 2: in 'forward'"."""
    n = len(statuses)
    if pool.starting:
        ready = statuses.count("ready")
        busy = {r: s for r, s in enumerate(statuses) if s != "ready"}
        return (f"starting {n} rank{'s' * (n > 1)} ({ready} ready; each imports torch and "
                f"joins the process group): " + "; ".join(group_ranks(busy)))
    done = statuses.count("done")
    busy = {r: s for r, s in enumerate(statuses) if s != "done"}
    return f"{done} of {n} ranks done; " + "; ".join(group_ranks(busy))


class Pool:
    """N ranks kept alive, with their process group, across many runs.

    >>> pool = Pool(4)
    >>> pool.run(fn, x).results
    >>> pool.close()            # or `with Pool(4) as pool:`

    After a failed, timed-out or interrupted run the old ranks are killed and
    the next `run` starts fresh ones. `close()` (also at interpreter exit)
    stops every rank. `start=False` leaves starting the ranks to the first run,
    whose `on_progress` then reports the start too. `live_pools()` lists the
    pools of this process that hold ranks, `limit_pools(n)` caps them.
    """

    def __init__(self, world_size: int, *, backend: Backend = "auto", device: Device = "auto",
                 timeout: float | None = DEFAULT_TIMEOUT_S, threads: int | None = None,
                 start: bool = True) -> None:
        self.plan = _plan(world_size, backend, device, threads)
        self.world_size = world_size
        self.timeout = timeout
        self._external = _external_env()
        if self._external is not None and self._external[1] != world_size:
            raise ValueError(
                f"this process was started by a launcher with WORLD_SIZE={self._external[1]}, "
                f"but {world_size} ranks were asked for"
            )
        self._ranks: list[_Rank] = []
        self._store: Any = None
        self._generation = 0
        self._lock = threading.Lock()
        self.startups = 0
        self.starting = False  # True while ranks start: their statuses say how far they are
        self.counts = True  # against limit_pools(); not the pools launch() makes for one run
        self.last_used = time.monotonic()
        self._finalizer = weakref.finalize(self, _kill_all, self._ranks)
        if start:
            self._start()

    # -- lifecycle

    @property
    def pids(self) -> list[int]:
        return [r.process.pid for r in self._ranks]

    @property
    def alive(self) -> bool:
        return bool(self._ranks) and all(r.process.is_alive() for r in self._ranks)

    def _start(self, on_progress: Progress | None = None) -> float:
        if self._external is not None:
            _init_external(self.plan)
            return 0.0
        _make_room(self)
        self.starting = True
        try:
            return self._start_ranks(on_progress)
        except BaseException:  # an interrupt while starting, too: no half-started ranks
            self._kill()
            raise
        finally:
            self.starting = False

    def _start_ranks(self, on_progress: Progress | None) -> float:
        t0 = time.perf_counter()
        _LIVE.pop(id(self), None)
        _LIVE[id(self)] = weakref.ref(self)  # the most recently used
        ctx = _context()
        if self._store is None:
            # Port 0: the OS picks a free port, so concurrent launches never collide.
            self._store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=_PG_TIMEOUT,
                                        wait_for_workers=False)
        self._generation += 1
        prefix = f"pool{os.getpid()}-{id(self)}-{self._generation}"
        stack_dir = tempfile.mkdtemp(prefix="parcourse-")
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            life_read, life_write = ctx.Pipe(duplex=False)
            status = ctx.RawArray("c", _STATUS_BYTES)
            status.value = b"starting its process"
            stack_file = os.path.join(stack_dir, f"rank{rank}.txt")
            process = ctx.Process(
                target=_worker, name=f"parcourse-rank{rank}", daemon=True,
                args=(rank, self.plan, self._store.port, prefix, child_conn, life_read, status,
                      stack_file),
            )
            with _main_not_reimported():
                process.start()
            child_conn.close()
            life_read.close()
            self._ranks.append(_Rank(process, parent_conn, life_write, status, stack_file))
        pending = set(range(self.world_size))
        deadline = time.monotonic() + max(self.timeout or 0, 120.0)
        while pending:
            if time.monotonic() > deadline:
                self._kill()
                raise LaunchError(f"ranks {sorted(pending)} did not join the process group")
            if on_progress is not None:
                on_progress([_status(r) if i in pending else "ready"
                             for i, r in enumerate(self._ranks)], time.perf_counter() - t0)
            watch = {}
            for r in pending:
                watch[self._ranks[r].conn] = r
                watch[self._ranks[r].process.sentinel] = r
            for ready in wait_for(list(watch), timeout=0.1 if on_progress else 0.5):
                r = watch[ready]
                rank = self._ranks[r]
                if r in pending and rank.conn.poll():
                    message = rank.conn.recv()
                    if message[0] != "ready":
                        self._kill()
                        raise RankError(r, message[3], message[4], message[5])
                    pending.discard(r)
                elif r in pending:
                    rank.process.join(timeout=1)
                    code = rank.process.exitcode
                    self._kill()
                    raise RankDied(r, code, "joining the process group", {})
        self.startups += 1
        return time.perf_counter() - t0

    def _kill(self) -> None:
        _LIVE.pop(id(self), None)
        _kill_all(self._ranks)

    def close(self) -> None:
        """Stop every rank (politely, then by force) and free the rendezvous port."""
        if self._external is None:
            for rank in self._ranks:
                try:
                    rank.conn.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
            for rank in self._ranks:
                rank.process.join(timeout=5)
        self._kill()
        self._store = None

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "external" if self._external else ("up" if self.alive else "down")
        return f"Pool(world_size={self.world_size}, backend={self.plan.backend!r}, {state})"

    # -- running

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None | Literal["default"]
            = "default", on_progress: Callable[[list[str], float], None] | None = None,
            **kwargs: Any) -> Run:
        """Run `fn(ctx, *args, **kwargs)` on every rank and wait for all of them.

        `timeout` (seconds, None for no limit) defaults to the pool's.
        `on_progress(statuses, elapsed_s)` is called about ten times a second
        with what each rank is doing (its current span; "done" when finished),
        and while ranks start (`self.starting`). Without one, a run called from
        a notebook cell that lasts more than a few seconds shows a live status
        line under the cell.
        """
        __tracebackhide__ = True  # IPython: show the learner's cell and the error
        if self._external is not None:
            return _run_external(self.plan, fn, args, kwargs)
        payload = _dumps((fn, args, kwargs), f"the function {getattr(fn, '__name__', fn)!r}")
        return self._run_payload(payload, timeout, on_progress)

    def _run_payload(self, payload: bytes, timeout: float | None | Literal["default"],
                     on_progress: Progress | None) -> Run:
        __tracebackhide__ = True  # IPython: show the learner's cell and the error
        limit = self.timeout if timeout == "default" else timeout
        live = _LiveStatus.in_notebook(self) if on_progress is None else None
        try:
            return self._run_locked(payload, limit, on_progress or live)
        finally:
            if live is not None:
                live.close()

    def _run_locked(self, payload: bytes, limit: float | None,
                    on_progress: Progress | None) -> Run:
        __tracebackhide__ = True  # IPython: show the learner's cell and the error
        with self._lock:
            self.last_used = time.monotonic()
            _touch(self)
            startup = 0.0
            if not self.alive:
                self._kill()
                startup = self._start(on_progress)
            try:
                return self._dispatch(payload, limit, on_progress, startup)
            except BaseException:
                self._kill()  # KeyboardInterrupt too: the next run starts fresh ranks
                raise
            finally:
                self.last_used = time.monotonic()

    def _dispatch(self, payload: bytes, limit: float | None, on_progress: Progress | None,
                  startup: float) -> Run:
        __tracebackhide__ = True  # IPython: show the learner's cell and the error
        t0 = time.perf_counter()
        for rank in self._ranks:
            rank.conn.send(("run", payload))
        n = self.world_size
        results: list[Any] = [None] * n
        rank_s = [0.0] * n
        parts: list[TraceData] = [TraceData(r) for r in range(n)]
        failures: dict[int, tuple[Any, ...]] = {}
        died: dict[int, tuple[int | None, str]] = {}
        pending = set(range(n))
        first_failure: float | None = None
        next_progress = t0
        while pending:
            now = time.perf_counter()
            if first_failure is not None and now - first_failure > _GRACE_S:
                break
            if limit is not None and now - t0 > limit:
                raise self._timeout(limit, pending)
            if on_progress is not None and now >= next_progress:
                on_progress([_status(r) if i in pending else "done"
                             for i, r in enumerate(self._ranks)], now - t0)
                next_progress = now + 0.1
            watch = {}
            for r in pending:
                watch[self._ranks[r].conn] = r
                watch[self._ranks[r].process.sentinel] = r
            for ready in wait_for(list(watch), timeout=0.05):
                r = watch[ready]
                if r not in pending:
                    continue
                rank = self._ranks[r]
                if ready is rank.conn or rank.conn.poll():
                    try:
                        message = rank.conn.recv()
                    except (EOFError, OSError):
                        message = None
                    if message is not None:
                        pending.discard(r)
                        if message[0] == "ok":
                            results[r], parts[r], rank_s[r] = message[2], message[3], message[4]
                        else:
                            failures[r] = message
                            first_failure = first_failure or time.perf_counter()
                        continue
                rank.process.join(timeout=1)
                died[r] = (rank.process.exitcode, _status(rank))
                pending.discard(r)
                first_failure = first_failure or time.perf_counter()
        if failures or died:
            raise self._failure(failures, died, pending)
        values = []
        for r, blob in enumerate(results):
            try:
                values.append(cloudpickle.loads(blob))
            except Exception as e:
                raise SerializationError(f"rank {r}'s result cannot be unpickled here: {e}") from e
        wall = time.perf_counter() - t0 + startup
        return Run(values, Trace.merge(n, parts), wall, n, self.plan.backend, startup, rank_s)

    def _timeout(self, limit: float, pending: set[int]) -> RankTimeout:
        running = {r: _status(self._ranks[r]) for r in sorted(pending)}
        for r in pending:
            try:
                os.kill(self._ranks[r].process.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.2)  # faulthandler writes from a signal handler; give it a moment
        stacks = {}
        for r in sorted(pending):
            text = Path(self._ranks[r].stack_file).read_text(errors="replace")
            if text.strip():
                stacks[r] = text
        self._kill()
        return RankTimeout(limit, running, stacks)

    def _failure(self, failures: dict[int, tuple[Any, ...]],
                 died: dict[int, tuple[int | None, str]], pending: set[int]) -> LaunchError:
        others = {r: f"stopped while {_status(self._ranks[r])}" for r in sorted(pending)}
        self._kill()
        if died:
            r = min(died)
            for q, m in failures.items():
                others[q] = f"{m[3]}: {m[4]}" if m[0] == "error" else m[2]
            others.update({q: f"exit code {c[0]}" for q, c in died.items() if q != r})
            return RankDied(r, died[r][0], died[r][1], dict(sorted(others.items())))
        unpicklable = [m for m in failures.values() if m[0] == "unpicklable"]
        if unpicklable:  # the lowest rank: the same message whichever rank answered first
            return SerializationError(min(unpicklable, key=lambda m: m[1])[2])
        # The earliest error on the shared clock is the cause; later ones are usually
        # other ranks noticing that a peer has gone.
        first = min(failures.values(), key=lambda m: m[2])
        for q, m in failures.items():
            if q != first[1]:
                others[q] = f"{m[3]}: {m[4]}"
        return RankError(first[1], first[3], first[4], first[5], dict(sorted(others.items())))


def _kill_all(ranks: list[_Rank]) -> None:
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


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: Backend = "auto",
           device: Device = "auto", timeout: float | None = DEFAULT_TIMEOUT_S,
           threads: int | None = None, **kwargs: Any) -> Run:
    """Start `world_size` ranks, run `fn(ctx, *args, **kwargs)` on each, stop them.

    Raises ValueError for bad arguments and SerializationError for a function
    that cannot be sent, before any process starts; RankError, RankDied or
    RankTimeout when the run fails. `Run.wall_s` includes starting the ranks.
    """
    __tracebackhide__ = True  # IPython: show the learner's cell and the error
    _plan(world_size, backend, device, threads)
    if _external_env() is not None:
        pool = Pool(world_size, backend=backend, device=device, timeout=timeout, threads=threads)
        return pool.run(fn, *args, **kwargs)
    payload = _dumps((fn, args, kwargs), f"the function {getattr(fn, '__name__', fn)!r}")
    with Pool(world_size, backend=backend, device=device, timeout=timeout, threads=threads,
              start=False) as pool:
        pool.counts = False
        return pool._run_payload(payload, "default", None)  # starts the ranks, then runs


# --------------------------------------------------------------------------- torchrun / Slurm


def _external_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when a launcher started this process, else None."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    # A one-task Slurm job (e.g. Jupyter on a compute node) still launches its own ranks.
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return None


def _init_external(plan: _Plan) -> None:
    if dist.is_initialized():
        return
    rank, world_size, _ = _external_env() or (0, 1, 0)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError("under Slurm, set MASTER_ADDR and MASTER_PORT "
                         "(e.g. the first node's name and 29500)")
    dist.init_process_group(plan.backend, rank=rank, world_size=world_size, timeout=_PG_TIMEOUT)
    # We created it, so we tear it down: a gloo group still alive at interpreter exit
    # aborts the process ("terminate called without an active exception").
    atexit.register(_destroy_external_group)


def _destroy_external_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _external_device(plan: _Plan) -> torch.device:
    _, _, local_rank = _external_env() or (0, 1, 0)
    if plan.devices[0] == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _run_external(plan: _Plan, fn: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Run:
    """Run on this process's rank, then share every rank's result and trace with all."""
    rank, world_size, _ = _external_env() or (0, 1, 0)
    if plan.devices[0] == "cpu":
        torch.set_num_threads(plan.threads)
    tracer = Tracer(rank)
    ctx = RankContext(rank, world_size, _external_device(plan), dist.group.WORLD, tracer,
                      dist.get_backend())
    t0 = time.perf_counter()
    value = fn(ctx, *args, **kwargs)
    rank_s = time.perf_counter() - t0
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (_to_cpu(value), tracer.data(), rank_s))
    wall = time.perf_counter() - t0
    return Run([g[0] for g in gathered], Trace.merge(world_size, [g[1] for g in gathered]), wall,
               world_size, dist.get_backend(), 0.0, [g[2] for g in gathered])

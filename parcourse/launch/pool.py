"""`Pool(world_size)`: N rank processes kept alive, with their process group, across
many runs; `launch(fn, world_size)`: one run on a pool made for it.

- Processes come from a forkserver with torch and parcourse preloaded (spawn where
  forkserver is missing), never from fork (processes.py).
- The function travels by value (cloudpickle), so a function written in a notebook
  cell runs on the ranks.
- The caller owns the rendezvous: a TCPStore on 127.0.0.1 whose port the OS picks, so
  two launches at once never collide.
- One wait loop (`_wait`) serves the start and every run: it watches each rank's pipe
  and process, reports progress, and hands each answer (a typed message, or None for
  a rank that died) to the caller's handler.
- After any failure every process of the run is killed, and the next run starts fresh
  ranks.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as wait_for
from pathlib import Path
from typing import Any, Literal

import cloudpickle
import torch.distributed as dist

from parcourse.launch import registry
from parcourse.launch.errors import (
    LaunchError,
    RankDied,
    RankError,
    RankTimeout,
    SerializationError,
)
from parcourse.launch.external import external_env, init_external, run_external
from parcourse.launch.messages import Answer, Done, Failed, Ready, Stop, Task, Unpicklable
from parcourse.launch.plan import Backend, Device, Plan, Run, make_plan
from parcourse.launch.processes import (
    RankProcess,
    kill_all,
    main_not_reimported,
    stack_folder,
    start_context,
)
from parcourse.launch.progress import LiveStatus, Progress
from parcourse.launch.worker import PG_TIMEOUT, STATUS_BYTES, rank_main
from parcourse.profiler import Profile, check_profile
from parcourse.trace import Trace, TraceData

__all__ = ["DEFAULT_TIMEOUT_S", "Backend", "Device", "Pool", "launch"]


DEFAULT_TIMEOUT_S = 60.0


def default_timeout() -> float:
    """What `timeout="default"` means: 60 s, or PARCOURSE_TIMEOUT seconds where that is
    set (a machine known to be slow or loaded: the test suite beside other work sets
    300, so that the limit guards a hang and not the machine's speed)."""
    given = os.environ.get("PARCOURSE_TIMEOUT", str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(given)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"PARCOURSE_TIMEOUT must be a number of seconds > 0, got {given!r}")
    return seconds


# After one rank fails, how long the others get to report before they are killed.
# Ranks blocked in a collective on the failed rank would otherwise wait forever.
_GRACE_S = 0.5


def _dumps(obj: Any, what: str) -> bytes:
    try:
        return cloudpickle.dumps(obj)
    except Exception as e:  # pickling raises many types: TypeError, PicklingError, ...
        raise SerializationError(f"cannot send {what} to the ranks: {type(e).__name__}: {e}") from e


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
    `timeout`: each run's limit in seconds (None: none); "default" is 60 s, or
    PARCOURSE_TIMEOUT seconds where that is set (`default_timeout`).
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: Backend = "auto",
        device: Device = "auto",
        timeout: float | None | Literal["default"] = "default",
        threads: int | None = None,
        start: bool = True,
    ) -> None:
        self.plan: Plan = make_plan(world_size, backend, device, threads)
        self.world_size = world_size
        self.timeout = default_timeout() if timeout == "default" else timeout
        self._external = external_env()
        if self._external is not None and self._external[1] != world_size:
            raise ValueError(
                f"this process was started by a launcher with WORLD_SIZE={self._external[1]}, "
                f"but {world_size} ranks were asked for"
            )
        self._ranks: list[RankProcess] = []
        self._store: Any = None
        self._generation = 0
        self._lock = threading.Lock()
        self.startups = 0
        self.starting = False  # True while ranks start: their statuses say how far they are
        self.counts = True  # against limit_pools(); not the pools launch() makes for one run
        self.last_used = time.monotonic()
        self._finalizer = weakref.finalize(self, kill_all, self._ranks)
        if start:
            self._start()

    # -- lifecycle

    @property
    def pids(self) -> list[int]:
        return [r.process.pid for r in self._ranks]

    @property
    def external(self) -> bool:
        """Whether a launcher (torchrun, Slurm) started the ranks, this process one of
        them: then `pids` is empty, and `run` runs here."""
        return self._external is not None

    @property
    def holds_ranks(self) -> bool:
        return bool(self._ranks)

    @property
    def alive(self) -> bool:
        return bool(self._ranks) and all(r.process.is_alive() for r in self._ranks)

    def _start(self, on_progress: Progress | None = None) -> float:
        if self._external is not None:
            init_external(self.plan)
            return 0.0
        registry.make_room(self)
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
        registry.register(self)
        ctx = start_context()
        if self._store is None:
            # Port 0: the OS picks a free port, so concurrent launches never collide.
            self._store = dist.TCPStore(
                "127.0.0.1", 0, None, True, timeout=PG_TIMEOUT, wait_for_workers=False
            )
        self._generation += 1
        prefix = f"pool{os.getpid()}-{id(self)}-{self._generation}"
        stack_dir = stack_folder()
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            life_read, life_write = ctx.Pipe(duplex=False)
            status = ctx.RawArray("c", STATUS_BYTES)
            status.value = b"starting its process"
            stack_file = os.path.join(stack_dir, f"rank{rank}.txt")
            process = ctx.Process(
                target=rank_main,
                name=f"parcourse-rank{rank}",
                daemon=True,
                args=(
                    rank,
                    self.plan,
                    self._store.port,
                    prefix,
                    child_conn,
                    life_read,
                    status,
                    stack_file,
                ),
            )
            with main_not_reimported():
                process.start()
            child_conn.close()
            life_read.close()
            self._ranks.append(RankProcess(process, parent_conn, life_write, status, stack_file))

        deadline = max(self.timeout or 0, 120.0)

        def too_long(elapsed: float, pending: set[int]) -> bool:
            if elapsed > deadline:
                raise LaunchError(f"ranks {sorted(pending)} did not join the process group")
            return False

        def joined(r: int, message: Answer | None) -> None:
            if isinstance(message, Failed):
                raise RankError(r, message.exc_type, message.message, message.traceback)
            if message is None:
                raise RankDied(r, self._ranks[r].process.exitcode, "joining the process group", {})
            assert isinstance(message, Ready), message

        self._wait(set(range(self.world_size)), joined, too_long, on_progress, "ready", t0)
        self.startups += 1
        return time.perf_counter() - t0

    def _kill(self) -> None:
        registry.forget(self)
        kill_all(self._ranks)

    def close(self) -> None:
        """Stop every rank (politely, then by force) and free the rendezvous port."""
        if self._external is None:
            for rank in self._ranks:
                try:
                    rank.conn.send(Stop())
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

    # -- waiting: one loop for the start and for every run

    def _answers(self, pending: set[int], poll_s: float) -> Iterator[tuple[int, Answer | None]]:
        """The ranks in `pending` that answered within `poll_s` seconds, each with its
        message, or None for a rank whose process ended without one."""
        watch = {}
        for r in pending:
            watch[self._ranks[r].conn] = r
            watch[self._ranks[r].process.sentinel] = r
        seen: set[int] = set()
        for ready in wait_for(list(watch), timeout=poll_s):
            r = watch[ready]
            if r in seen:  # its pipe and its process both woke us
                continue
            seen.add(r)
            rank = self._ranks[r]
            if ready is rank.conn or rank.conn.poll():
                try:
                    yield r, rank.conn.recv()
                    continue
                except (EOFError, OSError):
                    pass
            rank.process.join(timeout=1)
            yield r, None

    def _wait(
        self,
        pending: set[int],
        answer: Callable[[int, Answer | None], None],
        stop: Callable[[float, set[int]], bool],
        on_progress: Progress | None,
        answered: str,
        t0: float,
    ) -> set[int]:
        """Until every rank in `pending` has answered: `answer(rank, message or None)` for
        each (it may raise), `stop(elapsed, pending)` before each wait (True: stop waiting;
        it may raise), and `on_progress` with each rank's status about ten times a
        second (`answered` for those that have). Returns the ranks still pending."""
        next_progress = t0
        while pending:
            now = time.perf_counter()
            if stop(now - t0, pending):
                break
            if on_progress is not None and now >= next_progress:
                on_progress(
                    [
                        r.status_text() if i in pending else answered
                        for i, r in enumerate(self._ranks)
                    ],
                    now - t0,
                )
                next_progress = now + 0.1
            for r, message in self._answers(pending, 0.05):
                pending.discard(r)
                answer(r, message)
        return pending

    # -- running

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None | Literal["default"] = "default",
        on_progress: Progress | None = None,
        profile: bool | Profile = False,
        **kwargs: Any,
    ) -> Run:
        """Run `fn(ctx, *args, **kwargs)` on every rank and wait for all of them.

        `timeout` (seconds, None for no limit) defaults to the pool's.
        `on_progress(statuses, elapsed_s)` is called about ten times a second
        with what each rank is doing (its current span; "done" when finished),
        and while ranks start (`self.starting`). Without one, a run called from
        a notebook cell that lasts more than a few seconds shows a live status
        line under the cell. `profile` (True, or a `parcourse.profiler.Profile`) runs
        `fn` under torch.profiler on every rank: `Run.profiles` holds what each
        recorded, `Run.to_chrome` writes it beside the course's spans.
        """
        __tracebackhide__ = True  # IPython: show the learner's cell and the error
        options = check_profile(profile)
        if self._external is not None:
            return run_external(self.plan, fn, args, kwargs, options)
        payload = _dumps((fn, args, kwargs), f"the function {getattr(fn, '__name__', fn)!r}")
        return self.run_payload(payload, timeout, on_progress, options)

    def run_payload(
        self,
        payload: bytes,
        timeout: float | None | Literal["default"] = "default",
        on_progress: Progress | None = None,
        profile: Profile | None = None,
    ) -> Run:
        """`run` for a function already pickled (`cloudpickle.dumps((fn, args, kwargs))`)."""
        __tracebackhide__ = True  # IPython: show the learner's cell and the error
        check_profile(False if profile is None else profile)
        limit = self.timeout if timeout == "default" else timeout
        live = LiveStatus.in_notebook(self) if on_progress is None else None
        try:
            with self._lock:
                self.last_used = time.monotonic()
                registry.touch(self)
                startup = 0.0
                try:
                    if not self.alive:
                        self._kill()
                        startup = self._start(on_progress or live)
                    task = Task(payload, profile)
                    return self._dispatch(task, limit, on_progress or live, startup)
                except BaseException:
                    self._kill()  # KeyboardInterrupt too: the next run starts fresh ranks
                    raise
                finally:
                    self.last_used = time.monotonic()
        finally:
            if live is not None:
                live.close()

    def _dispatch(
        self, task: Task, limit: float | None, on_progress: Progress | None, startup: float
    ) -> Run:
        __tracebackhide__ = True  # IPython: show the learner's cell and the error
        t0 = time.perf_counter()
        for rank in self._ranks:
            rank.conn.send(task)
        n = self.world_size
        done: dict[int, Done] = {}
        failures: dict[int, Failed | Unpicklable] = {}
        died: dict[int, tuple[int | None, str]] = {}
        first_failure: list[float] = []

        def give_up(elapsed: float, pending: set[int]) -> bool:
            if first_failure and time.perf_counter() - first_failure[0] > _GRACE_S:
                return True
            if limit is not None and elapsed > limit:
                raise self._timeout(limit, pending)
            return False

        def collect(r: int, message: Answer | None) -> None:
            if isinstance(message, Done):
                done[r] = message
                return
            if message is None:
                died[r] = (self._ranks[r].process.exitcode, self._ranks[r].status_text())
            else:
                assert isinstance(message, (Failed, Unpicklable)), message
                failures[r] = message
            if not first_failure:
                first_failure.append(time.perf_counter())

        pending = self._wait(set(range(n)), collect, give_up, on_progress, "done", t0)
        if failures or died:
            raise self._failure(failures, died, pending)
        values = []
        for r in range(n):
            try:
                values.append(cloudpickle.loads(done[r].result))
            except Exception as e:
                raise SerializationError(f"rank {r}'s result cannot be unpickled here: {e}") from e
        parts: list[TraceData] = [done[r].trace for r in range(n)]
        wall = time.perf_counter() - t0 + startup
        profiles = [done[r].profile for r in range(n)]
        return Run(
            values,
            Trace.merge(n, parts),
            wall,
            n,
            self.plan.backend,
            startup,
            [done[r].seconds for r in range(n)],
            [p for p in profiles if p is not None] if task.profile is not None else None,
        )

    def _timeout(self, limit: float, pending: set[int]) -> RankTimeout:
        running = {r: self._ranks[r].status_text() for r in sorted(pending)}
        signalled = []
        for r in sorted(pending):
            try:
                os.kill(self._ranks[r].process.pid, signal.SIGUSR1)
                signalled.append(r)
            except ProcessLookupError:
                pass
        stacks = self._stacks(signalled)
        self._kill()
        return RankTimeout(limit, running, stacks)

    def _stacks(self, ranks: list[int], within_s: float = 3.0) -> dict[int, str]:
        """The stacks `ranks` write on SIGUSR1 (faulthandler, from a signal handler: as
        soon as each process is scheduled, later on a busy machine), each read once its
        file has held its size over three reads 0.1 s apart, waiting at most `within_s`
        for them all; a rank that wrote nothing (or has ended) is left out."""
        files = {r: Path(self._ranks[r].stack_file) for r in ranks}

        def sizes() -> dict[int, int]:
            return {
                r: f.stat().st_size if f.exists() else 0
                for r, f in files.items()
                if self._ranks[r].process.exitcode is None
            }

        deadline, seen = time.monotonic() + within_s, []
        while time.monotonic() < deadline:
            time.sleep(0.1)
            seen.append(sizes())
            if len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3] and all(seen[-1].values()):
                break
        stacks = {}
        for r, f in files.items():
            text = f.read_text(errors="replace") if f.exists() else ""
            if text.strip():
                stacks[r] = text
        return stacks

    def _failure(
        self,
        failures: dict[int, Failed | Unpicklable],
        died: dict[int, tuple[int | None, str]],
        pending: set[int],
    ) -> LaunchError:
        others = {r: f"stopped while {self._ranks[r].status_text()}" for r in sorted(pending)}
        self._kill()
        if died:
            r = min(died)
            for q, m in failures.items():
                others[q] = m.summary
            others.update({q: f"exit code {c[0]}" for q, c in died.items() if q != r})
            return RankDied(r, died[r][0], died[r][1], dict(sorted(others.items())))
        unpicklable = [m for m in failures.values() if isinstance(m, Unpicklable)]
        if unpicklable:  # the lowest rank: the same message whichever rank answered first
            return SerializationError(min(unpicklable, key=lambda m: m.rank).message)
        # The earliest error on the shared clock is the cause; later ones are usually
        # other ranks noticing that a peer has gone.
        errors = [m for m in failures.values() if isinstance(m, Failed)]
        first = min(errors, key=lambda m: m.at_ns)
        for q, m in failures.items():
            if q != first.rank:
                others[q] = m.summary
        return RankError(
            first.rank, first.exc_type, first.message, first.traceback, dict(sorted(others.items()))
        )


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: Backend = "auto",
    device: Device = "auto",
    timeout: float | None | Literal["default"] = "default",
    threads: int | None = None,
    profile: bool | Profile = False,
    **kwargs: Any,
) -> Run:
    """Start `world_size` ranks, run `fn(ctx, *args, **kwargs)` on each, stop them.

    `profile` (True, or a `parcourse.profiler.Profile`) runs `fn` under torch.profiler
    on every rank, as `Pool.run` does. Raises ValueError for bad arguments and
    SerializationError for a function that cannot be sent, before any process starts;
    RankError, RankDied or RankTimeout when the run fails. `Run.wall_s` includes
    starting the ranks.
    """
    __tracebackhide__ = True  # IPython: show the learner's cell and the error
    make_plan(world_size, backend, device, threads)
    options = check_profile(profile)
    if external_env() is not None:
        pool = Pool(world_size, backend=backend, device=device, timeout=timeout, threads=threads)
        return pool.run(fn, *args, profile=options or False, **kwargs)
    payload = _dumps((fn, args, kwargs), f"the function {getattr(fn, '__name__', fn)!r}")
    with Pool(
        world_size, backend=backend, device=device, timeout=timeout, threads=threads, start=False
    ) as pool:
        pool.counts = False
        return pool.run_payload(payload, profile=options)  # starts the ranks, then runs

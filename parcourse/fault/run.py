"""Start the replicas, keep the coordinator going, replace a replica that dies.

    run = run_replicas(train_replica, 4, make, batch, 20, kill=[(1, 5)], replace=True)

Each replica is a process of its own (from the launcher's forkserver, one thread each)
that reaches the coordinator's `TCPStore` in this process. A replica that dies is not an
error here: the others go on without it, and with `replace=True` a new process takes its
place (its "incarnation" 1) and heals from a live peer. A replica that raises is: every
process is killed and the error names the replica, as `launch` names a rank."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch.distributed as dist

from parcourse.fault.quorum import Lighthouse, Quorum
from parcourse.launch.errors import LaunchError, RankError
from parcourse.launch.processes import main_not_reimported, start_context

_STORE_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass
class ReplicaContext:
    """What a replica function gets: its id, which process of it this is (0, then 1 for
    a replacement), the coordinator's store, and the faults to act out: the steps at
    which to die, and "heal" to die while sending the state to a new replica."""

    replica: int
    replicas: int
    incarnation: int
    store: dist.TCPStore
    host: str
    kill_at: tuple[int | str, ...] = ()

    def maybe_die(self, step: int | str) -> None:
        """SIGKILL this process at a step in `kill_at`, or at "heal" when it is about to
        send its state (as the OOM killer or a lost node would: no goodbye)."""
        if step in self.kill_at:
            self.store.set(f"killed/{self.replica}/{self.incarnation}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class Event:
    """A replica's process started or ended, at `at` (time.time())."""

    kind: str  # "started", "died", "finished"
    replica: int
    incarnation: int
    at: float
    pid: int
    exitcode: int | None = None


@dataclass
class FaultRun:
    """What came back: each replica's result (its last process's), every quorum the
    coordinator formed, and when processes started, died and finished."""

    results: dict[int, Any]
    rounds: list[Quorum]
    events: list[Event] = field(default_factory=list)
    killed_at: dict[int, float] = field(default_factory=dict)  # replica -> time.time()

    def deaths(self) -> list[Event]:
        return [e for e in self.events if e.kind == "died"]


def _replica_main(conn: Any, payload: bytes, replica: int, incarnation: int, port: int) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        fn, args, kwargs, host, replicas, kill_at = cloudpickle.loads(payload)
        store = dist.TCPStore(host, port, is_master=False, timeout=_STORE_TIMEOUT)
        ctx = ReplicaContext(replica, replicas, incarnation, store, host, kill_at)
        conn.send_bytes(cloudpickle.dumps(("ok", fn(ctx, *args, **kwargs))))
    except BaseException as e:  # noqa: BLE001 - sent to the caller, who raises it
        conn.send_bytes(
            cloudpickle.dumps(("error", (type(e).__name__, str(e), traceback.format_exc())))
        )


@dataclass
class _Process:
    replica: int
    incarnation: int
    process: Any
    conn: Any
    result: tuple[str, Any] | None = None


def run_replicas(
    fn: Callable[..., Any],
    replicas: int,
    *args: Any,
    kill: Sequence[tuple[int, int | str]] = (),
    replace: bool = False,
    replace_after: float = 0.0,
    min_replicas: int = 1,
    timeout: float = 300.0,
    quorum_timeout: float = 30.0,
    host: str = "127.0.0.1",
    **kwargs: Any,
) -> FaultRun:
    """`fn(ctx, *args, **kwargs)` on `replicas` processes under one coordinator.
    `kill=[(replica, step), ...]`: that replica's first process kills itself at that
    step (or at "heal": while it sends its state to a new replica); `replace`: a replica
    that dies is started again `replace_after` seconds later; `min_replicas`: a quorum
    waits until it has that many (torchft's min_replica_size)."""
    _check_faults(kill, replicas, min_replicas)
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT)
    store.set("round", "0")
    procs: dict[int, _Process] = {}
    events: list[Event] = []
    mp = start_context()

    def start(replica: int, incarnation: int) -> None:
        kill_at = tuple(s for r, s in kill if r == replica) if incarnation == 0 else ()
        payload = cloudpickle.dumps((fn, args, kwargs, host, replicas, kill_at))
        mine, theirs = mp.Pipe(duplex=False)
        with main_not_reimported():
            p = mp.Process(
                target=_replica_main,
                args=(theirs, payload, replica, incarnation, store.port),
                daemon=True,
            )
            p.start()
        theirs.close()
        procs[replica] = _Process(replica, incarnation, p, mine)
        events.append(Event("started", replica, incarnation, time.time(), p.pid or 0))

    lighthouse = Lighthouse(
        store,
        alive=lambda r: r in procs and procs[r].process.is_alive(),
        kill=lambda r: procs[r].process.kill(),
        replicas=replicas,
        timeout=quorum_timeout,
        min_replicas=min_replicas,
    )
    for r in range(replicas):
        start(r, 0)
    thread = threading.Thread(target=lighthouse.run, daemon=True, name="parcourse-lighthouse")
    thread.start()
    try:
        _supervise(procs, events, start, lighthouse, thread, replace, replace_after, timeout)
    finally:
        lighthouse.stop.set()
        for p in procs.values():
            if p.process.is_alive():
                p.process.kill()
            p.process.join(timeout=5)
            p.conn.close()
        thread.join(timeout=5)
    if lighthouse.error is not None:
        raise lighthouse.error
    results = {r: p.result[1] for r, p in procs.items() if p.result and p.result[0] == "ok"}
    killed_at = {
        e.replica: float(store.get(key))
        for e in events
        if e.kind == "died" and store.check([key := f"killed/{e.replica}/{e.incarnation}"])
    }
    return FaultRun(results, lighthouse.rounds, events, killed_at)


def _supervise(
    procs: dict[int, _Process],
    events: list[Event],
    start: Callable[[int, int], None],
    lighthouse: Lighthouse,
    thread: threading.Thread,
    replace: bool,
    replace_after: float,
    timeout: float,
) -> None:
    """Watch the processes until the coordinator ends: take each result, note each
    death, start a replacement, raise at a replica's error or the timeout."""
    began = time.monotonic()
    due: dict[int, float] = {}  # replica -> when its replacement starts
    while True:
        running = thread.is_alive() or any(p.process.is_alive() for p in procs.values())
        for p in list(procs.values()):
            ended = None if p.result is not None else _collect(p, events)
            if ended == "died" and replace and p.incarnation == 0:
                due[p.replica] = time.monotonic() + replace_after
        if not running:
            return
        for replica, when in list(due.items()):
            if time.monotonic() >= when:
                del due[replica]
                start(replica, procs[replica].incarnation + 1)
        if time.monotonic() - began > timeout:
            raise LaunchError(f"fault-tolerant run still going after {timeout:g} s")
        time.sleep(0.005)


def _collect(p: _Process, events: list[Event]) -> str | None:
    """The process's answer, or its death, once there is one ("finished", "died")."""
    dead = not p.process.is_alive()  # before the poll: an answer sent before exiting is read
    answer = _receive(p.conn) if p.conn.poll() else None
    if answer is not None:
        p.result = answer
        if answer[0] == "error":
            name, message, tb = answer[1]
            raise RankError(p.replica, name, message, tb)
        events.append(Event("finished", p.replica, p.incarnation, time.time(), p.process.pid))
        return "finished"
    if not dead:
        return None
    p.process.join()
    events.append(
        Event("died", p.replica, p.incarnation, time.time(), p.process.pid, p.process.exitcode)
    )
    p.result = ("died", None)
    return "died"


def _check_faults(kill: Sequence[tuple[int, int | str]], replicas: int, min_replicas: int) -> None:
    """Bad faults are refused here, before any process starts."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    if not 1 <= min_replicas <= replicas:
        raise ValueError(f"min_replicas={min_replicas}: it must be between 1 and {replicas}")
    for fault in kill:
        replica, step = fault
        if not 0 <= replica < replicas:
            raise ValueError(f"kill {fault}: the replica must be below {replicas}")
        if not (step == "heal" or isinstance(step, int) and step >= 0):
            raise ValueError(f'kill {fault}: the step must be a step >= 0 or "heal"')


def _receive(conn: Any) -> tuple[str, Any] | None:
    """A replica's answer, or None when its end of the pipe closed without one (it died)."""
    try:
        answer: tuple[str, Any] = cloudpickle.loads(conn.recv_bytes())
    except EOFError:
        return None
    return answer

"""The rank side: what each rank process runs.

A rank joins the process group once, then runs one `Task` after another until it is
told to `Stop` (or its parent goes away), answering each with a typed message
(`parcourse.launch.messages`). It ignores SIGINT (a kernel interrupt signals the whole
process group), uses `plan.threads` threads on CPU (two ranks with two threads each on
two cores run several times slower than with one), and writes its Python stack to a
file on SIGUSR1, which the caller sends at a timeout to say where the rank was stuck.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import threading
import time
import traceback
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from parcourse.launch.messages import Done, Failed, Ready, Stop, Task, Unpicklable
from parcourse.launch.plan import Plan, RankContext
from parcourse.profiler import Profile, RankProfile, Recorder
from parcourse.trace import TraceData, Tracer

# Generous: the caller's timeout, not the backend's, decides when a run has hung.
PG_TIMEOUT = datetime.timedelta(minutes=30)
STATUS_BYTES = 160  # a rank's status line, in shared memory the caller reads


def to_cpu(value: Any) -> Any:
    """Results come home on the CPU, so the caller never has to initialise CUDA."""
    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, value)


def run_task(ctx: RankContext, task: Task) -> Done | Failed | Unpicklable:
    """Execute one task on this rank; always returns a message, never raises."""
    t0 = time.perf_counter()
    profile = None
    try:
        fn, args, kwargs = cloudpickle.loads(task.payload)
        ctx.tracer.set_status(
            f"running {getattr(fn, '__name__', 'the function')}, before its first span"
        )
        if task.profile is None:
            value = fn(ctx, *args, **kwargs)
        else:
            value, profile = profiled(ctx, task.profile, fn, args, kwargs)
    except BaseException as e:  # noqa: BLE001 - a SystemExit in rank code is an error too
        return Failed(
            ctx.rank,
            time.perf_counter_ns(),
            type(e).__name__,
            str(e),
            traceback.format_exc(),
            ctx.tracer.data(),
        )
    try:
        blob = cloudpickle.dumps(to_cpu(value))
    except Exception as e:
        return Unpicklable(
            ctx.rank,
            f"rank {ctx.rank} returned a {type(value).__name__} that cannot be pickled: {e}",
        )
    return Done(ctx.rank, blob, ctx.tracer.data(), time.perf_counter() - t0, profile)


def profiled(
    ctx: RankContext, options: Profile, fn: Any, args: Any, kwargs: Any
) -> tuple[Any, RankProfile]:
    """`fn(ctx, *args, **kwargs)` under torch.profiler: its value and the rank's profile."""
    recorder = Recorder(options, ctx.rank, ctx.device)
    with recorder:
        value = fn(ctx, *args, **kwargs)
    ctx.tracer.set_status("reading the profile")
    return value, recorder.result(ctx.tracer.data().spans)


def _exit_when_parent_dies(lifeline: Any, stack_file: str) -> None:
    """The parent holds the other end; EOF means it is gone, so this rank goes too
    (tidying up what the parent no longer can)."""
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    with contextlib.suppress(OSError):
        os.remove(stack_file)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(stack_file))  # the last rank out removes the folder
    os._exit(1)


def rank_main(
    rank: int,
    plan: Plan,
    port: int,
    prefix: str,
    conn: Any,
    lifeline: Any,
    status: Any,
    stack_file: str,
) -> None:
    """A rank process's whole life: join the process group, run tasks, leave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_exit_when_parent_dies, args=(lifeline, stack_file), daemon=True
    ).start()
    # On SIGUSR1 (sent at a timeout) write this rank's Python stack for the error message.
    faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=False)  # noqa: SIM115
    torch.set_num_threads(plan.threads)
    device = torch.device(plan.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    status.value = b"joining the process group"
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=PG_TIMEOUT)
        dist.init_process_group(
            plan.group_backend,
            store=dist.PrefixStore(prefix, store),
            rank=rank,
            world_size=plan.world_size,
            timeout=PG_TIMEOUT,
        )
    except BaseException as e:  # noqa: BLE001
        conn.send(
            Failed(
                rank,
                time.perf_counter_ns(),
                type(e).__name__,
                str(e),
                traceback.format_exc(),
                TraceData(rank),
            )
        )
        return
    group = dist.group.WORLD
    assert group is not None  # set by init_process_group above
    conn.send(Ready(rank))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if isinstance(message, Stop):
            break
        tracer = Tracer(rank, status=status)
        # Unpickling imports the modules the function needs (not preloaded: seconds, once).
        status.value = b"loading the function and importing its modules"
        ctx = RankContext(rank, plan.world_size, device, group, tracer, plan.backend)
        conn.send(run_task(ctx, message))
        status.value = b"idle"
    dist.destroy_process_group()

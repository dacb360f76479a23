"""Rank functions used by the tests, importable by name in the rank processes."""

import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist


def rank_and_sum(ctx, offset=0):
    t = torch.tensor([float(ctx.rank)])
    with ctx.tracer.span("all_reduce", kind="comm"):
        dist.all_reduce(t, group=ctx.group)
    from parcourse.comm import backend_for

    return {
        "rank": ctx.rank,
        "world": ctx.world_size,
        "sum": t.item() + offset,
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "device": str(ctx.device),
        "backend": ctx.backend,
        "moves": {d: backend_for(ctx.group, d) for d in ("cpu", "cuda")},
    }


def _note_pid(pid_dir):
    if pid_dir is not None:
        Path(pid_dir, f"{os.getpid()}").write_text("")


def fail_on(ctx, bad_rank, pid_dir=None):
    _note_pid(pid_dir)
    if ctx.rank == bad_rank:
        raise ValueError(f"bad value on rank {ctx.rank}")
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.group)  # blocks: the bad rank never joins
    return t.item()


def fail_on_rank(ctx, bad_rank, **_controls):
    """fail_on, for a panel with more controls than the rank uses."""
    return fail_on(ctx, bad_rank)


def deadlock(ctx, pid_dir=None):
    _note_pid(pid_dir)
    t = torch.zeros(1)
    with ctx.tracer.span(f"recv from {(ctx.rank + 1) % ctx.world_size}", kind="comm"):
        dist.recv(t, src=(ctx.rank + 1) % ctx.world_size, group=ctx.group)  # nobody sends
    return t.item()


def die(ctx, how, pid_dir=None):
    _note_pid(pid_dir)
    if ctx.rank == 1:
        with ctx.tracer.span("about to die"):
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
    dist.barrier(group=ctx.group)
    return ctx.rank


def ignore_sigint(ctx):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    return ctx.rank


def sleep_then_barrier(ctx, seconds):
    dist.barrier(group=ctx.group)  # a common start
    with ctx.tracer.span("before", kind="compute"):
        time.sleep(seconds * (ctx.rank + 1))
    with ctx.tracer.span("barrier", kind="comm"):
        dist.barrier(group=ctx.group)
    with ctx.tracer.span("after", kind="compute"):
        time.sleep(0.001)
    return ctx.rank


def unpicklable_result(ctx):
    return (x for x in range(3))


def slow(ctx, seconds):
    with ctx.tracer.span("slow step"):
        time.sleep(seconds)
    return ctx.rank


def settled_threads(ctx):
    """This rank's threads (their ids, from /proc) once the set has held for 0.2 s, read
    after collecting garbage: a destroyed gloo group's threads end when it is collected,
    a moment later, so a count read at once may still hold an earlier run's. A run
    leaves none behind when its ranks' sets afterwards are within those before (ids,
    not counts: an old thread ending would hide a new one in a count)."""
    import gc

    seen, deadline = [], time.monotonic() + 10
    while len(seen) < 5 or len(set(seen[-5:])) > 1:
        if time.monotonic() > deadline:
            return frozenset().union(*seen[-5:])
        gc.collect()
        seen.append(frozenset(os.listdir(f"/proc/{os.getpid()}/task")))
        time.sleep(0.05)
    return seen[-1]

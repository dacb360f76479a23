"""Under an external launcher (torchrun, or a multi-task Slurm step) this process is one
rank already: the same rank function runs here, on the environment's process group,
and every rank gets every rank's result."""

from __future__ import annotations

import atexit
import os
import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from parcourse.comm.common import backend_for
from parcourse.launch.plan import Plan, RankContext, Run
from parcourse.launch.worker import PG_TIMEOUT, profiled, to_cpu
from parcourse.profiler import Profile
from parcourse.trace import Trace, Tracer


def external_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when a launcher started this process, else None."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    # A one-task Slurm job (e.g. Jupyter on a compute node) still launches its own ranks.
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return None


def init_external(plan: Plan) -> None:
    """Join the environment's process group, once."""
    if dist.is_initialized():
        return
    rank, world_size, _ = external_env() or (0, 1, 0)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise ValueError(
            "under Slurm, set MASTER_ADDR and MASTER_PORT (e.g. the first node's name and 29500)"
        )
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun shares its rendezvous store with the workers, and after a restart
        # (--max-restarts) the new workers would read the dead ones' addresses from it:
        # gloo's "connectFullMesh failed ... Connection refused" (pytorch/pytorch#135712).
        # Each attempt gets keys of its own.
        _check_reachable(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            is_master=False,
            timeout=PG_TIMEOUT,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            plan.group_backend,
            store=dist.PrefixStore(f"/parcourse/attempt_{attempt}", store),
            rank=rank,
            world_size=world_size,
            timeout=PG_TIMEOUT,
        )
    else:
        dist.init_process_group(
            plan.group_backend, rank=rank, world_size=world_size, timeout=PG_TIMEOUT
        )
    # We created it, so we tear it down: a gloo group still alive at interpreter exit
    # aborts the process ("terminate called without an active exception").
    atexit.register(_destroy_group)


def _check_reachable(host: str, port: int, seconds: float = 10.0) -> None:
    """torchrun's agent store is up before its workers start: if this worker cannot reach
    it, say why now rather than wait out the store's timeout. Across nodes it is most
    often the rendezvous host's name, which resolves where it is but not here."""
    import socket

    deadline, why = time.monotonic() + seconds, ""
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError as e:
            why = f"{type(e).__name__}: {e}"
            time.sleep(0.2)
    try:
        where = socket.gethostbyname(host)
    except OSError:
        where = "nothing"
    raise RuntimeError(
        f"this rank cannot reach torchrun's store at MASTER_ADDR {host} (resolves to "
        f"{where}), port {port}: {why}. On several nodes give each agent --local-addr "
        "<its own address>, reachable from the others (docs/multi_node.md)"
    )


def _destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _device(plan: Plan) -> torch.device:
    _, _, local_rank = external_env() or (0, 1, 0)
    if plan.devices[0] == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


class PeerLost(RuntimeError):
    """A rank's peer went away mid-collective: its process, its host or the link to it."""


# gloo's words for a peer gone: "Connection reset by peer", "Connection closed by peer
# [10.0.0.2]:41234", "Read error [10.0.0.2]:41234: Connection reset by peer"
_GONE = re.compile(r"(?:Connection (?:reset|closed) by peer|Read error|Write error)")
_PEER = re.compile(r"\[([^\]]+)\]:\d+")


def peer_lost(rank: int, error: str) -> str | None:
    """The sentence a learner reads when `error` says a peer went away (None: it does
    not): the peer's address, and what an elastic job does next."""
    gone = _GONE.search(error)
    if gone is None:
        return None
    said = error[gone.start() :].split(". ")[0]
    peer = _PEER.search(said)
    where = f"its peer at {peer.group(1)}" if peer else "a peer"
    return (
        f"rank {rank} lost {where} mid-collective (gloo: {said}): "
        "that rank's process, its host or the link to it is gone. An elastic job "
        "(torchrun --nnodes 1:2 --max-restarts 1) starts the ranks left again, and "
        "`train` resumes from its newest checkpoint"
    )


def run_external(
    plan: Plan,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    profile: Profile | None = None,
) -> Run:
    """Run on this process's rank (under torch.profiler with `profile`), then share every
    rank's result, trace and profile with all."""
    rank, world_size, _ = external_env() or (0, 1, 0)
    if plan.devices[0] == "cpu":
        torch.set_num_threads(plan.threads)
    tracer = Tracer(rank)
    device = _device(plan)
    group = dist.group.WORLD
    assert group is not None, "init_external joins the process group first"
    backend = backend_for(group, device)  # the group may be the user's own
    ctx = RankContext(rank, world_size, device, group, tracer, backend)
    t0 = time.perf_counter()
    try:
        if profile is None:
            value, recorded = fn(ctx, *args, **kwargs), None
        else:
            value, recorded = profiled(ctx, profile, fn, args, kwargs)
    except RuntimeError as e:
        if lost := peer_lost(rank, str(e)):
            raise PeerLost(lost) from e
        raise
    rank_s = time.perf_counter() - t0
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (to_cpu(value), tracer.data(), rank_s, recorded))
    wall = time.perf_counter() - t0
    return Run(
        [g[0] for g in gathered],
        Trace.merge(world_size, [g[1] for g in gathered]),
        wall,
        world_size,
        backend,
        0.0,
        [g[2] for g in gathered],
        None if profile is None else [g[3] for g in gathered],
    )

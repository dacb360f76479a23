"""Where each rank runs, decided and checked before any process starts; what a rank
function gets (`RankContext`) and what a run gives back (`Run`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from parcourse.profiler import RankProfile
from parcourse.trace import Trace, Tracer

Backend = Literal["auto", "gloo", "nccl"]
Device = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True)
class Plan:
    """Where each rank runs; decided (and checked) before any process starts."""

    world_size: int
    backend: str
    devices: tuple[str, ...]
    threads: int

    @property
    def group_backend(self) -> str:
        """What the process group is made with. An NCCL run keeps gloo beside NCCL for CPU
        tensors ("cpu:gloo,cuda:nccl", torch's form): NCCL alone refuses them ("No backend
        type associated with device type cpu", seen on one GPU at world size 1), and much of
        the course keeps a model, a loss or a count on the CPU."""
        return "cpu:gloo,cuda:nccl" if self.backend == "nccl" else self.backend


def make_plan(world_size: int, backend: str, device: str, threads: int | None) -> Plan:
    """The backend and a device for each rank: gloo on CPU; NCCL when each rank has its own
    GPU; with fewer GPUs than ranks, ranks share them and talk through gloo."""
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
        return Plan(world_size, "gloo", ("cpu",) * world_size, threads or 1)
    if n_gpu == 0:
        raise ValueError("device='cuda' but torch sees no GPU; use device='cpu'")
    if backend == "nccl" and n_gpu < world_size:
        raise ValueError(
            f"nccl needs one GPU per rank: {world_size} ranks, {n_gpu} GPU(s); "
            "use backend='gloo' (or 'auto') to let ranks share a GPU"
        )
    chosen = "nccl" if backend == "nccl" or (backend == "auto" and n_gpu >= world_size) else "gloo"
    devices = tuple(f"cuda:{r % n_gpu}" for r in range(world_size))
    return Plan(world_size, chosen, devices, threads or 1)


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
    """The outcome of one run: per-rank results, the merged trace, timings, and each
    rank's torch.profiler profile when the run was profiled (`profile=`), else None."""

    results: list[Any]
    trace: Trace
    wall_s: float
    world_size: int
    backend: str
    startup_s: float = 0.0
    rank_s: list[float] = field(default_factory=list)
    profiles: list[RankProfile] | None = None

    def to_chrome(self, path: str | Path) -> Path:
        """One Chrome trace-event file for https://ui.perfetto.dev: the course's spans and,
        for a profiled run, torch's operators of every rank, on one clock."""
        return self.trace.to_chrome(path, self.profiles)

    def __repr__(self) -> str:
        return (
            f"Run(world_size={self.world_size}, backend={self.backend!r}, "
            f"wall_s={self.wall_s:.3f}, results={self.results!r})"
        )

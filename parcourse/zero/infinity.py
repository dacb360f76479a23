"""ZeRO-Infinity: the optimizer's state on disk (Rajbhandari et al. 2021, arXiv:2104.07857).

ZeRO-Offload (offload.py) moves the fp32 masters and the optimizer's state to host
memory. Infinity goes one level further down for the largest part of it, the
optimizer's state (Adam's two moments: 8 bytes a parameter): it lives in files, and the
step streams it through a small host buffer, unit by unit (the paper's sub-groups):

    read unit k+1's state  |  step unit k  |  write unit k-1's state

Reads and writes run on threads of their own while the update of the unit before runs,
so at most three units' state is in host memory at once, whatever the model's size.
Bytes read and written, and the seconds spent reading and writing, are counted
(`disk_stats`), so a step's time can be laid beside its disk traffic.

Nothing is lost if a process dies mid-step: each step writes its units into a new
directory, and only when every unit is written does an atomic rename of a one-line
pointer file (`CURRENT`) make it the current state; the old directory goes after. A
process killed before that leaves the previous step's state whole (`read_state`).

The masters stay in host memory here (Infinity can also put them on disk; this course
keeps them in RAM so that the next forward's gather needs no read).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from parcourse.zero.sharded_optimizer import ShardedOptimizer

if TYPE_CHECKING:
    from parcourse.zero.stage1 import ZeroStage1

POINTER = "CURRENT"
UnitState = dict[int, dict[str, Any]]  # a parameter's place in its unit -> its state


def rank_dir(path: str | Path, rank: int) -> Path:
    return Path(path) / f"rank{rank}"


def current_version(directory: Path) -> int | None:
    pointer = directory / POINTER
    return int(pointer.read_text()) if pointer.exists() else None


def read_state(path: str | Path, rank: int) -> dict[int, UnitState]:
    """The last committed step's optimizer state of global rank `rank`, unit by unit."""
    directory = rank_dir(path, rank)
    version = current_version(directory)
    if version is None:
        return {}
    return {
        int(f.stem[4:]): torch.load(f, weights_only=True)
        for f in sorted((directory / f"v{version}").glob("unit*.pt"))
    }


class InfinityOptimizer(ShardedOptimizer):
    """`InfinityOptimizer(model, optimizer, path)`: `optimizer` (a torch optimizer over
    `model.parameters()`, the ZeroModel's shards) with its state kept on disk under
    `path`/rank<r>. `zero.shard(..., offload_optimizer="nvme", nvme_path=path)` builds it.

    The model must keep its masters on the host (`offload_optimizer="cpu"`). `path` is a
    swap directory: what an earlier run left there for this rank is replaced. Parameters
    outside the ZeRO units (kept modules) keep their state in memory; they are small.
    Use it as the optimizer: `step()`, `zero_grad()`, `param_groups`, `state_dict()` and
    `load_state_dict()` (these read or write every unit). It is not a
    torch.optim.Optimizer: put an LR scheduler on the torch optimizer inside
    (`opt.optimizer`), whose param groups are these.
    """

    def __init__(
        self, model: ZeroStage1, optimizer: torch.optim.Optimizer, path: str | Path
    ) -> None:
        if model.host is None:
            raise ValueError(
                "InfinityOptimizer streams the optimizer's state between disk "
                "and host memory: build the model with offload_optimizer='cpu'"
            )
        super().__init__(model, lambda _: optimizer)
        self.directory = rank_dir(path, dist.get_rank() if dist.is_initialized() else 0)
        if self.directory.exists():
            shutil.rmtree(self.directory)
        self.directory.mkdir(parents=True)
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.units = [[sp for sp in u.shard_params if id(sp) in stepped] for u in model.units]
        in_units = {id(p) for unit in self.units for p in unit}
        self.others = [
            p for g in optimizer.param_groups for p in g["params"] if id(p) not in in_units
        ]
        self.version = 0
        self._commit(self.version)
        self.stats = {
            "bytes_read": 0,
            "bytes_written": 0,
            "read_s": 0.0,
            "write_s": 0.0,
            "step_s": 0.0,
            "steps": 0,
        }
        self._reader = ThreadPoolExecutor(1, "parcourse-disk-read")
        self._writer = ThreadPoolExecutor(1, "parcourse-disk-write")
        self.on_unit_written: Callable[[int], None] | None = None  # e.g. a progress line

    # -- the step (param_groups, state: the kept parameters' only between steps, and
    #    zero_grad are ShardedOptimizer's)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure() if closure is not None else None
        started = time.perf_counter()
        self.model.finish_gradient_sync()
        grads = {id(p): p.grad for g in self.param_groups for p in g["params"]}
        new = self.directory / f"v{self.version + 1}"
        shutil.rmtree(new, ignore_errors=True)  # what a step that raised left half written
        new.mkdir()
        writes: list[Future[None]] = []
        reads = {0: self._reader.submit(self._read, 0)} if self.units else {}
        try:
            for k, params in enumerate(self.units):
                if k + 1 < len(self.units):  # the next unit's state comes in meanwhile
                    reads[k + 1] = self._reader.submit(self._read, k + 1)
                state = reads.pop(k).result()
                began = time.perf_counter_ns()
                self._step_only(params, grads, state)
                if self.model.tracer is not None:
                    self.model.tracer.add_span(
                        "update", began, time.perf_counter_ns(), kind="compute", unit=k
                    )
                out = {
                    i: self.optimizer.state.pop(p)
                    for i, p in enumerate(params)
                    if p in self.optimizer.state
                }
                writes.append(self._writer.submit(self._write, new / f"unit{k}.pt", out, k))
                while len(writes) > 1:  # the host buffer stays bounded
                    writes.pop(0).result()
            for w in writes:
                w.result()
            if self.others:
                self._step_only(self.others, grads, None)
        finally:
            for p in (p for g in self.param_groups for p in g["params"]):
                p.grad = grads[id(p)]
        self._commit(self.version + 1)
        shutil.rmtree(self.directory / f"v{self.version}", ignore_errors=True)
        self.version += 1
        self.stats["step_s"] += time.perf_counter() - started
        self.stats["steps"] += 1
        return loss

    def _step_only(
        self, params: list[nn.Parameter], grads: dict[int, Any], state: UnitState | None
    ) -> None:
        """One torch step over `params` alone: every other parameter's gradient hidden
        (a torch optimizer skips a parameter without one), their state put in place."""
        mine = {id(p) for p in params}
        for i, p in enumerate(params):
            if state and i in state:
                self.optimizer.state[p] = state[i]
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = grads[id(p)] if id(p) in mine else None
        self.optimizer.step()

    # -- the disk

    def _read(self, k: int) -> UnitState:
        f = self.directory / f"v{self.version}" / f"unit{k}.pt"
        if not f.exists():  # the first step: no state yet
            return {}
        started = time.perf_counter_ns()
        state = torch.load(f, weights_only=True)
        self._span("disk read", started, k, f.stat().st_size)
        return state

    def _write(self, f: Path, state: UnitState, k: int) -> None:
        started = time.perf_counter_ns()
        torch.save(state, f)
        self._span("disk write", started, k, f.stat().st_size)
        if self.on_unit_written is not None:
            self.on_unit_written(k)

    def _span(self, name: str, started: int, unit: int, nbytes: int) -> None:
        """Count a read or a write, and trace it (on the model's tracer, if any)."""
        ended = time.perf_counter_ns()
        way = "read" if name == "disk read" else "written"
        self.stats[f"bytes_{way}"] += nbytes
        self.stats["read_s" if way == "read" else "write_s"] += (ended - started) / 1e9
        tracer = self.model.tracer
        if tracer is not None:
            tracer.add_span(name, started, ended, kind="other", unit=unit, size=nbytes)

    def _commit(self, version: int) -> None:
        """Make `version` the current state: one atomic rename."""
        (self.directory / f"v{version}").mkdir(exist_ok=True)
        tmp = self.directory / f"{POINTER}.tmp"
        tmp.write_text(str(version))
        os.replace(tmp, self.directory / POINTER)

    def disk_bytes(self) -> int:
        """Bytes of optimizer state on disk now (the current step's files)."""
        return sum(f.stat().st_size for f in (self.directory / f"v{self.version}").glob("*.pt"))

    def disk_stats(self) -> dict[str, float]:
        """Bytes read and written, and seconds reading, writing and stepping, so far; and
        the bandwidth they come to (bytes a second spent on the disk)."""
        s = dict(self.stats)
        s["read_GBps"] = s["bytes_read"] / s["read_s"] / 1e9 if s["read_s"] else 0.0
        s["write_GBps"] = s["bytes_written"] / s["write_s"] / 1e9 if s["write_s"] else 0.0
        return s

    # -- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state, read from disk (as ShardedOptimizer's)."""
        for k, state in read_state(self.directory.parent, self._rank()).items():
            for i, s in state.items():
                self.optimizer.state[self.units[k][i]] = s
        try:
            return super().state_dict()
        finally:
            for unit in self.units:
                for p in unit:
                    self.optimizer.state.pop(p, None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `state_dict` (or ShardedOptimizer's) gave, and write it to disk."""
        super().load_state_dict(state)  # into memory: written to disk, unit by unit, here
        new = self.directory / f"v{self.version + 1}"
        new.mkdir(exist_ok=True)
        for k, params in enumerate(self.units):
            out = {
                i: self.optimizer.state.pop(p)
                for i, p in enumerate(params)
                if p in self.optimizer.state
            }
            torch.save(out, new / f"unit{k}.pt")
        self._commit(self.version + 1)
        shutil.rmtree(self.directory / f"v{self.version}", ignore_errors=True)
        self.version += 1

    def _rank(self) -> int:
        return int(self.directory.name[4:])

    def close(self) -> None:
        self._reader.shutdown()
        self._writer.shutdown()

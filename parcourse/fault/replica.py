"""A replica's side of fault-tolerant training: ask for the quorum at each step, build
the group among its members, heal a member that is behind from a live peer, average the
gradients over whoever took part, and apply the step only once the coordinator says every
member's all-reduce went through.

    ft = FaultTolerant(model, optimizer, store, replica)
    while True:
        ft.start_step()                  # the quorum; the last step applied or dropped
        if ft.step >= steps:
            break
        loss_fn(model, batch(ft.step, replica)).backward()
        ft.sync()                        # gradients averaged over the quorum
    ft.finish()

`sync` buckets the gradients as `BucketedDataParallel` does (same buckets, same flags,
same average), so without a fault a run equals that one exactly. A replica is one process
here: a replica group of several ranks (tp, pp or ZeRO inside it) is refused."""

from __future__ import annotations

import datetime
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parcourse.data_parallel.bucketed import make_buckets
from parcourse.fault.quorum import Quorum


class NotInQuorum(RuntimeError):
    """This replica was dropped (it stayed silent past the coordinator's timeout)."""


@dataclass
class Healed:
    """One transfer of the whole state from a live peer."""

    round: int
    source: int
    target: int
    nbytes: int
    seconds: float


@dataclass
class FaultTolerant:
    """`FaultTolerant(model, optimizer, store, replica, bucket_mb=25.0, timeout=10.0)`.

    `step` is the steps committed; `quorums` every quorum this replica took part in;
    `healed` the transfers it sent or received; `failures` the all-reduces that broke
    (the step was then retried). `save_extra()` and `load_extra(value)`, when given,
    carry the caller's own state (a loader's position) with the weights when a replica
    heals."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    store: dist.Store
    replica: int
    bucket_mb: float = 25.0
    timeout: float = 10.0
    host: str = "127.0.0.1"  # the address the group's sockets use
    save_extra: Callable[[], Any] | None = None
    load_extra: Callable[[Any], None] | None = None
    before_send: Callable[[], None] | None = None  # a fault on purpose, in the tests
    step: int = 0
    quorums: list[Quorum] = field(default_factory=list)
    healed: list[Healed] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _refuse_sharded(self.optimizer)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.buckets = make_buckets(params, self.bucket_mb)
        self.pending = False  # gradients averaged, waiting for the coordinator's commit
        self.group: Any = None
        self.group_name: str | None = None
        self.round = int(self.store.get("round"))  # a new replica asks in the round open now
        self.quorum: Quorum | None = None

    def start_step(self) -> Quorum:
        """Ask, wait for this round's quorum, apply or drop the pending step, join the
        members' group and heal; retried while a heal breaks."""
        while True:
            ask = {"steps": self.step, "ok": self.pending}
            self.store.set(f"ask/{self.round}/{self.replica}", json.dumps(ask))
            key = f"quorum/{self.round}"
            self.store.wait([key], datetime.timedelta(seconds=max(60.0, 3 * self.timeout)))
            q = Quorum.from_json(self.store.get(key))
            self.round += 1
            if self.replica not in q.members:
                if self.quorum is not None:  # a member before: dropped as hung
                    raise NotInQuorum(f"replica {self.replica} was dropped at round {q.round}")
                continue  # a new replica that asked late: the next round takes it in
            if q.commit and self.pending:
                self.optimizer.step()
                self.step += 1
            self.pending = False
            self.optimizer.zero_grad(set_to_none=True)
            if q.group != self.group_name:
                self._join(q)
            try:
                self._heal(q)
            except RuntimeError as e:
                self.failures.append(f"round {q.round}, heal: {str(e).splitlines()[0]}")
                self._abandon()
                continue
            self.quorum = q
            self.quorums.append(q)
            return q

    def sync(self) -> bool:
        """Average the gradients over the quorum; False (and the step is retried) when a
        member is lost mid-collective."""
        assert self.quorum is not None, "start_step() first"
        size = len(self.quorum.members)
        try:
            works = [self.group.allreduce([b.pack()]) for b in self.buckets]
            for w in works:
                w.wait()
        except RuntimeError as e:
            self.failures.append(f"round {self.quorum.round}: {str(e).splitlines()[0]}")
            self._abandon()
            self.pending = False
            return False
        for b in self.buckets:
            b.unpack(size)
        self.pending = True
        return True

    def finish(self) -> None:
        """Tell the coordinator this replica is done (after its last `start_step`)."""
        self.store.set(f"done/{self.replica}", str(self.step))

    def _abandon(self) -> None:
        """Close the broken group's sockets at once: a member still waiting in the same
        collective for a live peer then fails now, not at its timeout."""
        if self.group is not None:
            self.group.abort()
        self.group, self.group_name = None, None

    def _join(self, q: Quorum) -> None:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = datetime.timedelta(seconds=self.timeout)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        store = dist.PrefixStore(q.group, self.store)
        self.group = dist.ProcessGroupGloo(
            store, q.members.index(self.replica), len(q.members), options
        )
        self.group_name = q.group

    def _heal(self, q: Quorum) -> None:
        """The whole state from the source to each member behind, peer to peer."""
        for target, source in sorted(q.heal.items()):
            t0 = time.perf_counter()
            if source == self.replica:
                if self.before_send is not None:
                    self.before_send()
                payload = self._state_bytes()
                size = torch.tensor([payload.numel()], dtype=torch.int64)
                self.group.send([size], q.members.index(target), 0).wait()
                self.group.send([payload], q.members.index(target), 1).wait()
            elif target == self.replica:
                size = torch.zeros(1, dtype=torch.int64)
                self.group.recv([size], q.members.index(source), 0).wait()
                payload = torch.empty(int(size), dtype=torch.uint8)
                self.group.recv([payload], q.members.index(source), 1).wait()
                self._load_state(payload)
            else:
                continue
            seconds = time.perf_counter() - t0
            self.healed.append(Healed(q.round, source, target, int(size), seconds))

    def _state_bytes(self) -> torch.Tensor:
        buffer = io.BytesIO()
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "extra": None if self.save_extra is None else self.save_extra(),
        }
        torch.save(state, buffer)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def _load_state(self, payload: torch.Tensor) -> None:
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        if self.load_extra is not None:
            self.load_extra(state["extra"])


def _refuse_sharded(optimizer: Any) -> None:
    """ZeRO across replicas gives each one a shard of the optimizer state: a lost replica
    would take its shard with it, and no live peer holds it to heal from."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from parcourse.zero.optimizer import ZeroOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer | ZeroOptimizer):
        raise ValueError(
            f"fault-tolerant training keeps a whole copy of the state on every replica; "
            f"{type(optimizer).__name__} shards it across them, so a lost replica's shard "
            "could not be healed from a peer: use a plain torch.optim optimizer"
        )

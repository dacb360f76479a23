"""The coordinator of fault-tolerant training: one thread in the caller that forms, each
step, the quorum of the replicas alive, on a `TCPStore` the replicas reach.

A round goes like this (`Lighthouse.run_round`):
1. Every member of the last quorum still alive posts `ask/<round>/<replica>` with the
   steps it has committed and whether its last step's all-reduce went through; a new
   replica posts the same, with no steps, whenever it is ready.
2. The coordinator waits for the members alive (a member that dies is dropped, one that
   stays silent past `timeout` is dropped and killed), takes in the new replicas that
   asked by then, and writes `quorum/<round>`: the members, whether the last step
   commits (every member's all-reduce went through), the step the quorum is at, and who
   heals whom (a member behind receives the weights and optimizer state from one at the
   step, peer to peer).
3. The members build a process group among themselves (a new one only when the members
   change or the last one broke), heal, train a step and come back.

It is a lighthouse in torchft's sense (there in Rust over gRPC, beside a manager per
replica); here it lives in the process that started the replicas, so it knows which are
alive from their processes rather than from heartbeats."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass
class Quorum:
    """One round's decision, as every member reads it."""

    round: int
    members: list[int]  # replica ids, sorted
    commit: bool  # whether the last round's step is applied
    step: int  # the steps committed once it is
    heal: dict[int, int]  # replica behind -> the replica it receives the state from
    group: str  # the name of the process group's store prefix for these members
    at: float = 0.0  # time.time() when it was formed

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def from_json(text: str | bytes) -> Quorum:
        d = json.loads(text)
        d["heal"] = {int(k): v for k, v in d["heal"].items()}
        return Quorum(**d)


@dataclass
class Lighthouse:
    """The coordinator's side. `alive(replica)` says whether a replica's process lives,
    `kill(replica)` ends one that stays silent; `rounds` is every quorum formed, in order
    (what the lesson draws)."""

    store: dist.TCPStore
    alive: Callable[[int], bool]
    kill: Callable[[int], None]
    replicas: int  # the replica ids are 0 .. replicas - 1
    timeout: float = 30.0
    min_replicas: int = 1  # a quorum waits for this many
    rounds: list[Quorum] = field(default_factory=list)
    members: list[int] = field(default_factory=list)
    broken: bool = True  # no group yet
    stop: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def run(self) -> None:
        """Rounds until every replica has finished or died (or `stop` is set)."""
        try:
            r = 0
            while not self.stop.is_set() and not self._all_finished():
                if self.run_round(r) is not None:
                    r += 1
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e

    def _all_finished(self) -> bool:
        return all(
            not self.alive(rid) or self.store.check([f"done/{rid}"]) for rid in range(self.replicas)
        )

    def run_round(self, r: int) -> Quorum | None:
        """Gather round `r`'s asks and write its quorum (None: nobody asked yet)."""
        self.store.set("round", str(r))
        asks = self._gather(r)
        if asks is None:
            return None
        last = [rid for rid in self.members if rid in asks]
        commit = bool(last) and all(asks[rid]["ok"] for rid in last)
        steps = {
            rid: a["steps"] + (1 if commit and rid in last and a["ok"] else 0)
            for rid, a in asks.items()
        }
        top = max(steps.values())
        ahead = [rid for rid in sorted(steps) if steps[rid] == top]
        members = sorted(asks)
        heal = {rid: ahead[0] for rid in members if steps[rid] < top}
        # Reuse the last group only when nothing about it changed and it did not break.
        rebuild = members != self.members or not commit or self.broken
        group = f"pg/{r}" if rebuild else self.rounds[-1].group
        quorum = Quorum(r, members, commit, top, heal, group, time.time())
        self.members, self.broken = members, False
        self.rounds.append(quorum)
        self.store.set(f"quorum/{r}", quorum.to_json())
        return quorum

    def _gather(self, r: int) -> dict[int, dict[str, Any]] | None:
        """The asks of round `r` once every live member of the last quorum has asked."""
        started = time.monotonic()
        while not self.stop.is_set():
            finished = {rid for rid in range(self.replicas) if self.store.check([f"done/{rid}"])}
            waiting = [rid for rid in self.members if self.alive(rid) and rid not in finished]
            asked = [rid for rid in range(self.replicas) if self.store.check([f"ask/{r}/{rid}"])]
            if len(asked) < self.min_replicas and not self._all_finished():
                if time.monotonic() - started > self.timeout:
                    raise TimeoutError(
                        f"round {r}: {len(asked)} replicas after {self.timeout:g} s, "
                        f"min_replicas={self.min_replicas}"
                    )
                time.sleep(0.0005)
                continue
            if self.members and all(rid in asked for rid in waiting) and asked:
                break
            if (
                not self.rounds
                and asked
                and all(rid in asked for rid in range(self.replicas) if self.alive(rid))
            ):
                break  # the first round waits for every replica started
            if self.rounds and not self.members and asked:  # after everyone was lost
                break
            if waiting and time.monotonic() - started > self.timeout:
                for rid in waiting:
                    if rid not in asked:
                        self.kill(rid)  # alive but silent: hung; dropped from now on
                self.broken = True
            if self._all_finished():
                return None
            time.sleep(0.0005)
        else:
            return None
        if len(self.members) > len([rid for rid in self.members if rid in asked]):
            self.broken = True  # a member is gone: its group cannot be used again
        return {rid: json.loads(self.store.get(f"ask/{r}/{rid}")) for rid in asked}

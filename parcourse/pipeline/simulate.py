"""Predict a schedule's timeline from costs: no processes, microseconds per schedule.

Each rank runs its actions in order; an action starts when its rank is free and
what it needs has arrived:

- F(s, m) needs F(s-1, m)'s activations (sent from stage s-1's rank),
- B(s, m) and I(s, m) need F(s, m) on this rank and the gradient from
  B(s+1, m) or I(s+1, m) (sent from stage s+1's rank),
- W(s, m) needs I(s, m).

A message between two ranks occupies the link from sender to receiver for
bytes / bandwidth (messages on a link queue) and arrives `latency` after its
last byte left, as parcourse.collectives.SimulatedLink models it. Messages
between stages on the same rank are free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from parcourse.pipeline.schedule import Action, Schedule


def _per_stage(value: float | Sequence[float], stages: int, name: str) -> list[float]:
    values = [float(value)] * stages if isinstance(value, (int, float)) else list(value)
    if len(values) != stages:
        raise ValueError(f"{name}: {len(values)} costs for {stages} stages")
    if any(v < 0 for v in values):
        raise ValueError(f"{name}: costs must be >= 0, got {values}")
    return values


@dataclass(frozen=True)
class Costs:
    """Seconds per action, per stage (a number applies to every stage), and the link.

    `backward` is a whole backward B; split, it is I (input gradient) taking
    backward - weight and W (weight gradient) taking `weight` (default: half of B).
    """

    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 2.0
    weight: float | Sequence[float] | None = None
    latency: float = 0.0  # seconds per message
    bandwidth: float = math.inf  # bytes per second
    message_bytes: float = 0.0  # one microbatch's activations (= its gradient)

    def of(self, stages: int) -> dict[str, list[float]]:
        f = _per_stage(self.forward, stages, "forward")
        b = _per_stage(self.backward, stages, "backward")
        w = ([bi / 2 for bi in b] if self.weight is None
             else _per_stage(self.weight, stages, "weight"))
        if any(wi > bi for wi, bi in zip(w, b)):
            raise ValueError("the weight-gradient part of backward cannot exceed backward")
        return {"F": f, "B": b, "W": w, "I": [bi - wi for bi, wi in zip(b, w)]}


@dataclass(frozen=True)
class SimSpan:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """What `simulate` predicts."""

    schedule: Schedule
    spans: list[SimSpan] = field(default_factory=list)
    step_time: float = 0.0
    busy: list[float] = field(default_factory=list)  # compute seconds per rank
    peak_in_flight: list[int] = field(default_factory=list)  # per rank
    messages: int = 0  # between ranks

    @property
    def bubble(self) -> float:
        """Idle fraction of the ranks' time: 1 - busy / (ranks x step time)."""
        if self.step_time == 0:
            return 0.0
        return 1 - sum(self.busy) / (len(self.busy) * self.step_time)


class Deadlock(ValueError):
    """A schedule in which some action can never start."""


def in_flight(actions: Sequence[Action], held: Sequence[float] | None = None
              ) -> list[float]:
    """Microbatches (per stage) whose activations a rank holds after each of its actions:
    one more after a forward, one fewer once its backward is done (after W when split,
    since the weight gradient needs the layer inputs). With `held` (what one microbatch
    holds on each stage, e.g. in bytes), that weighted: what the rank holds."""
    counts, alive = [], 0.0 if held is not None else 0
    for a in actions:
        size = 1 if held is None else held[a.stage]
        alive += {"F": size, "B": -size, "W": -size, "I": 0}[a.kind]
        counts.append(alive)
    return counts


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Every rank's timeline, the step time, the bubble and the peak in-flight
    microbatches; raises Deadlock naming the ranks and actions that can never start."""
    costs = costs or Costs()
    cost = costs.of(schedule.stages)
    p = schedule.stages
    where = schedule.stage_rank
    done: dict[Action, float] = {}  # end time of each finished action
    arrived: dict[tuple[Action, int], float] = {}  # (action, at rank) -> data arrival
    link_free: dict[tuple[int, int], float] = {}
    rank_free = [0.0] * schedule.ranks
    nxt = [0] * schedule.ranks
    timeline = Timeline(schedule, busy=[0.0] * schedule.ranks)

    split = {(a.stage, a.microbatch) for acts in schedule.actions for a in acts
             if a.kind == "I"}

    def needs(a: Action) -> list[tuple[Action, int]]:
        """(action, rank its data must reach) that `a` waits for."""
        s, m, here = a.stage, a.microbatch, where[a.stage]
        if a.kind == "F":
            return [] if s == 0 else [(Action(s - 1, "F", m), here)]
        if a.kind == "W":
            return [(Action(s, "I", m), here)]
        deps = [(Action(s, "F", m), here)]
        if s < p - 1:  # the gradient from the next stage: its B, or its I when split
            deps.append((Action(s + 1, "I" if (s + 1, m) in split else "B", m), here))
        return deps

    def arrival(dep: Action, at: int) -> float | None:
        if dep not in done:
            return None
        src = where[dep.stage]
        if src == at:
            return done[dep]
        key = (dep, at)
        if key not in arrived:  # send it when it is produced: the link may be busy
            link = (src, at)
            start = max(done[dep], link_free.get(link, 0.0))
            link_free[link] = start + costs.message_bytes / costs.bandwidth
            arrived[key] = link_free[link] + costs.latency
            timeline.messages += 1
        return arrived[key]

    remaining = sum(len(acts) for acts in schedule.actions)
    while remaining:
        progressed = False
        for r, acts in enumerate(schedule.actions):
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                ready = [arrival(dep, at) for dep, at in needs(a)]
                if any(t is None for t in ready):
                    break
                start = max([rank_free[r], *ready])  # type: ignore[list-item]
                end = start + cost[a.kind][a.stage]
                done[a] = rank_free[r] = end
                timeline.spans.append(SimSpan(r, a, start, end))
                timeline.busy[r] += end - start
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [f"rank {r} waits at {acts[nxt[r]]} for "
                     + ", ".join(str(d) for d, _ in needs(acts[nxt[r]]) if d not in done)
                     for r, acts in enumerate(schedule.actions) if nxt[r] < len(acts)]
            raise Deadlock("the schedule can never finish: " + "; ".join(stuck))
    timeline.step_time = max(rank_free, default=0.0)
    timeline.peak_in_flight = [max(in_flight(acts), default=0) for acts in schedule.actions]
    return timeline

"""Predict a schedule's timeline from costs: no processes, microseconds per schedule.

Each rank runs its actions in order; an action starts when its rank is free and
what it needs has arrived (the rule in `actions.needs`, run in time by
`actions.play`):

- F(s, m) needs F(s-1, m)'s activations (sent from stage s-1's rank),
- B(s, m) and I(s, m) need F(s, m) on this rank and the gradient from
  B(s+1, m) or I(s+1, m) (sent from stage s+1's rank),
- W(s, m) needs I(s, m).

A message between two ranks occupies the link from sender to receiver for
bytes / bandwidth (messages on a link queue) and arrives `latency` after its
last byte left, as parcourse.comm.SimulatedLink models it. Messages
between stages on the same rank are free.

The cost model (`SimulatedCompute`: seconds of F, B, I, W per stage) is the one the
runtime pads real actions to; the bubble of a timeline, simulated or measured, is
computed by `bubble`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from parcourse.pipeline.actions import Action, Deadlock, Schedule, play

__all__ = [
    "Costs",
    "Deadlock",
    "SimSpan",
    "SimulatedCompute",
    "Timeline",
    "bubble",
    "exposed_waits",
    "in_flight",
    "measured_bubble",
    "simulate",
    "taking_turns",
]


def _per_stage(value: float | Sequence[float], stages: int, name: str) -> list[float]:
    values = [float(value)] * stages if isinstance(value, (int, float)) else list(value)
    if len(values) != stages:
        raise ValueError(f"{name}: {len(values)} costs for {stages} stages")
    if any(v < 0 for v in values):
        raise ValueError(f"{name}: costs must be >= 0, got {values}")
    return values


def _divide(value: float | Sequence[float], by: int) -> float | Sequence[float]:
    return value / by if isinstance(value, (int, float)) else [v / by for v in value]


_Compute = TypeVar("_Compute", bound="SimulatedCompute")


@dataclass(frozen=True)
class SimulatedCompute:
    """Seconds each action lasts, per stage (a number applies to every stage): the one
    cost model of F, B, I and W, which the simulator predicts with and the runtime pads
    real actions to (the real math runs, then the rank waits out the rest).

    `backward` is a whole backward B; split, it is I (input gradient) taking
    backward - weight and W (weight gradient) taking `weight` (default: half of B).
    """

    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 2.0
    weight: float | Sequence[float] | None = None

    def of(self, stages: int) -> dict[str, list[float]]:
        """Seconds of each kind of action ("F", "B", "I", "W") on each of `stages` stages."""
        f = _per_stage(self.forward, stages, "forward")
        b = _per_stage(self.backward, stages, "backward")
        w = (
            [bi / 2 for bi in b]
            if self.weight is None
            else _per_stage(self.weight, stages, "weight")
        )
        if any(wi > bi for wi, bi in zip(w, b)):
            raise ValueError("the weight-gradient part of backward cannot exceed backward")
        return {"F": f, "B": b, "W": w, "I": [bi - wi for bi, wi in zip(b, w)]}

    def per_chunk(self: _Compute, chunks: int) -> _Compute:
        """These costs (for one rank's layers) cut into `chunks` equal stages: each a
        `chunks`-th (a schedule with several stages per rank)."""
        return dataclasses.replace(
            self,
            forward=_divide(self.forward, chunks),
            backward=_divide(self.backward, chunks),
            weight=None if self.weight is None else _divide(self.weight, chunks),
        )


@dataclass(frozen=True)
class Costs(SimulatedCompute):
    """Seconds per action, per stage (`SimulatedCompute`'s forward, backward, weight; a
    number applies to every stage), and the link between ranks."""

    latency: float = 0.0  # seconds per message
    bandwidth: float = math.inf  # bytes per second
    message_bytes: float = 0.0  # one microbatch's activations (= its gradient)
    # A forward and a backward the schedule runs together (DualPipe's F&B) last this
    # fraction of F + B; None: one after the other, as the course's runtime runs them.
    overlap: float | None = None

    def __post_init__(self) -> None:
        if self.overlap is not None and not 0 < self.overlap <= 1:
            raise ValueError(f"overlap must be in (0, 1], a fraction of F + B, got {self.overlap}")


@dataclass(frozen=True)
class SimSpan:
    rank: int
    action: Action
    start: float
    end: float


def bubble(busy: float, ranks: int, step_time: float) -> float:
    """Idle fraction of the ranks' time: 1 - busy / (ranks x step time), `busy` the
    compute seconds of all ranks together. The formulas it is compared with are in
    parcourse.theory (`gpipe_bubble`, ...)."""
    if step_time == 0:
        return 0.0
    return 1 - busy / (ranks * step_time)


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
        return bubble(sum(self.busy), len(self.busy), self.step_time)


def measured_bubble(spans: Sequence[Any], ranks: int) -> float:
    """1 - busy / (ranks x step time), from the compute spans of one step (all ranks)."""
    compute = [s for s in spans if s.kind == "compute"]
    if not compute:
        return math.nan
    start = min(s.start_ns for s in compute)
    end = max(s.end_ns for s in compute)
    busy = sum(s.end_ns - s.start_ns for s in compute)
    return bubble(busy, ranks, end - start)


def in_flight(actions: Sequence[Action], held: Sequence[float] | None = None) -> list[float]:
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
    # Copies of a stage (DualPipe) cost what the stage costs: the model is cut into
    # model_stages stages, whatever number of copies the ranks hold.
    per_model_stage = costs.of(schedule.model_stages)
    cost = {
        k: [v[schedule.model_stage(s)] for s in range(schedule.stages)]
        for k, v in per_model_stage.items()
    }
    link_free: dict[tuple[int, int], float] = {}
    timeline = Timeline(schedule, busy=[0.0] * schedule.ranks)

    def arrival(dep: Action, end: float, src: int, at: int) -> float:
        if src == at:
            return end
        # Sent when it is produced: the link may be busy.
        start = max(end, link_free.get((src, at), 0.0))
        link_free[(src, at)] = start + costs.message_bytes / costs.bandwidth
        timeline.messages += 1
        return link_free[(src, at)] + costs.latency

    rank_end = [0.0] * schedule.ranks

    def duration(a: Action) -> float:
        return cost[a.kind][a.stage]

    def together(f: Action, b: Action) -> float:
        assert costs.overlap is not None
        return costs.overlap * (duration(f) + duration(b))

    for slot in play(schedule, duration, arrival, together if costs.overlap is not None else None):
        timeline.spans.append(SimSpan(slot.rank, slot.action, slot.start, slot.end))
        timeline.busy[slot.rank] += slot.end - slot.start
        rank_end[slot.rank] = slot.end
    timeline.step_time = max(rank_end, default=0.0)
    timeline.peak_in_flight = [int(max(in_flight(acts), default=0)) for acts in schedule.actions]
    return timeline


def taking_turns(first: Sequence[float], second: Sequence[float]) -> float:
    """How long two actions last when they run at once on one device, taking turns as the
    runtime's `turns` make them: each is its seconds in order, compute, then a wait for
    messages, then compute, and so on (even places compute, odd places waits). Compute
    needs the device, a wait does not; whichever action has compute ready first takes the
    device (`first` on a tie) and keeps it to its next wait."""
    parts, at, ready, free = (first, second), [0, 0], [0.0, 0.0], 0.0
    while any(at[i] < len(parts[i]) for i in (0, 1)):
        for i in (0, 1):  # waits cost no device: pass them
            while at[i] < len(parts[i]) and at[i] % 2 == 1:
                ready[i] += parts[i][at[i]]
                at[i] += 1
        waiting = [i for i in (0, 1) if at[i] < len(parts[i])]
        if not waiting:
            break
        i = min(waiting, key=lambda j: (ready[j], j))
        ready[i] = free = max(free, ready[i]) + parts[i][at[i]]
        at[i] += 1
    return max(ready)


def exposed_waits(
    schedule: Schedule, segments: Callable[[Action], Sequence[float]], overlap: bool
) -> tuple[list[float], float]:
    """Each rank's seconds of waiting with nothing to compute, and the step time, when each
    action `a` lasts `segments(a)` (compute, wait, compute, ...: `taking_turns`' form) and
    messages between stages are free; `overlap`: the pairs of `schedule.together` run
    taking turns (the runtime with `turns`), else one after the other. The waits a
    rank's actions expose: the time its slots last beyond their compute."""

    def duration(a: Action) -> float:
        return sum(segments(a))

    def together(f: Action, b: Action) -> float:
        return taking_turns(segments(f), segments(b))

    slots = play(schedule, duration, None, together if overlap else None)
    length = [0.0] * schedule.ranks
    for slot in slots:
        length[slot.rank] += slot.end - slot.start
    compute = [sum(sum(segments(a)[::2]) for a in acts) for acts in schedule.actions]
    return [t - c for t, c in zip(length, compute)], max((s.end for s in slots), default=0.0)

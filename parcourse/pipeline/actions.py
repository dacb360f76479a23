"""Actions, schedules as values, and THE rule of which action waits for which.

An action is forward F, backward B, or backward split into input gradient I and
weight gradient W, of one stage on one microbatch, printed as PyTorch's
torch.distributed.pipelining prints them: `1F3` is stage 1's forward of
microbatch 3. A schedule is, for every rank, the ordered list of its actions.

What an action waits for is written once, here (`needs`, and `incoming` /
`outgoing` for the part that crosses stages), and `play` runs a schedule's
actions in time under that rule: the simulator (`simulate`) gives it costs and a
link, `check` and a schedule's printed grid give it unit steps, the runtime posts
and waits for the messages `incoming` names. The builders of named schedules
live in `schedule`, which builds on this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, NamedTuple

Kind = Literal["F", "B", "I", "W"]


@dataclass(frozen=True)
class Action:
    """One compute step of one stage on one microbatch."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    __repr__ = __str__


def F(stage: int, microbatch: int) -> Action:  # noqa: N802 (the papers' letters)
    return Action(stage, "F", microbatch)


def B(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(stage, "B", microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: N802, E741, E743
    return Action(stage, "I", microbatch)


def W(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(stage, "W", microbatch)


class Op(NamedTuple):
    """An action named without its stage: `Op("F", 3)` is the forward of microbatch 3."""

    kind: Kind
    microbatch: int


@dataclass(frozen=True)
class Schedule:
    """Who runs what, in which order.

    `stage_rank[s]` is the rank that holds stage s (several stages per rank for
    interleaved schedules); `actions[r]` is rank r's actions in order.

    Every microbatch goes through every stage in order, unless `routes` says otherwise:
    `routes[m]` is the stages microbatch m goes through, in order (DualPipe sends half of
    them down one copy of the model and half up the other). `copy_of[s]` is the stage of
    the model that stage s holds a copy of (DualPipe: two copies of each); empty, each
    stage is its own. `together` lists pairs (a forward, then the backward right after
    it on the same rank) that the schedule means to run overlapped, as DualPipe does;
    the simulator can cost them as one (`Costs.overlap`).
    """

    name: str
    microbatches: int
    stage_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    routes: tuple[tuple[int, ...], ...] = ()
    copy_of: tuple[int, ...] = ()
    together: tuple[tuple[Action, Action], ...] = ()

    @property
    def stages(self) -> int:
        return len(self.stage_rank)

    @property
    def model_stages(self) -> int:
        """How many stages the model is cut into (fewer than `stages` when they are copies)."""
        return len(set(self.copy_of)) if self.copy_of else self.stages

    def model_stage(self, stage: int) -> int:
        return self.copy_of[stage] if self.copy_of else stage

    def route(self, microbatch: int) -> tuple[int, ...]:
        """The stages microbatch `microbatch` goes through, in forward order."""
        return self.routes[microbatch] if self.routes else tuple(range(self.stages))

    @cached_property
    def splits_backward(self) -> bool:
        """Whether backward is cut into I (the input's gradient) and W (the weights')."""
        return any(a.kind == "I" for acts in self.actions for a in acts)

    @cached_property
    def entry_stages(self) -> frozenset[int]:
        """The stages where microbatches enter (stage 0; DualPipe's two ends)."""
        return frozenset(self.route(m)[0] for m in range(self.microbatches))

    @cached_property
    def exit_stages(self) -> frozenset[int]:
        """The stages where microbatches leave, their loss taken there."""
        return frozenset(self.route(m)[-1] for m in range(self.microbatches))

    @cached_property
    def entry_ranks(self) -> frozenset[int]:
        """The ranks that hold an entry stage: they are given the batch's inputs."""
        return frozenset(self.stage_rank[s] for s in self.entry_stages)

    @cached_property
    def exit_ranks(self) -> frozenset[int]:
        """The ranks that hold an exit stage: they are given the targets, and return the
        loss."""
        return frozenset(self.stage_rank[s] for s in self.exit_stages)

    @cached_property
    def _steps(self) -> dict[tuple[int, int], tuple[int | None, int | None]]:
        """(stage, microbatch) -> (the stage before it, the stage after it) on its route."""
        out: dict[tuple[int, int], tuple[int | None, int | None]] = {}
        for m in range(self.microbatches):
            path = self.route(m)
            for k, s in enumerate(path):
                out[(s, m)] = (
                    path[k - 1] if k else None,
                    path[k + 1] if k + 1 < len(path) else None,
                )
        return out

    def previous_stage(self, stage: int, microbatch: int) -> int | None:
        """The stage microbatch `microbatch` comes from into `stage` (None: its first)."""
        return self._steps[(stage, microbatch)][0]

    def next_stage(self, stage: int, microbatch: int) -> int | None:
        """The stage microbatch `microbatch` goes to after `stage` (None: its last)."""
        return self._steps[(stage, microbatch)][1]

    def visits(self, stage: int, microbatch: int) -> bool:
        return (stage, microbatch) in self._steps

    @property
    def ranks(self) -> int:
        return len(self.actions)

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    @cached_property
    def split(self) -> frozenset[tuple[int, int]]:
        """(stage, microbatch) whose backward runs split, as I then W."""
        return frozenset(
            (a.stage, a.microbatch) for acts in self.actions for a in acts if a.kind == "I"
        )

    @cached_property
    def needed(self) -> dict[Action, tuple[Action, ...]]:
        """Each action's `needs`, worked out once: `play` asks again each time it looks
        at an action still waiting, and the planner plays one schedule on many costs."""
        return {a: tuple(needs(self, a)) for acts in self.actions for a in acts}

    def __str__(self) -> str:
        """A step x rank grid: every action takes one step (I and W half a step each) and
        starts as soon as its rank and its inputs are ready; blank cells are the bubble."""
        try:
            spans = play(self, lambda a: 0.5 if a.kind in "IW" else 1.0)
        except (Deadlock, LookupError):  # not runnable, or an action off every route
            # (`check` says which): show each rank's order instead
            spans = [
                Slot(r, a, k, k + 1)
                for r, acts in enumerate(self.actions)
                for k, a in enumerate(acts)
            ]
        starts = sorted({s.start for s in spans})
        grid = {(s.rank, s.start): str(s.action) for s in spans}
        width = max(6, *(len(str(a)) for acts in self.actions for a in acts)) + 2
        lines = ["step" + "".join(f"rank {r}".rjust(width) for r in range(self.ranks))]
        for t in starts:
            cells = [grid.get((r, t), "") for r in range(self.ranks)]
            lines.append(f"{t:>4g}" + "".join(c.rjust(width) for c in cells))
        return "\n".join(lines)


# --------------------------------------------------------------------------- the rule


class Message(NamedTuple):
    """What one stage sends another: stage `stage`'s activations (kind F, to the next
    stage of the microbatch's route) or the gradient of its input (kind B, to the
    previous one; sent by its B, or by its I when its backward is split), for one
    microbatch; `to` is the stage that receives it."""

    kind: Literal["F", "B"]
    stage: int  # the stage that sends it
    microbatch: int
    to: int


def incoming(a: Action, schedule: Schedule) -> Message | None:
    """The message `a` waits for from another stage: F(s, m) the activations of the
    stage before s on m's route; B(s, m) and I(s, m) the gradient of stage s's output,
    which the stage after it sends; None for a route's first forward, its last
    backward, and W."""
    m = a.microbatch
    if a.kind == "F":
        before = schedule.previous_stage(a.stage, m)
        return None if before is None else Message("F", before, m, a.stage)
    if a.kind in "BI":
        after = schedule.next_stage(a.stage, m)
        return None if after is None else Message("B", after, m, a.stage)
    return None


def outgoing(a: Action, schedule: Schedule) -> Message | None:
    """The message `a` sends when it is done: a forward its activations (but a route's
    last stage's), a B or I the gradient of its input (but a route's first stage's); W
    nothing."""
    m = a.microbatch
    if a.kind == "F":
        after = schedule.next_stage(a.stage, m)
        return None if after is None else Message("F", a.stage, m, after)
    if a.kind in "BI":
        before = schedule.previous_stage(a.stage, m)
        return None if before is None else Message("B", a.stage, m, before)
    return None


def needs(schedule: Schedule, a: Action) -> list[Action]:
    """The actions `a` waits for:

    - F(s, m) needs F(s-1, m)'s activations (sent from stage s-1's rank),
    - B(s, m) and I(s, m) need F(s, m) on this rank and the gradient from
      B(s+1, m) or I(s+1, m) (whichever the schedule runs; sent from stage s+1's rank),
    - W(s, m) needs I(s, m).

    (s-1 and s+1: the stages before and after s on m's route.)
    """
    s, m = a.stage, a.microbatch
    deps = {"F": [], "B": [F(s, m)], "I": [F(s, m)], "W": [I(s, m)]}[a.kind]
    message = incoming(a, schedule)
    if message is not None:
        deps.append(sender(schedule, message))
    return deps


def sender(schedule: Schedule, message: Message) -> Action:
    """The action that sends `message`: a forward, or the backward's B or I (I when the
    schedule splits that stage's backward for that microbatch)."""
    s, m = message.stage, message.microbatch
    if message.kind == "F":
        return F(s, m)
    return I(s, m) if (s, m) in schedule.split else B(s, m)


# --------------------------------------------------------------------------- in time


class Slot(NamedTuple):
    """When `play` runs an action: on `rank`, from `start` to `end`."""

    rank: int
    action: Action
    start: float
    end: float


class Deadlock(ValueError):
    """A schedule in which some action can never start."""


Arrival = Callable[[Action, float, int, int], float]


def play(
    schedule: Schedule,
    duration: Callable[[Action], float],
    arrival: Arrival | None = None,
    together: Callable[[Action, Action], float] | None = None,
) -> list[Slot]:
    """Each rank runs its actions in order; an action starts when its rank is free and
    what it `needs` has arrived. `duration(a)` is how long `a` lasts; `arrival(dep, end,
    src, at)` when what `dep` made (done at `end` on rank `src`) reaches rank `at`
    (default: at once), asked once per dependency, when it is done. Returns the slots in
    the order they were decided; raises Deadlock naming the ranks and actions that can
    never start.

    `together(f, b)`: how long a pair of `schedule.together` lasts when run overlapped.
    Then a pair starts when both its actions could, shares that time between them (in
    proportion to their own durations), and what either made is ready when both end."""
    pairs = dict(schedule.together) if together is not None else {}
    where = schedule.stage_rank
    done: dict[Action, float] = {}  # end time of each finished action
    rank_free = [0.0] * schedule.ranks
    nxt = [0] * schedule.ranks
    slots: list[Slot] = []
    arrived: dict[tuple[Action, int], float] = {}
    needed = schedule.needed

    def ready_at(dep: Action, at: int) -> float | None:
        if dep not in done:
            return None
        if arrival is None:
            return done[dep]
        if (dep, at) not in arrived:
            arrived[(dep, at)] = arrival(dep, done[dep], where[dep.stage], at)
        return arrived[(dep, at)]

    remaining = sum(len(acts) for acts in schedule.actions)
    while remaining:
        progressed = False
        for r, acts in enumerate(schedule.actions):
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                partner = pairs.get(a)
                if partner is not None and (nxt[r] + 1 >= len(acts) or acts[nxt[r] + 1] != partner):
                    partner = None  # not right after it: run them apart
                ready = [ready_at(dep, r) for dep in needed[a]]
                if partner is not None:
                    ready += [ready_at(dep, r) for dep in needed[partner] if dep != a]
                times = [t for t in ready if t is not None]
                if len(times) < len(ready):
                    break
                start = max([rank_free[r], *times])
                if partner is None:
                    end = start + duration(a)
                    done[a] = rank_free[r] = end
                    slots.append(Slot(r, a, start, end))
                    nxt[r] += 1
                    remaining -= 1
                else:
                    assert together is not None
                    end = start + together(a, partner)
                    alone = duration(a) + duration(partner)
                    middle = start + (end - start) * (duration(a) / alone if alone else 0.5)
                    done[a] = done[partner] = rank_free[r] = end
                    slots += [Slot(r, a, start, middle), Slot(r, partner, middle, end)]
                    nxt[r] += 2
                    remaining -= 2
                progressed = True
        if not progressed:
            stuck = [
                f"rank {r} waits at {acts[nxt[r]]} for "
                + ", ".join(str(d) for d in needs(schedule, acts[nxt[r]]) if d not in done)
                for r, acts in enumerate(schedule.actions)
                if nxt[r] < len(acts)
            ]
            raise Deadlock("the schedule can never finish: " + "; ".join(stuck))
    return slots


# --------------------------------------------------------------------------- checks


def check(schedule: Schedule) -> None:
    """Raise ValueError unless every stage runs every microbatch's forward once and its
    backward once (B, or I then W), on the rank that holds the stage, and the actions
    can all run: each waits only for what comes before it (F(s, m) after F(s-1, m);
    B(s, m) after F(s, m) and B(s+1, m); W after I), never for a later action of its
    own rank or a cycle between ranks."""
    p, m = schedule.stages, schedule.microbatches
    if schedule.routes and len(schedule.routes) != m:
        raise ValueError(f"{len(schedule.routes)} routes for {m} microbatches")
    for path in schedule.routes:
        if not path or len(set(path)) != len(path) or not all(0 <= s < p for s in path):
            raise ValueError(f"a route must visit stages of 0..{p - 1} once each, got {path}")
    if schedule.copy_of and len(schedule.copy_of) != p:
        raise ValueError(f"copy_of names {len(schedule.copy_of)} stages, not {p}")
    seen: dict[tuple[int, str, int], int] = {}
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            if not (0 <= a.stage < p and 0 <= a.microbatch < m and a.kind in "FBIW"):
                raise ValueError(f"rank {rank}: {a} is outside {p} stages x {m} microbatches")
            if not schedule.visits(a.stage, a.microbatch):
                raise ValueError(
                    f"rank {rank}: {a}, but microbatch {a.microbatch}'s route "
                    f"{schedule.route(a.microbatch)} does not go through it"
                )
            if schedule.stage_rank[a.stage] != rank:
                raise ValueError(
                    f"rank {rank} runs {a}, but stage {a.stage} is on rank "
                    f"{schedule.stage_rank[a.stage]}"
                )
            key = (a.stage, a.kind, a.microbatch)
            if key in seen:
                raise ValueError(f"rank {rank}: {a} runs twice")
            seen[key] = rank
    for i in range(m):
        for s in schedule.route(i):
            if (s, "F", i) not in seen:
                raise ValueError(f"{F(s, i)} never runs")
            split = (s, "I", i) in seen or (s, "W", i) in seen
            if split and not ((s, "I", i) in seen and (s, "W", i) in seen):
                raise ValueError(f"stage {s}, microbatch {i}: I and W come in pairs")
            if not split and (s, "B", i) not in seen:
                raise ValueError(f"{B(s, i)} never runs")
            if split and (s, "B", i) in seen:
                raise ValueError(f"stage {s}, microbatch {i}: both B and I/W")
    play(schedule, lambda a: 1.0)  # raises Deadlock if some action could never start


def happens_before(schedule: Schedule, stage: int, first: Op | Action, then: Op | Action) -> bool:
    """Does `first` finish before `then` starts, whatever the costs? Both run on the rank
    that holds `stage`: it runs its actions in order, so this is their order there.

    >>> from parcourse.pipeline.schedule import gpipe
    >>> happens_before(gpipe(4, 8), stage=0, first=Op("F", 3), then=Op("B", 0))
    True
    """
    rank = schedule.stage_rank[stage]
    order = list(schedule.actions[rank])
    first, then = (
        a if isinstance(a, Action) else Action(stage, a.kind, a.microbatch) for a in (first, then)
    )
    for a in (first, then):
        if a not in order:
            raise ValueError(f"rank {rank} (stage {stage}) does not run {a}")
    return order.index(first) < order.index(then)

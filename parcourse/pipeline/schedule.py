"""Pipeline schedules by name: the builders, pure functions from sizes to a `Schedule`,
and ONE registry of them (`SCHEDULES`, `schedule_by_name`) that the CLI, the experiments,
the benchmarks and the lessons read.

A schedule is, for every rank, the ordered list of its compute actions (see `actions`
for the action type, the dependency rule and `check`). Adding a schedule is one builder
and one entry in `SCHEDULES`, here, plus its bubble's formula in `parcourse.theory`.
One file on purpose: each builder is read on its own, in the order the lessons meet them
(GPipe, 1F1B, interleaved, ZB-H1, DualPipeV, DualPipe, ZB-V), and the registry at the
end is the one list of them.

    >>> print(gpipe(stages=2, microbatches=3))
    step  rank 0  rank 1
       0     0F0
       1     0F1     1F0
    ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from parcourse import theory
from parcourse.pipeline.actions import (
    Action,
    B,
    Deadlock,
    F,
    I,
    Kind,
    Op,
    Schedule,
    W,
    check,
    happens_before,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "B",
    "Deadlock",
    "F",
    "I",
    "Kind",
    "NamedSchedule",
    "Op",
    "Schedule",
    "W",
    "check",
    "dualpipe",
    "dualpipe_v",
    "gpipe",
    "happens_before",
    "interleaved_1f1b",
    "naive",
    "one_f_one_b",
    "schedule_by_name",
    "zbv",
    "zero_bubble_h1",
]


def _check_sizes(stages: int, microbatches: int) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an integer >= 1, got {stages!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")


def _one_stage_per_rank(
    name: str, microbatches: int, per_rank: Iterable[Iterable[Action]]
) -> Schedule:
    actions = tuple(tuple(acts) for acts in per_rank)
    return Schedule(name, microbatches, tuple(range(len(actions))), actions)


# --------------------------------------------------------------------------- schedules


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe (Huang et al., arXiv:1811.06965): every forward, then every backward in
    reverse order. The first stage holds all m microbatches' activations at once."""
    _check_sizes(stages, microbatches)
    m = microbatches
    return _one_stage_per_rank(
        "gpipe",
        m,
        (
            [F(s, i) for i in range(m)] + [B(s, i) for i in reversed(range(m))]
            for s in range(stages)
        ),
    )


def naive(stages: int) -> Schedule:
    """Model parallelism without microbatches: the whole batch goes through the stages
    one after another, then back; one rank works at a time."""
    _check_sizes(stages, 1)
    schedule = gpipe(stages, 1)
    return Schedule("naive", 1, schedule.stage_rank, schedule.actions)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al., arXiv:2006.09503): stage s runs
    p - s - 1 forwards (warm-up), then alternates one forward and one backward
    (steady state), then the remaining backwards (cool-down). Same bubble as GPipe,
    but at most p - s microbatches in flight on stage s instead of m."""
    _check_sizes(stages, microbatches)
    p, m = stages, microbatches
    per_rank = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        acts = [F(s, i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: the next forward, the oldest backward
            acts += [F(s, warmup + i), B(s, i)]
        acts += [B(s, i) for i in range(m - warmup, m)]  # cool-down
        per_rank.append(acts)
    return _one_stage_per_rank("1f1b", m, per_rank)


def interleaved_1f1b(ranks: int, chunks_per_rank: int, microbatches: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC 2021, arXiv:2104.04473): the model is cut
    into ranks x chunks stages, and rank r holds the non-adjacent stages r, r + ranks,
    r + 2 ranks, ... (its chunks, or virtual stages). A microbatch visits every rank
    `chunks_per_rank` times, so a rank waits for one chunk's worth of work, not a whole
    stage's: the bubble shrinks by the number of chunks, for as many times more messages.

    Microbatches go in rounds of `ranks` (fewer when there are fewer microbatches): a
    rank runs one round's forwards on its first chunk, then on its second, ... (backwards
    likewise, last chunk first). Warm-up: the last rank runs (chunks - 1) rounds of
    forwards before its first backward, every rank before it two more (Megatron-LM's
    count), then one forward and one backward in turn. With one chunk it is 1F1B.
    """
    _check_sizes(ranks, microbatches)
    if (
        isinstance(chunks_per_rank, bool)
        or not isinstance(chunks_per_rank, int)
        or chunks_per_rank < 1
    ):
        raise ValueError(f"chunks_per_rank must be an integer >= 1, got {chunks_per_rank!r}")
    p, v, m = ranks, chunks_per_rank, microbatches
    per_round = min(p, m)
    if m % per_round:
        raise ValueError(
            f"interleaved 1F1B runs microbatches in rounds of {per_round} (the "
            f"number of ranks): {m} microbatches is not a multiple of {per_round}"
        )
    per_rank = []
    for r in range(p):
        total = v * m  # forwards on this rank, over all its chunks
        # Megatron-LM's count: two per hop to the last rank once chunks wrap round
        # the ring; with one chunk this is 1F1B's warm-up.
        warmup = min((v - 1) * per_round + (2 if v > 1 else 1) * (p - 1 - r), total)

        def order(k: int, *, backward: bool) -> tuple[int, int]:
            """(stage, microbatch) of this rank's k-th forward (or backward)."""
            rnd, within = divmod(k, v * per_round)
            chunk, i = divmod(within, per_round)
            if backward:
                chunk = v - 1 - chunk
            return chunk * p + r, rnd * per_round + i

        fwd = [F(*order(k, backward=False)) for k in range(total)]
        bwd = [B(*order(k, backward=True)) for k in range(total)]
        acts = fwd[:warmup]
        for k in range(total - warmup):
            acts += [fwd[warmup + k], bwd[k]]
        acts += bwd[total - warmup :]
        per_rank.append(acts)
    stage_rank = tuple(s % p for s in range(p * v))
    return Schedule("interleaved-1f1b", m, stage_rank, tuple(tuple(a) for a in per_rank))


def zero_bubble_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., arXiv:2401.10241): backward split into I, the gradient of the
    stage's input, which the stage before is waiting for, and W, the gradient of the
    weights, which nobody waits for. Stage s runs 1F1B's forwards and I's and holds back
    its last s weight gradients; they fill the bubble at the end.

    Same peak memory as 1F1B (p microbatches on the busiest rank: a microbatch's
    activations are held until its W), and the bubble shrinks from (p - 1)(F + B) to
    (p - 1)(F + B - 2W) (B = I + W, the whole backward).
    """
    _check_sizes(stages, microbatches)
    p, m = stages, microbatches
    per_rank = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        acts: list[Action] = [F(s, i) for i in range(warmup)]
        pending: list[int] = []  # microbatches whose W is held back

        def input_gradient(i: int) -> None:
            acts.append(I(s, i))
            pending.append(i)
            while len(pending) > s:  # stage s keeps s weight gradients for later
                acts.append(W(s, pending.pop(0)))

        for i in range(m - warmup):
            acts.append(F(s, warmup + i))
            input_gradient(i)
        for i in range(m - warmup, m):
            input_gradient(i)
        acts += [W(s, i) for i in pending]
        per_rank.append(acts)
    return _one_stage_per_rank("zb-h1", m, per_rank)


def dualpipe_v(ranks: int, microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe in its V form, arXiv:2412.19437 and
    github.com/deepseek-ai/DualPipe): the model is cut into 2 x ranks stages placed as a
    V: rank r holds stage r and stage 2 ranks - 1 - r, so rank 0 holds the first stage and
    the last (embedding and loss on one rank). Each rank has two streams of work, down
    the V (its first stage) and up it (its second), and from the steady state on runs a
    forward of one beside a backward of the other (DeepSeek overlaps the pair's compute
    with its communication; here they run one after the other). Some backwards are split
    into I and W, the Ws filling the gaps, as in zero-bubble schedules.

    Needs at least 2 x ranks microbatches. Where DualPipe proper sends microbatches in
    from both ends and so holds every weight twice, the V form holds each stage once.
    """
    _check_sizes(ranks, microbatches)
    p, m = ranks, microbatches
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least 2 x ranks = {2 * p} microbatches, got {m}")
    per_rank = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r  # this rank's two stages
        acts: list[Action] = []
        count: dict[tuple[int, str], int] = {}
        weights: list[Action] = []  # W actions held back, oldest first

        def add(stage: int, kind: Kind) -> None:
            key = (stage, "F" if kind == "F" else "B")  # B and I share one counter
            i = count.get(key, 0)
            count[key] = i + 1
            acts.append(Action(stage, kind, i))
            if kind == "I":
                weights.append(W(stage, i))

        def weight() -> None:
            if weights:
                acts.append(weights.pop(0))

        for _ in range(2 * (p - r - 1)):  # 1: forwards down the V
            add(down, "F")
        for _ in range(r + 1):  # 2: forwards down and up
            add(down, "F")
            add(up, "F")
        for _ in range(p - r - 1):  # 3: zero-bubble on the way up
            add(up, "I")
            weight()
            add(up, "F")
        for _ in range(m - 2 * p + r + 1):  # 4: steady state, forward beside backward
            add(down, "F")
            add(up, "B")
            add(up, "F")
            add(down, "B")
        for _ in range(p - r - 1):  # 5
            add(up, "B")
            add(up, "F")
            add(down, "B")
        split = False
        for i in range(r + 1):  # 6: backwards up and down, the later half split
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            add(up, "I" if split else "B")
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            add(down, "I" if split else "B")
        for _ in range(p - r - 1):  # 7
            weight()
            add(down, "I" if split else "B")
        while weights:  # 8: the weight gradients still held
            weight()
        per_rank.append(acts)
    stage_rank = tuple(list(range(p)) + list(reversed(range(p))))
    return Schedule("dualpipe-v", m, stage_rank, tuple(tuple(a) for a in per_rank))


@dataclass
class _DualPipeRank:
    """One rank's actions as DualPipe builds them, phase by phase. Its two directions
    are numbered by the order it meets them: direction 0 is the one whose entry is
    nearer (down for the first half of the ranks, up for the second), direction 1 the
    other. `stage[d]` is its stage in direction d, `offset[d]` the first microbatch that
    goes that way (0 down, m/2 up); `fwd[d]`/`bwd[d]` count the forwards and backwards
    it has run each way. `weights` holds the W of every split backward until `weight`
    runs it (oldest first); `together` collects the forward-beside-backward pairs."""

    stage: tuple[int, int]
    offset: tuple[int, int]
    acts: list[Action] = field(default_factory=list)
    weights: list[Action] = field(default_factory=list)
    together: list[tuple[Action, Action]] = field(default_factory=list)
    fwd: list[int] = field(default_factory=lambda: [0, 0])
    bwd: list[int] = field(default_factory=lambda: [0, 0])

    def forward(self, d: int) -> Action:
        self.acts.append(F(self.stage[d], self.offset[d] + self.fwd[d]))
        self.fwd[d] += 1
        return self.acts[-1]

    def backward(self, d: int, split: bool = False) -> Action:
        i = self.offset[d] + self.bwd[d]
        self.bwd[d] += 1
        self.acts.append(I(self.stage[d], i) if split else B(self.stage[d], i))
        if split:
            self.weights.append(W(self.stage[d], i))
        return self.acts[-1]

    def weight(self) -> None:
        if self.weights:
            self.acts.append(self.weights.pop(0))

    def pair(self, f: int, b: int) -> None:
        """A forward in direction f beside a backward in direction b, to overlap."""
        self.together.append((self.forward(f), self.backward(b)))


def _dualpipe_warm_up(rank: _DualPipeRank, half: int, near: int) -> None:
    """Steps 1 to 3: forwards from the nearer end, then from both ends, then the first
    backwards of direction 1, split so their Ws fill the gaps (zero bubble)."""
    for _ in range((half - near - 1) * 2):  # 1: forwards from the nearer end
        rank.forward(0)
    for _ in range(near + 1):  # 2: from both ends
        rank.forward(0)
        rank.forward(1)
    for _ in range(half - near - 1):  # 3: zero bubble
        rank.backward(1, split=True)
        rank.weight()
        rank.forward(1)


def _dualpipe_steady_state(
    rank: _DualPipeRank, half: int, half_m: int, near: int, ranks: int, mid: bool
) -> None:
    """Steps 4 and 5: a forward of one direction beside a backward of the other."""
    for i in range(half_m - ranks + near + 1):  # 4: the steady state, F beside B
        if i == 0 and mid:  # DeepSeek does not overlap this pair, to shrink the bubble
            rank.forward(0)
            rank.backward(1)
        else:
            rank.pair(0, 1)
        rank.pair(1, 0)
    for _ in range(half - near - 1):  # 5
        rank.backward(1)
        rank.pair(1, 0)


def _dualpipe_cool_down(rank: _DualPipeRank, half: int, near: int) -> None:
    """Steps 6 to 8: the remaining backwards, the later half split, and the Ws held."""
    split = False
    for i in range(near + 1):  # 6: backwards, the later half split
        if i == (near + 1) // 2 and near % 2 == 1:
            split = True
        rank.backward(1, split)
        if i == (near + 1) // 2 and near % 2 == 0:
            split = True
        rank.backward(0, split)
    for _ in range(half - near - 1):  # 7
        rank.weight()
        rank.backward(0, split=True)
    while rank.weights:  # 8: the weight gradients still held
        rank.weight()


def _check_dualpipe_sizes(ranks: int, microbatches: int) -> None:
    _check_sizes(ranks, microbatches)
    if ranks % 2:
        raise ValueError(
            f"DualPipe needs an even number of ranks (its two directions meet "
            f"in the middle), got {ranks}"
        )
    if microbatches < 2 * ranks or microbatches % 2:
        raise ValueError(
            f"DualPipe needs an even number of microbatches, at least 2 x ranks "
            f"= {2 * ranks} (half enter at each end), got {microbatches}"
        )


def dualpipe(ranks: int, microbatches: int) -> Schedule:
    """DualPipe (DeepSeek-V3 technical report, arXiv:2412.19437 sec. 3.2.1; the schedule
    of github.com/deepseek-ai/DualPipe): microbatches enter the pipeline from both ends
    at once. The model is cut into p stages and every rank holds two of them, one of
    each copy of the weights: rank r holds stage r of the copy the first half of the
    microbatches goes down (stages 0..p-1 here, on ranks 0..p-1) and stage p-1-r of the
    copy the second half goes up (stages p..2p-1 here: stage p + j holds the model's
    stage j, on rank p-1-j). "Double storage for higher utilisation": after the schedule
    each weight's gradient is summed over its two copies (PipelineRuntime does it, as for
    tied weights) and both copies step alike.

    Each rank runs the report's eight steps, in three phases: the warm-up (forwards from
    the nearer end, then from both); the steady state, in which a forward of one
    direction runs beside a backward of the other (`together`: DeepSeek overlaps the
    pair, each one's communication hidden under the other's compute; the course's
    runtime runs them one after the other, or, given `turns`, at once in two threads
    taking turns on the rank, so that one's all-to-all runs while the other computes:
    `PipelineRuntime`); and the cool-down. Some backwards split into I and W, the Ws
    filling gaps.

    Needs an even number of ranks and an even number of microbatches, at least 2 x
    ranks (half in each direction, at least one per rank)."""
    _check_dualpipe_sizes(ranks, microbatches)
    p, m = ranks, microbatches
    half, half_m = p // 2, m // 2
    per_rank, together = [], []
    for r in range(p):
        near = min(r, p - 1 - r)  # how far this rank is from its nearer end
        a, b = r, 2 * p - 1 - r  # its stage of each copy: down (first half), up
        stage = (a, b) if r < half else (b, a)  # direction 0 first
        offset = (0 if stage[0] < p else half_m, 0 if stage[1] < p else half_m)
        rank = _DualPipeRank(stage, offset)
        _dualpipe_warm_up(rank, half, near)
        _dualpipe_steady_state(rank, half, half_m, near, p, mid=r in (half - 1, half))
        _dualpipe_cool_down(rank, half, near)
        per_rank.append(rank.acts)
        together += rank.together
    stage_rank = tuple(list(range(p)) + list(reversed(range(p))))
    routes = tuple(tuple(range(p)) if i < half_m else tuple(range(p, 2 * p)) for i in range(m))
    return Schedule(
        "dualpipe",
        m,
        stage_rank,
        tuple(tuple(a) for a in per_rank),
        routes=routes,
        copy_of=tuple(range(p)) * 2,
        together=tuple(together),
    )


def zbv(ranks: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al., arXiv:2401.10241 sec. 6; torch's ScheduleZBVZeroBubble): the
    zero-bubble schedule on DualPipeV's V placement, rank r holding stage r and stage
    2 ranks - 1 - r. Every backward is split: I on the critical path, W after it; each
    rank warms up with forwards down the V (2(p - r) - 1 of them), then pairs of one
    stage's forward with the other's, then in the steady state a forward, I and W of each
    of its two stages in turn; the cool-down runs the remaining I's and fills with W's.
    Bubble-free when F, I and W take the same time; its peak activations stay those of
    1F1B's first stage (2p microbatch-stages), as the paper designs it.

    Built for max(2p - 1, m) microbatches and cut back to m (as torch's is), so any m
    runs; fewer than 2p - 1 leave a bubble."""
    _check_sizes(ranks, microbatches)
    p, m = ranks, microbatches
    n = max(2 * p - 1, m)
    per_rank = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        acts: list[Action] = []
        f0 = f1 = b0 = b1 = 0
        for _ in range(2 * (p - r) - 1):  # warm-up: forwards down the V
            acts.append(F(down, f0))
            f0 += 1
        for _ in range(r):  # the two stages' forwards in turn
            acts += [F(up, f1), F(down, f0)]
            f1 += 1
            f0 += 1
        for _ in range(p - r):  # the way up: forward, I, W of the second stage
            acts += [F(up, f1), I(up, b1), W(up, b1)]
            f1 += 1
            b1 += 1
        while f1 < f0 or f0 < n:  # steady state
            if f0 < n:
                acts.append(F(down, f0))
                f0 += 1
            acts += [I(down, b0), W(down, b0)]
            b0 += 1
            acts += [F(up, f1), I(up, b1), W(up, b1)]
            f1 += 1
            b1 += 1
        w0, w1 = b0, b1
        for _ in range(r):  # cool-down: the I's on the critical path first
            acts += [I(down, b0), I(up, b1)]
            b0 += 1
            b1 += 1
        for _ in range(p - r):
            acts += [I(down, b0), W(down, w0)]
            b0 += 1
            w0 += 1
        acts += [W(up, i) for i in range(w1, b1)]
        acts += [W(down, i) for i in range(w0, b0)]
        per_rank.append([a for a in acts if a.microbatch < m])
    stage_rank = tuple(list(range(p)) + list(reversed(range(p))))
    return Schedule("zbv", m, stage_rank, tuple(tuple(a) for a in per_rank))


# --------------------------------------------------------------------------- by name

Builder = Callable[[int, int, int], Schedule]  # (ranks, microbatches, chunks per rank)
Formula = Callable[[int, int, int, float, float, float], float | None]
"""(ranks, microbatches, chunks, F, B, W) -> the bubble the formula gives, None if none."""


def _one(ranks: int) -> int:
    return 1


@dataclass(frozen=True)
class NamedSchedule:
    """A schedule as the CLI, the experiments and the lessons name it: how to build it,
    what it asks of its sizes, its bubble's formula and torch's counterpart.

    `chunks`: stages per rank (None: as many as the caller asks, `--chunks`);
    `min_microbatches(ranks)`: the fewest it runs; `rounds`: microbatches go in rounds
    of `ranks` (a multiple of the ranks, or fewer); `microbatched`: False for a schedule
    that runs the batch whole (naive), which is no pipeline; `formula` is the bubble's
    formula as printed, `bubble` its value (from parcourse.theory); `torch` the class in
    torch.distributed.pipelining that runs the same schedule, if any.
    """

    name: str
    build: Builder
    formula: str
    bubble: Formula | None = None
    chunks: int | None = 1
    min_microbatches: Callable[[int], int] = _one
    rounds: bool = False
    microbatched: bool = True
    torch: str | None = None
    even: bool = False  # an even number of ranks and of microbatches (DualPipe's halves)

    def accepts(self, ranks: int, microbatches: int) -> bool:
        """Whether `build` takes these sizes (it raises ValueError, saying why, if not)."""
        if not self.microbatched:
            return True
        if self.even and (ranks % 2 or microbatches % 2):
            return False
        per_round = min(ranks, microbatches)
        return microbatches >= self.min_microbatches(ranks) and not (
            self.rounds and microbatches % per_round
        )


SCHEDULES: dict[str, NamedSchedule] = {
    s.name: s
    for s in [
        NamedSchedule(
            "naive",
            lambda ranks, m, chunks: naive(ranks),
            "(p-1)/(m+p-1)",
            theory.gpipe_formula,
            microbatched=False,
        ),
        NamedSchedule(
            "gpipe",
            lambda ranks, m, chunks: gpipe(ranks, m),
            "(p-1)/(m+p-1)",
            theory.gpipe_formula,
            torch="ScheduleGPipe",
        ),
        NamedSchedule(
            "1f1b",
            lambda ranks, m, chunks: one_f_one_b(ranks, m),
            "(p-1)/(m+p-1)",
            theory.gpipe_formula,
            torch="Schedule1F1B",
        ),
        NamedSchedule(
            "interleaved-1f1b",
            lambda ranks, m, chunks: interleaved_1f1b(ranks, chunks, m),
            "(p-1)/(v m+p-1)",
            lambda p, m, v, f, b, w: theory.interleaved_bubble(p, v, m),
            chunks=None,
            rounds=True,
            torch="ScheduleInterleaved1F1B",
        ),
        NamedSchedule(
            "zb-h1",
            lambda ranks, m, chunks: zero_bubble_h1(ranks, m),
            "(p-1)(F+B-2W) idle",
            theory.zero_bubble_h1_formula,
        ),
        NamedSchedule(
            "zbv",
            lambda ranks, m, chunks: zbv(ranks, m),
            "0 when F = I = W (Qi et al. sec. 6); see the simulator",
            chunks=2,
            torch="ScheduleZBVZeroBubble",
        ),
        NamedSchedule(
            "dualpipe",
            lambda ranks, m, chunks: dualpipe(ranks, m),
            "(p/2-1)(F+B-2W) idle run apart, (p/2-1)(F&B+B-3W) overlapped (DeepSeek)",
            theory.dualpipe_formula,
            chunks=2,
            min_microbatches=lambda ranks: 2 * ranks,
            even=True,
        ),
        NamedSchedule(
            "dualpipe-v",
            lambda ranks, m, chunks: dualpipe_v(ranks, m),
            "(DualPipe's table assumes F&B overlapped; see the simulator)",
            chunks=2,
            min_microbatches=lambda ranks: 2 * ranks,
            torch="ScheduleDualPipeV",
        ),
    ]
}


def schedule_by_name(name: str, ranks: int, microbatches: int, chunks: int = 2) -> Schedule:
    """The named schedule for `ranks` ranks; `chunks` (stages per rank) counts only where
    the schedule takes it (interleaved 1F1B; DualPipeV always has two, the others one)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name].build(ranks, microbatches, chunks)

"""Lesson 09, part 2: the planner's exercise and the memory it predicts beside a run."""

from __future__ import annotations

from typing import Any, TypedDict

from parcourse.experiments.exercises import ask
from parcourse.plan import Recompute
from parcourse.planner import Choice, Cluster, Plans, choices, model, plan


class _Exercise(TypedDict):
    model: str
    seq: int
    gpu: str
    gpus: int
    batch: int


class _Fixed(TypedDict):
    schedule: str
    zero: int
    sequence_parallel: bool
    recompute: Recompute


# The exercise's model and cluster: a 13B GPT-style model, 4 nodes of 8 H100s, a global
# batch of 256 sequences of 4096 tokens; the other knobs fixed as a real run sets them.
EXERCISE: _Exercise = {"model": "13B", "seq": 4096, "gpu": "h100", "gpus": 32, "batch": 256}
FIXED: _Fixed = {"schedule": "1f1b", "zero": 1, "sequence_parallel": True, "recompute": "selective"}


def exercise_plans() -> tuple[Any, Cluster, Plans]:
    """Every (dp, tp, pp, microbatches) of the exercise with the fixed knobs, planned."""
    config = model(EXERCISE["model"], EXERCISE["seq"])
    cluster = Cluster.preset(EXERCISE["gpu"], EXERCISE["gpus"])
    candidates = [
        c
        for c in choices(
            cluster.gpus,
            schedules=(FIXED["schedule"],),
            zero=(FIXED["zero"],),
            sequence_parallel=(True,),
            recompute=(FIXED["recompute"],),
        )
        if c.zero == FIXED["zero"] or c.dp == 1
    ]
    return (
        config,
        cluster,
        plan(config, cluster, EXERCISE["batch"], dtype="bf16", candidates=candidates),
    )


def check_plan(fn: Any) -> bool:
    """Lesson 09's exercise: `fn()` returns (dp, tp, pp, microbatches) for the exercise's
    model and cluster. Prints one line: why it does not run or fit, or how far its
    predicted step is from the planner's best; passes within 10% of the best."""
    answered, got = ask(fn, where="")
    if not answered:
        return False
    try:
        dp, tp, pp, m = (int(v) for v in got)
    except (TypeError, ValueError):
        print(f"Not quite: return four whole numbers (dp, tp, pp, microbatches), got {got!r}.")
        return False
    config, cluster, plans = exercise_plans()
    if dp * tp * pp != cluster.gpus:
        print(f"Not quite: dp x tp x pp = {dp * tp * pp}, the cluster has {cluster.gpus} GPUs.")
        return False
    choice = Choice(
        dp,
        tp,
        pp,
        FIXED["schedule"],
        m,
        zero=FIXED["zero"] if dp > 1 else 0,
        sequence_parallel=tp > 1,
        recompute=FIXED["recompute"],
    )
    mine = next((p for p in [*plans.ranked, *plans.rejected] if p.choice == choice), None)
    spans = (
        (
            f"; and tp {tp} spans nodes of {cluster.gpus_per_node} GPUs: every layer would "
            "wait on the slow link between them"
        )
        if tp > cluster.gpus_per_node
        else ""
    )
    if mine is None:
        problems = choice.problems(config, EXERCISE["batch"])
        print(f"Not quite: {'; '.join(problems) or 'that choice is outside the search'}{spans}.")
        return False
    if mine.why_not:
        if "spans nodes" in mine.why_not:
            spans = ""
        hint = (
            " Hint: more tp or pp divides the weights; more microbatches shrink each "
            "one's activations."
            if mine.why_not.startswith("out of memory")
            else ""
        )
        print(f"Not quite: {choice.label()} is turned down: {mine.why_not}{spans}.{hint}")
        return False
    best = plans.ranked[0]
    ratio = mine.time["step"] / best.time["step"]
    if ratio > 1.10:
        t = mine.time
        print(
            f"Not quite: it fits ({mine.memory[mine.busiest]['total'] / 2**30:.1f} GiB on "
            f"pipeline rank {mine.busiest}) but a step takes {ratio:.2f}x the best's "
            f"(bubble {t['bubble']:.2f} s, tp {t['tp']:.2f} s, dp {t['dp']:.2f} s of "
            f"{t['step']:.2f} s). Look at what dominates and move the knob that cuts it."
        )
        return False
    print(
        f"Correct: {choice.label()} fits ({mine.memory[mine.busiest]['total'] / 2**30:.1f} "
        f"GiB on its busiest rank) and is within {100 * (ratio - 1):.0f}% of the planner's "
        f"best ({best.choice.label()})."
    )
    return True


def distinct_shapes(plans: Plans, n: int = 3) -> list[Choice]:
    """The best-ranked configuration for each of the first `n` pipeline sizes the 3D step
    runs (ZeRO up to 2): a spread to measure, not three variants of one shape."""
    picked: dict[int, Choice] = {}
    for p in plans.ranked:
        key = p.choice.pp
        if p.choice.zero <= 2 and key not in picked:
            picked[key] = p.choice
    return list(picked.values())[:n]

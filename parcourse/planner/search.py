"""The planner's search (`parcourse.planner` says what it is): every configuration of
dp x tp x pp, schedule, microbatches, ZeRO stage, sequence parallelism and recompute on
a cluster (`choices`), each one checked, then predicted (`parcourse.planner.predict`),
those that fit ranked by step time and the others with the reason (`plan`), and the
ranked table (`format_plans`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

from parcourse.models import GPTConfig
from parcourse.parts import PART_AXES
from parcourse.plan import Recompute, Split
from parcourse.planner.inputs import Choice, Cluster, Dtype, GiB, check_dtype
from parcourse.planner.predict import predict_memory, predict_time, unpriced


@dataclass
class Planned:
    """A configuration with its prediction, or why it is out."""

    choice: Choice
    memory: list[dict[str, float]] = field(default_factory=list)
    time: dict[str, float] = field(default_factory=dict)
    why_not: str = ""

    @property
    def busiest(self) -> int:
        return max(range(len(self.memory)), key=lambda r: self.memory[r]["total"])


@dataclass
class Plans:
    ranked: list[Planned]
    rejected: list[Planned]
    global_batch: int = 0  # in sequences, what they were planned for


def choices(
    gpus: int,
    *,
    schedules: tuple[str, ...] = ("1f1b", "interleaved-1f1b"),
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    zero: tuple[int, ...] = (0, 1, 2, 3),
    sequence_parallel: tuple[bool, ...] = (False, True),
    recompute: tuple[Recompute, ...] = ("none",),
    split: tuple[Split, ...] = ("layers",),
    cp: tuple[int, ...] = (1, 2, 4, 8),
    ep: tuple[int, ...] = (1,),
    dp_shard: tuple[int, ...] = (1,),
    node: int | None = None,
) -> list[Choice]:
    """Every factorisation of `gpus` into dp x tp x pp x cp x ep (cp among `cp`: the
    ring; ep among `ep`, for a GPT with experts) with each schedule, number of
    microbatches, ZeRO stage, sequence parallelism, recompute and split asked for
    (sequence parallelism only with tp > 1 and cp 1, as the course's step runs it; one
    schedule and one split when pp is 1; ZeRO over the ranks holding the same weights,
    dp x cp x ep > 1, only, stages 2 and 3 only without a pipeline, as DeepSpeed allows
    them). `dp_shard`: HSDP's shard sizes, each dividing dp, under ZeRO only (the plan
    then has dp / dp_shard replicas of each slice): the widest of them whose ranks (with
    tp's, cp's and ep's) stay inside one `node` of that many ranks where given, HSDP's
    point, beside no HSDP."""
    out = []
    for c, e in itertools.product(cp, ep):
        if c < 1 or e < 1 or gpus % (c * e):
            continue
        for tp in range(1, gpus // (c * e) + 1):
            for pp in range(1, gpus // (c * e * tp) + 1):
                if gpus % (c * e * tp * pp):
                    continue
                dp = gpus // (c * e * tp * pp)
                stages = [z for z in zero if z < 2 or pp == 1] if dp * c * e > 1 else [0]
                fit = [n for n in dp_shard if 1 < n < dp and dp % n == 0]
                fit = [n for n in fit if node is None or tp * c * e * n <= node]
                shards = [1, *fit[-1:]]  # HSDP's widest shard that keeps inside a node
                for schedule in schedules if pp > 1 else schedules[:1]:
                    for m in microbatches:
                        for z in stages:
                            for sp in sequence_parallel if tp > 1 and c == 1 else (False,):
                                for r in recompute:
                                    out += [
                                        Choice(
                                            dp // s,
                                            tp,
                                            pp,
                                            schedule,
                                            m,
                                            zero=z,
                                            sequence_parallel=sp,
                                            recompute=r,
                                            split=how,
                                            cp=c,
                                            ep=e,
                                            dp_shard=s,
                                        )
                                        for how in (split if pp > 1 else split[:1])
                                        for s in (shards if z else [1])
                                    ]
    return out


def plan(
    config: GPTConfig,
    cluster: Cluster,
    global_batch: int,
    *,
    dtype: Dtype = "fp32",
    candidates: list[Choice] | None = None,
) -> Plans:
    """Every candidate predicted (by default `choices(cluster.gpus)`, with selective and
    full recompute too in 16 bits, on a published cluster both splits, by layer count and
    Megatron-LM's blocks alone, cp in fp32, and ep for a GPT with experts); the ones that
    fit ranked by step time, the others with the reason. On this machine
    (`cluster.cores`), only what the course's 3D step runs
    (`ParallelPlan.problems(step=True)`), its full recompute a checkpoint a stage: every
    plan ranked can be started with `train3d --plan`. On a published cluster, what
    Megatron-LM runs: full recompute a checkpoint a block."""
    check_dtype(dtype)
    ranked, rejected = [], []
    here = cluster.cores is not None
    if candidates is None:
        candidates = choices(
            cluster.gpus,
            recompute=("none",) if dtype == "fp32" else ("none", "selective", "full"),
            split=("layers",) if here else ("layers", "blocks"),
            # what it prices: cp's ring in fp32, ep where there are experts
            cp=(1, 2, 4, 8) if dtype == "fp32" else (1,),
            ep=(1, 2, 4, 8) if config.experts else (1,),
            # HSDP where there are nodes to keep ZeRO's gathers inside of
            dp_shard=(1, 2, 4, 8) if cluster.gpus > cluster.gpus_per_node else (1,),
            node=cluster.gpus_per_node,
        )
    for choice in candidates:
        item = Planned(choice)
        if problems := choice.problems(config, global_batch, world=cluster.gpus, step=here):
            item.why_not = "; ".join(problems)
        elif why := unpriced(config, choice, dtype):  # refused rather than priced wrong
            item.why_not = why
        elif choice.tp > cluster.gpus_per_node:
            item.why_not = (
                f"tp {choice.tp} spans nodes of {cluster.gpus_per_node}: every "
                "layer would wait on the slow link"
            )
        elif choice.microbatches < choice.pp:
            item.why_not = (
                f"{choice.microbatches} microbatches for {choice.pp} stages: "
                "some stage always idles"
            )
        if item.why_not:
            rejected.append(item)
            continue
        item.memory = predict_memory(
            config, choice, global_batch, dtype, checkpoint="stage" if here else "block"
        )
        worst = item.memory[item.busiest]
        if worst["total"] > cluster.memory:
            item.why_not = (
                f"out of memory by {(worst['total'] - cluster.memory) / GiB:.1f} "
                f"GiB on pipeline rank {item.busiest}"
            )
            rejected.append(item)
            continue
        item.time = predict_time(config, choice, global_batch, cluster, dtype)
        ranked.append(item)
    # Fastest first; among equally fast, the lighter. Without a pipeline the number of
    # microbatches changes only memory (gradient accumulation): keep the lightest.
    ranked.sort(key=lambda p: (round(p.time["step"], 9), p.memory[p.busiest]["total"]))
    kept: list[Planned] = []
    seen: set[tuple[Any, ...]] = set()
    for p in ranked:
        key = (dataclasses.replace(p.choice, microbatches=0), round(p.time["step"], 9))
        if p.choice.pp > 1 or key not in seen:
            kept.append(p)
            seen.add(key)
    return Plans(kept, rejected, global_batch)


def bound_of(time: dict[str, float]) -> Literal["compute", "communication"]:
    """Which bound a predicted step (`predict_time`) is under: "communication" where what
    it waits for of its messages (tp's collectives, each part's own, cp's ring and ep's
    all-to-alls, and dp's exposed reduction) takes longer than its compute, else "compute"
    (the roofline's two lines, `theory.roofline`, for a whole plan). The bubble is idle
    time, not counted for either: a pipeline's bound is its schedule's."""
    exposed = time["tp"] + time["dp"] + sum(time.get(a, 0.0) for a in PART_AXES)
    return "communication" if exposed > time["compute"] else "compute"


def format_plans(plans: Plans, top: int = 10) -> str:
    """The ranked table (what `python -m parcourse plan` prints): each configuration's
    predicted step split into compute / tp / (cp's ring and ep's all-to-alls, where a
    plan shown uses them) / bubble / dp / optimizer / waiting for a core,
    tokens/s, MFU, the bound it is under (`bound_of`: compute, or comm. where its exposed
    messages take longer) and the busiest pipeline rank's memory; then how many were turned down
    and why, with the closest that ran out of memory."""
    from collections import Counter

    from parcourse.memory import format_bytes

    shown = plans.ranked[:top]
    # the labels' own width, so that the numbers line up however long a plan's name
    width = max([13, *(len(p.choice.label()) for p in shown)])
    # a column for each part's own messages (a term of the step's) where a plan shown uses it
    parts = [a for a in PART_AXES if any(getattr(p.choice, a) > 1 and a in p.time for p in shown)]
    lines = [
        f"{'':>3}  {'configuration':<{width}} {'step ms':>10} {'compute':>8} {'tp':>7} "
        + "".join(f"{a:>7} " for a in parts)
        + f"{'bubble':>7} {'dp':>7} {'opt':>6} {'cores':>6} {'tokens/s':>10} {'MFU':>6} "
        f"{'bound':>7} {'memory (busiest)':>17}"
    ]
    for k, p in enumerate(shown, 1):
        t, mem = p.time, p.memory[p.busiest]
        lines.append(
            f"{k:>3}  {p.choice.label():<{width}} {1e3 * t['step']:>10.1f} "
            f"{1e3 * t['compute']:>8.1f} {1e3 * t['tp']:>7.1f} "
            + "".join(f"{1e3 * t.get(a, 0.0):>7.1f} " for a in parts)
            + f"{1e3 * max(0, t['bubble']):>7.1f} "
            f"{1e3 * t['dp']:>7.1f} {1e3 * t['optimizer']:>6.1f} {1e3 * t['cores']:>6.1f} "
            f"{t['tokens_per_s']:>10.0f} "
            f"{100 * t['mfu']:>5.1f}% "
            f"{'comm.' if bound_of(t) == 'communication' else 'compute':>7} "
            f"{format_bytes(mem['total']):>10} (pp {p.busiest})"
        )
    closest = sorted(
        (p for p in plans.rejected if p.why_not.startswith("out of memory")),
        key=lambda p: p.memory[p.busiest]["total"],
    )[:3]
    if not plans.ranked:
        lines.append("     nothing fits")
        if closest:  # what the closest one holds at once: its microbatch's sequences
            p = closest[0]
            batch = plans.global_batch // (p.choice.dp * p.choice.microbatches)
            lines.append(
                f"     (the closest, {p.choice.label()}, runs microbatches of {batch} "
                "sequences: where activations are what does not fit, a smaller "
                "global batch or more microbatches than tried here)"
            )
    lines.append(f"\n{len(plans.ranked)} fit, {len(plans.rejected)} turned down:")
    kinds = Counter(_kind(p.why_not) for p in plans.rejected)
    lines += [f"  {n:>5} x {why}" for why, n in kinds.most_common(6)]
    lines += [f"  e.g. {p.choice.label()}: {p.why_not}" for p in closest]
    return "\n".join(lines)


def _kind(why_not: str) -> str:
    """A reason as counted among others: without its amount ("out of memory"), and the
    batch's rule as one kind whatever its numbers."""
    if why_not.startswith("the global batch of "):
        return "the global batch does not cut into dp x microbatches equal parts"
    return why_not.split(" by ")[0].split(":")[0]


__all__ = ["Planned", "Plans", "bound_of", "choices", "format_plans", "plan"]

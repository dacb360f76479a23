"""Hierarchical sharding (HSDP) as a part of a run (`parcourse.parts`): the mesh's dp_shard
axis, FSDP2's HSDP and torchtitan's `dp_shard`. The data-parallel ranks are
dp x dp_shard: ZeRO cuts its slices over dp_shard's ranks only (inside a node, on a
two-level network), and each slice is summed across dp's ranks after its reduce-scatter,
so an all-gather of ZeRO-3 never leaves the shard's ranks (`Roles.shard`,
`Roles.replicate`; the sync is `parcourse.zero.stages`). Its ranks take their own rows of
the batch and average every gradient, as dp's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from parcourse.part import Axis, Part

if TYPE_CHECKING:
    from parcourse.models import GPTConfig
    from parcourse.plan import ParallelPlan


@dataclass(frozen=True)
class ShardFields:
    """Hierarchical sharding's field in the plan."""

    dp_shard: int = field(
        default=1,
        metadata={
            "help": "data-parallel ranks ZeRO shards over inside each of dp's replicas "
            "(HSDP: the slices replicated across dp)"
        },
    )


def problems(plan: ParallelPlan, config: GPTConfig | None, step: bool) -> list[str]:
    """HSDP's rule: it shards ZeRO's slices, so it needs ZeRO."""
    if plan.dp_shard > 1 and not plan.zero:
        return [
            f"dp_shard {plan.dp_shard} cuts ZeRO's slices over its ranks, and this plan has "
            "no ZeRO: give a ZeRO stage (1, 2 or 3), or count its ranks in dp"
        ]
    return []


def words(plan: ParallelPlan) -> list[str]:
    return [f"dp_shard{plan.dp_shard}"] * (plan.dp_shard != 1)


def phrase(plan: ParallelPlan, config: GPTConfig) -> str:
    if plan.dp_shard == 1:
        return ""
    return f"ZeRO's slices over dp_shard {plan.dp_shard}, replicated across dp {plan.dp} (HSDP)"


PART = Part(
    "hierarchical sharding",
    axes=(Axis("dp_shard", "C9", depth=0, batch=True, dense=True, experts=True, shards=True),),
    problems=problems,
    words=words,
    phrase=phrase,
)

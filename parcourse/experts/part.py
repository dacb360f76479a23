"""Expert parallelism as a part of a run (`parcourse.parts`): the mesh's ep axis, each MoE
layer's experts cut over its ranks (tokens dispatched to their experts' ranks by an
all-to-all and combined back). Its ranks take their own rows of the batch, as dp's, and
average the dense weights' gradients with them; each expert's gradient is averaged over
the ranks that hold the same experts (dp's and cp's), and the experts' gradients differ
along ep."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from parcourse.part import Axis, Part

if TYPE_CHECKING:
    from parcourse.models import GPTConfig
    from parcourse.plan import ParallelPlan


@dataclass(frozen=True)
class ExpertFields:
    """Expert parallelism's fields in the plan."""

    ep: int = field(
        default=1,
        metadata={
            "help": "expert-parallel ranks: each MoE layer's experts cut over them (each with its "
            "own rows, as dp's)"
        },
    )


def problems(plan: ParallelPlan, config: GPTConfig | None, step: bool) -> list[str]:
    """Expert parallelism's rules, and what the 3D step runs with experts."""
    experts = 0 if config is None else config.experts
    out = []
    if config is not None and plan.ep > 1 and not experts:
        out.append(
            f"ep {plan.ep} cuts the experts of MoE layers, and this GPT has none "
            "(GPTConfig(experts=...))"
        )
    if experts and experts % plan.ep:
        out.append(
            f"{experts} experts do not divide by ep {plan.ep}: every rank of an "
            "ep group holds the same number of experts"
        )
    if step and experts and plan.sequence_parallel:
        out.append(
            "the course's 3D step keeps each expert whole on every tp rank, where "
            "all see the same tokens: not under sequence parallelism (SP), which "
            "gives each tp rank its own"
        )
    return out


def words(plan: ParallelPlan) -> list[str]:
    return [f"ep{plan.ep}"] * (plan.ep != 1)


def phrase(plan: ParallelPlan, config: GPTConfig) -> str:
    if plan.ep == 1:
        return ""
    return f"{config.experts} experts cut over ep ({config.experts // plan.ep} a rank)"


def _has_experts(config: GPTConfig) -> bool:
    return bool(config.experts)


PART = Part(
    "expert parallelism",
    axes=(
        Axis(
            "ep",
            "C5",
            depth=1,
            batch=True,
            dense=True,
            splits_gradients=True,
            holds_weights=_has_experts,
        ),
    ),
    problems=problems,
    words=words,
    phrase=phrase,
    inside="ep's all-to-alls inside the MoE layers",
)

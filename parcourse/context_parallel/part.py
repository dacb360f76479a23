"""Context parallelism as a part of a run (`parcourse.parts`): the mesh's cp axis, each
sequence cut over its ranks (zigzag, two chunks a rank), attention over all of them by
`cp_method`. Its ranks hold the same weights and average every gradient with dp's
(Megatron-LM's cp_dp group); they take the same rows of the batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from parcourse.context_parallel.attention import METHODS, Method
from parcourse.part import Axis, Part

if TYPE_CHECKING:
    from parcourse.models import GPTConfig
    from parcourse.plan import ParallelPlan


@dataclass(frozen=True)
class ContextFields:
    """Context parallelism's fields in the plan."""

    cp: int = field(
        default=1, metadata={"help": "context-parallel ranks: each sequence cut over them"}
    )
    cp_method: Method = field(
        default="ring", metadata={"help": "how cp's ranks attend over the whole sequence"}
    )


def problems(plan: ParallelPlan, config: GPTConfig | None, step: bool) -> list[str]:
    """Context parallelism's rules (none at cp 1 but a known method)."""
    if plan.cp_method not in METHODS:
        return [
            f"unknown context-parallel method {plan.cp_method!r}; choose one of "
            f"{', '.join(METHODS)}"
        ]
    if plan.cp == 1:
        return []
    out = []
    if config is not None and config.block_size < 2 * plan.cp:
        out.append(
            f"cp {plan.cp} cuts a sequence into {2 * plan.cp} chunks (two a rank, "
            f"balanced for the causal mask): a block of {config.block_size} "
            "tokens cannot fill them"
        )
    if (
        config is not None
        and plan.cp_method == "ulysses"
        and config.n_heads % plan.tp == 0
        and (config.n_heads // plan.tp) % plan.cp
    ):
        out.append(
            f"Ulysses gives each of the cp {plan.cp} ranks whole heads: the "
            f"{config.n_heads // plan.tp} heads a tp rank holds ({config.n_heads} / "
            f"tp {plan.tp}) do not divide by {plan.cp}"
        )
    if config is not None and config.dropout:
        out.append(
            f"context parallelism's attention drops no probabilities: the GPT's "
            f"dropout must be 0, not {config.dropout}"
        )
    if step and plan.sequence_parallel:
        out.append(
            f"the course's 3D step cuts the sequence over tp (SP) or over cp "
            f"(cp {plan.cp}), not both"
        )
    return out


def words(plan: ParallelPlan) -> list[str]:
    return [f"cp{plan.cp}"] * (plan.cp != 1) + [plan.cp_method] * (plan.cp_method != "ring")


def read(word: str) -> dict[str, object] | None:
    return {"cp_method": word} if word in METHODS else None


def phrase(plan: ParallelPlan, config: GPTConfig) -> str:
    return f"the sequence cut over cp ({plan.cp_method})" if plan.cp > 1 else ""


PART = Part(
    "context parallelism",
    axes=(Axis("cp", "C4", depth=2, dense=True, experts=True),),
    problems=problems,
    words=words,
    read=read,
    phrase=phrase,
    inside="cp's messages inside attention",
)

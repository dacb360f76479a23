"""What a part is: one strategy's package as the rest of the library reads it (`Part`), and
the mesh axes it adds (`Axis`). The registry of every part is `parcourse.parts`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parcourse.models import GPTConfig
    from parcourse.plan import ParallelPlan


@dataclass(frozen=True)
class Axis:
    """A mesh axis that a part brings: its name on the mesh, its colour in every figure
    (matplotlib's cycle). `depth`: where it nests among the parts' axes,
    between dp and tp (a larger one is further in, nearer tp: Megatron-LM's
    "tp-cp-ep-dp-pp" puts cp inside ep). The roles (`parcourse.roles`): `batch`, its
    ranks take different rows of the batch, as dp's; `dense`, they hold the same dense
    weights and average their gradients; `experts`, they hold the same experts and
    average theirs; `splits_gradients`, they hold different gradients when the model has
    weights of this axis (`holds_weights`), so a gradient norm sums over them; `shards`,
    ZeRO shards over its ranks (and the parts' axes that average the same weights) and
    replicates the shards across dp's ranks, as FSDP2's HSDP."""

    name: str
    colour: str
    depth: int = 0
    batch: bool = False
    dense: bool = False
    experts: bool = False
    splits_gradients: bool = False
    shards: bool = False
    holds_weights: Callable[[GPTConfig], bool] | None = None


def _none(plan: ParallelPlan, config: GPTConfig | None, step: bool) -> list[str]:
    return []


def _no_words(plan: ParallelPlan) -> list[str]:
    return []


def _reads_nothing(word: str) -> dict[str, object] | None:
    return None


@dataclass(frozen=True)
class Part:
    """One strategy as the library reads it. `axes`: the mesh axes it adds (a core
    axis' part declares its own here too); `problems(plan, config, step)`: the rules of
    its plan fields, as `ParallelPlan.problems` lists them; `words(plan)`: its words in
    the plan's label (none at its defaults); `read(word)`: the fields a label's word
    sets (None: not one of its words); `phrase(plan, config)`: what it does in a run, for a
    banner ('' where it is off); `inside`: what of it runs inside a pipeline action, which
    simulated compute would pad away ('' for none)."""

    name: str
    axes: tuple[Axis, ...] = ()
    problems: Callable[[ParallelPlan, GPTConfig | None, bool], list[str]] = _none
    words: Callable[[ParallelPlan], list[str]] = _no_words
    read: Callable[[str], dict[str, object] | None] = _reads_nothing
    phrase: Callable[[ParallelPlan, GPTConfig], str] = lambda plan, config: ""
    inside: str = ""

"""The registry of parts: every strategy a run can compose, as the rest of the library reads it.

A part is one strategy's package seen from outside (`parcourse.part.Part`): the mesh axes
it adds (`parcourse.part.Axis`: its name, its colour in every figure, the roles its ranks
take, see `parcourse.roles`), its fields in the run's plan (a frozen
dataclass that `ParallelPlan` inherits), the rules that make those fields valid
(`problems`, one sentence each), its words in a plan's label and how to read them back,
and what the 3D step asks of it. The plan, the mesh, the roles, the planner, the
checkpoint code, the CLI and the figures loop over `PARTS` and `AXES` here; none of them
names an axis that a part brings.

Adding an axis: a package with a `part.py` that defines its `PART` (and its plan fields),
one line in `PARTS` and one base of `PartFields` below, then its tests, lesson and docs
(docs/design.md, "Adding an axis").

dp, tp and pp are the mesh every run has (`CORE_AXES`): the plan holds their sizes itself;
their packages declare them here all the same, so that their colour and meaning live in
one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parcourse.context_parallel.part import PART as context_parallel
from parcourse.context_parallel.part import ContextFields
from parcourse.data_parallel.part import PART as data_parallel
from parcourse.experts.part import PART as experts
from parcourse.experts.part import ExpertFields
from parcourse.part import Axis, Part
from parcourse.pipeline.part import PART as pipeline
from parcourse.tensor_parallel.part import PART as tensor_parallel
from parcourse.zero.part import PART as hierarchical_sharding
from parcourse.zero.part import ShardFields

if TYPE_CHECKING:
    from parcourse.comm import Network
    from parcourse.mesh import Mesh
    from parcourse.pipeline.simulate import SimulatedCompute
    from parcourse.plan import ParallelPlan

# The mesh every run has; the plan holds their sizes as its own fields.
CORE_PARTS = (data_parallel, tensor_parallel, pipeline)
# What a run may add, in the plan's order of their fields, rules and label words.
PARTS: tuple[Part, ...] = (context_parallel, experts, hierarchical_sharding)


@dataclass(frozen=True)
class PartFields(ShardFields, ExpertFields, ContextFields):
    """Every part's fields in the plan (`ParallelPlan` inherits them after its own): one
    base a part."""


# The plan's fields that the parts bring, in its order.
PART_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PartFields))
CORE_AXES: tuple[str, ...] = ("dp", "tp", "pp")
AXIS: dict[str, Axis] = {a.name: a for part in (*CORE_PARTS, *PARTS) for a in part.axes}
# The parts' axes, in the plan's order, and nested outermost first.
PART_AXES: tuple[str, ...] = tuple(a.name for part in PARTS for a in part.axes)
NESTED: tuple[str, ...] = tuple(sorted(PART_AXES, key=lambda a: AXIS[a].depth))
AXES: tuple[str, ...] = (*CORE_AXES, *PART_AXES)
# The mesh's orders, outermost first: Megatron-LM's default (pp outermost, tp innermost,
# as torchtitan and nanotron) and Llama 3's (dp outermost); the parts' axes between the
# data axis and tp in both.
ORDERS: dict[str, tuple[str, ...]] = {
    "megatron": ("pp", "dp", *NESTED, "tp"),
    "llama3": ("dp", "pp", *NESTED, "tp"),
}
# One colour an axis in every figure of the course (matplotlib's default cycle), in the
# order the figures stack them.
AXIS_COLORS: dict[str, str] = {a: AXIS[a].colour for a in ("dp", "pp", "tp", *PART_AXES)}


def inside_actions(plan: ParallelPlan) -> list[Part]:
    """The parts a plan uses (an axis of more than one rank) whose messages run inside a
    pipeline action: simulated compute, which pads each action to a set time, would hide
    them (`Hybrid(compute=)` refuses them)."""
    return [p for p in PARTS if p.inside and any(getattr(plan, a.name) > 1 for a in p.axes)]


def check_simulation(
    plan: ParallelPlan, mesh: Mesh, link: Network | None, compute: SimulatedCompute | None
) -> None:
    """Refuse a simulated network of another node size, and simulated compute where a
    part's messages run inside an action (they would be padded away as compute)."""
    from parcourse.comm import Topology

    if isinstance(link, Topology) and mesh.ranks_per_node not in (None, link.ranks_per_node):
        raise ValueError(
            f"the mesh says {mesh.ranks_per_node} ranks per node, the "
            f"simulated network {link.ranks_per_node}"
        )
    for part in inside_actions(plan) if compute is not None else []:
        raise ValueError(
            "simulated compute pads each action with tp's collectives on top; "
            f"{part.inside} would be padded away as compute: run {part.axes[0].name} with "
            "its compute real"
        )

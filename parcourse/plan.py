"""One run's parallel layout and strategies, as one frozen record: `ParallelPlan`.

    plan = ParallelPlan(dp=2, tp=2, pp=2, schedule="1f1b", microbatches=4, zero=1)
    plan.problems(config, batch=16, world=8)       # [] : it runs
    plan.label()                                   # 'dp2 tp2 pp2 1f1b m4 ZeRO-1'
    ParallelPlan.parse("dp2 tp2 pp2 1f1b m4 ZeRO-1") == plan

`problems()` is the one home of every rule that makes a run valid (torchtitan keeps its
layout in one dataclass validated once, `ParallelDims._validate`): each problem is one
sentence naming the numbers. The 3D step (`Hybrid`), `train`, the CLI (`train3d --plan`,
`train`, `plan`) and the planner's search all ask it, so they refuse the same things in
the same words, and the planner never ranks a plan the step refuses.

Two kinds of rule: what no implementation could run (tp not dividing the heads, a batch
that does not cut into dp x microbatches equal parts, more stages than layers), and what
the course's own 3D step does not run (`step=True`, the default): recompute of
attention's core alone ("selective", which the planner prices for real clusters as
Megatron-LM runs it) and Megatron-LM's "blocks" split. The planner asks with
`step=False` for the published clusters and with `step=True` for this machine, whose
plans it checks by running them.

The mesh every run has (dp, tp, pp) and the pipeline, ZeRO and recompute are this
record's own fields; every other part (`parcourse.parts`) brings its fields as a base of
`PartFields`, its rules (`Part.problems`, asked at their place in `problems()`) and its
words in the label (`Part.words`, `Part.read`). This module names none of them.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from parcourse.mesh import ORDERS, Layout, Mesh, Order, order_axes
from parcourse.parts import AXES, PART_AXES, PARTS, PartFields
from parcourse.pipeline.schedule import SCHEDULES, Schedule, schedule_by_name
from parcourse.roles import Roles

if TYPE_CHECKING:
    from parcourse.models import GPTConfig

Recompute = Literal["none", "selective", "full"]
Split = Literal["layers", "blocks"]
# Every one runs in the course's 3D step over dp (ZeRO-3 gathers a stage's weights around
# each of its actions, as torchtitan composes FSDP with a pipeline).
ZERO_STAGES = (0, 1, 2, 3)
SIZES = (*AXES, "microbatches", "chunks")


@functools.lru_cache(maxsize=4096)
def _schedule(name: str, ranks: int, microbatches: int, chunks: int) -> Schedule:
    """A named schedule, built once: a search asks for the same few thousand many times
    (only read)."""
    return schedule_by_name(name, ranks, microbatches, chunks)


def _help(text: str, default: Any) -> Any:
    """A field with what it means on a command line (`cli.options` makes its flag)."""
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class _Own:
    """The plan's own fields, before every part's (`PartFields`)."""

    dp: int = _help("data-parallel replicas", 1)
    tp: int = _help("tensor-parallel ranks", 1)
    pp: int = _help("pipeline ranks", 1)
    schedule: str = _help("the pipeline schedule", "1f1b")
    microbatches: int = _help("per replica", 1)
    chunks: int = _help("stages per rank, interleaved-1f1b", 2)
    zero: int = _help("ZeRO's stage over dp", 0)
    sequence_parallel: bool = _help("cut the sequence over tp outside attention and the MLP", False)
    recompute: Recompute = _help(
        "what backward recomputes (full: each stage keeps only its input)", "none"
    )
    split: Split = _help("how layers are cut into stages", "layers")
    order: Order | str = _help(
        "the mesh's order of axes: megatron, llama3, or the axes outermost first (tp,dp)",
        "megatron",
    )
    ranks_per_node: int | None = _help("consecutive ranks that share a node", None)


@dataclass(frozen=True)
class ParallelPlan(PartFields, _Own):
    """A run's layout: the mesh (dp x tp x pp and every part's axes, `order` of its axes,
    `ranks_per_node`), the pipeline `schedule` with its `microbatches` per replica and
    `chunks` (stages per rank, interleaved 1F1B), ZeRO's `zero` stage over dp,
    `sequence_parallel`, what backward recomputes (`recompute`: "none"; "selective",
    attention's core as Korthikanti et al. and FlashAttention; "full", each stage keeps
    only its input), and how the layers are cut into stages (`split`: "layers" as the
    course's step, by layer count with the embeddings and the head counting as layers;
    "blocks" as Megatron-LM, the blocks evenly with the embeddings on the first stage
    and the head on the last).
    Then every part's fields (`parcourse.parts.PartFields`; what each means is in its
    package's `part.py`): context parallelism's cp and cp_method, expert parallelism's
    ep, hierarchical sharding's dp_shard (HSDP).

    Nothing is checked on construction, so that a wrong plan can be shown with all its
    problems at once: `problems()` says what is wrong, `check()` raises it."""

    @classmethod
    def on_mesh(cls, mesh: Mesh, **fields: Any) -> ParallelPlan:
        """The plan of a mesh built already: its sizes, its order (a named one's where
        one fits, else its axes outermost first) and its ranks per node, with `fields`."""
        shape = {a: mesh.size(a) for a in AXES}
        named = (o for o in ORDERS if Layout.of(shape, o) == mesh.layout)
        given: dict[str, Any] = {**shape, **fields, "ranks_per_node": mesh.ranks_per_node}
        given["order"] = next(named, ",".join(mesh.layout.axes))
        return cls(**given)

    # -- the mesh it asks for

    @property
    def shape(self) -> dict[str, int]:
        """{axis: size} of every axis, the parts' included."""
        return {a: getattr(self, a) for a in AXES}

    @property
    def gpus(self) -> int:
        return math.prod(self.shape.values())

    @functools.cached_property
    def roles(self) -> Roles:
        """Which ranks do what together (`parcourse.roles`), derived once a plan: a
        search asks every candidate's many times."""
        return Roles.of(self)

    @property
    def replicas(self) -> int:
        """How many ways the batch is cut: the ranks that take different rows of it
        (`Roles.replicas`)."""
        return self.roles.replicas

    def _sizes(self) -> str:
        """'dp 2 x tp 2 x pp 2', and ' x cp 2' for each part's axis that is used."""
        more = "".join(f" x {a} {getattr(self, a)}" for a in PART_AXES if getattr(self, a) != 1)
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp}{more}"

    def schedule_value(self) -> Schedule:
        """The pipeline schedule this plan runs, built (a valid plan's)."""
        return _schedule(self.schedule, self.pp, self.microbatches, self.chunks)

    # -- the rules

    def problems(
        self,
        config: GPTConfig | None = None,
        batch: int | None = None,
        *,
        world: int | None = None,
        step: bool = True,
    ) -> list[str]:
        """Why this plan cannot run (empty if it can): one sentence each, naming the
        numbers. `config`, `batch` (the global batch, in sequences) and `world` (the ranks
        there are) add the rules that need them; `step`: also what the course's 3D step
        does not run (see the module)."""
        out = [
            f"{name} must be a whole number >= 1, got {getattr(self, name)!r}"
            for name in SIZES
            if not _whole(getattr(self, name))
        ]
        if self.ranks_per_node is not None and not _whole(self.ranks_per_node):
            out.append(f"ranks per node must be a whole number >= 1, got {self.ranks_per_node!r}")
        if out:  # the rules below divide by these sizes
            return out
        if world is not None and self.gpus != world:
            out.append(f"{self._sizes()} is {self.gpus} ranks, not the {world} there are")
        if self.ranks_per_node is not None and self.gpus % self.ranks_per_node:
            out.append(f"{self.ranks_per_node} ranks per node do not divide the {self.gpus} ranks")
        if why := _order_problem(self.order, self.shape):
            out.append(why)
        if config is not None and config.n_heads % self.tp:
            out.append(f"tp {self.tp} does not divide the {config.n_heads} heads")
        if config is not None and self.sequence_parallel and config.block_size % self.tp:
            out.append(
                f"tp {self.tp} does not divide the sequence of {config.block_size} "
                "tokens (sequence parallelism cuts it)"
            )
        for part in PARTS:
            out += part.problems(self, config, step)
        if batch is not None and batch % (self.replicas * self.microbatches):
            cut = "".join(f" x {a} {getattr(self, a)}" for a in self.roles.batch[1:])
            out.append(
                f"the global batch of {batch} does not cut into dp {self.dp}{cut} x "
                f"{self.microbatches} microbatches equal parts"
            )
        if self.zero not in ZERO_STAGES:
            out.append(f"ZeRO stage {self.zero!r} does not exist: 0, 1, 2 or 3")
        if self.recompute not in ("none", "selective", "full"):
            out.append(f"recompute {self.recompute!r} is none of none, selective, full")
        elif step and self.recompute == "selective":
            out.append(
                "the course's 3D step recomputes whole stages (recompute full), not "
                "attention's core alone (selective)"
            )
        if self.split not in ("layers", "blocks"):
            out.append(f"split {self.split!r} is neither layers nor blocks")
        elif step and self.split == "blocks":
            out.append(
                "the course's 3D step cuts stages by layer count (split layers), not "
                "Megatron-LM's blocks"
            )
        out += self._schedule_problems(config)
        return out

    def _schedule_problems(self, config: GPTConfig | None) -> list[str]:
        if self.schedule not in SCHEDULES:
            return [f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}"]
        if not SCHEDULES[self.schedule].microbatched and self.microbatches != 1:
            return [
                f"{self.schedule} runs the batch whole: one microbatch, not {self.microbatches}"
            ]
        try:
            schedule = self.schedule_value()
        except ValueError as e:
            return [str(e)]
        out = []
        if schedule.copy_of or schedule.routes:
            out.append(
                f"{self.schedule} holds two copies of every stage, one for each "
                "direction: the 3D step and the planner run the other schedules "
                "(dualpipe-v holds one copy)"
            )
        layers = None if config is None else config.n_layers + 2
        if layers is not None and schedule.stages > layers:
            out.append(
                f"{self.schedule} on pp {self.pp} has {schedule.stages} stages; the "
                f"GPT's {layers} layers (embedding, {layers - 2} blocks, head) cannot "
                "fill them"
            )
        if config is not None and self.split == "blocks" and config.n_layers % schedule.stages:
            out.append(f"{schedule.stages} stages do not split {config.n_layers} blocks evenly")
        if self.recompute == "full" and schedule.splits_backward:
            out.append(f"{self.schedule} splits backward into I and W: no full recompute")
        return out

    def check_mesh(self, layout: Layout, ranks_per_node: int | None) -> None:
        """ValueError unless a mesh of this `layout` and `ranks_per_node` is this plan's."""
        want = Layout.of(self.shape, self.order)
        if want != layout:
            raise ValueError(
                f"the plan {self.label()} lays ranks out as {want.axes} {want.sizes}, the "
                f"mesh as {layout.axes} {layout.sizes}"
            )
        if self.ranks_per_node != ranks_per_node:
            raise ValueError(
                f"the plan says {self.ranks_per_node} ranks per node, the mesh {ranks_per_node}"
            )

    def check(
        self,
        config: GPTConfig | None = None,
        batch: int | None = None,
        *,
        world: int | None = None,
        step: bool = True,
    ) -> ParallelPlan:
        """This plan, or ValueError with every problem (`problems`), one per line."""
        if problems := self.problems(config, batch, world=world, step=step):
            raise ValueError("; ".join(problems))
        return self

    # -- as text

    def label(self) -> str:
        """One line: 'dp2 tp2 pp2 1f1b m4 ZeRO-1 SP recompute full'; what is at its
        default (chunks 2, layers split, megatron order, no ranks per node) is left out.
        `parse` reads it back."""
        extra = [word for part in PARTS for word in part.words(self)]
        extra += [f"c{self.chunks}"] if self.chunks != 2 else []
        extra += [f"ZeRO-{self.zero}"] if self.zero else []
        extra += ["SP"] if self.sequence_parallel else []
        extra += [f"recompute {self.recompute}"] if self.recompute != "none" else []
        extra += [f"split {self.split}"] if self.split != "layers" else []
        extra += [f"order {self.order}"] if self.order != "megatron" else []
        extra += [f"{self.ranks_per_node}/node"] if self.ranks_per_node is not None else []
        return (
            f"dp{self.dp} tp{self.tp} pp{self.pp} {self.schedule} m{self.microbatches}"
            + "".join(f" {e}" for e in extra)
        )

    @classmethod
    def parse(cls, text: str) -> ParallelPlan:
        """A plan from its label, in any order of its words ('dp2 tp2 pp2 1f1b m4
        ZeRO-1'); what it leaves out takes the default. ValueError naming the word it
        cannot read."""
        fields: dict[str, object] = {}
        words = text.split()
        i = 0
        while i < len(words):
            word, low = words[i], words[i].lower()
            if m := re.fullmatch(rf"({'|'.join(AXES)}|m|c)(\d+)", low):
                key = {"m": "microbatches", "c": "chunks"}.get(m.group(1), m.group(1))
                fields[key] = int(m.group(2))
            elif m := re.fullmatch(r"zero-?(\d+)", low):
                fields["zero"] = int(m.group(1))
            elif low == "sp":
                fields["sequence_parallel"] = True
            elif m := re.fullmatch(r"(\d+)/node", low):
                fields["ranks_per_node"] = int(m.group(1))
            elif low in ("recompute", "split", "order") and i + 1 < len(words):
                fields[low] = words[i + 1].lower()
                i += 1
            elif low in SCHEDULES:
                fields["schedule"] = low
            elif read := next((r for part in PARTS if (r := part.read(low)) is not None), None):
                fields.update(read)
            else:
                raise ValueError(
                    f"cannot read {word!r} in the plan {text!r}; a plan reads "
                    "like 'dp2 tp2 pp2 1f1b m4 ZeRO-1 SP' (schedules: "
                    f"{', '.join(SCHEDULES)})"
                )
            i += 1
        return cls(**fields)  # type: ignore[arg-type]  # each value read for its own field

    def __str__(self) -> str:
        return self.label()


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _order_problem(order: str, shape: Mapping[str, int]) -> str | None:
    """Why `order` cannot lay out `shape` (None: it can): a named order, or every axis
    of the mesh once, outermost first."""
    if not isinstance(order, str):
        return f"the order must be a name or axes joined by commas, got {order!r}"
    try:
        axes = order_axes(order)
    except ValueError as e:
        return str(e)
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        return f"the order {order!r} names {', '.join(unknown)}; the axes are {', '.join(AXES)}"
    if len(set(axes)) < len(axes):
        return f"the order {order!r} names an axis twice"
    missing = [a for a, size in shape.items() if size > 1 and a not in axes]
    if missing:
        return f"the order {order!r} has no place for {', '.join(missing)}"
    return None

"""The parts registry (`parcourse.parts`) and the roles derived from a plan (`parcourse.roles`):
every axis a part brings is declared once, in its own package, and read from the registry
everywhere else; the roles equal what the 3D step averaged over before they had a home,
worked by hand here."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from parcourse import mesh, parts, plots
from parcourse.data_parallel.stages import BucketedStages
from parcourse.models import GPTConfig
from parcourse.plan import ParallelPlan
from parcourse.roles import Roles
from parcourse.zero.stages import ShardedStages

LIBRARY = Path(__file__).parent.parent / "parcourse"
# Outside its own package, theory/ and experiments/, a part's axis may be named by the
# composer (the 3D step, which applies each part by name) and by the planner's predictor,
# which prices each part's messages and memory against its own inputs (its record of a
# step, its cost model): those sit above the strategies, so the prices cannot move into
# the strategies' packages without arrows pointing up.
ALLOWED = {"hybrid.py", "planner/predict.py"}


def _package_of(part: parts.Part) -> Path:
    """The package whose part.py defines `part`."""
    for path in LIBRARY.glob("*/part.py"):
        module = importlib.import_module(f"parcourse.{path.parent.name}.part")
        if module.PART is part:
            return path.parent
    raise AssertionError(f"{part.name} is defined in no package's part.py")


@pytest.mark.parametrize("part", parts.PARTS, ids=lambda p: p.name)
def test_only_the_composer_names_a_parts_axis_outside_its_package(part):
    """`"cp"`, `'cp'` or `.cp` (and the same for every axis a part brings) appear in no
    library file outside the part's package, `theory/` and `experiments/` but the
    composer's: the plan, mesh, roles, planner, checkpoint, CLI and figures read the
    registry."""
    home = _package_of(part)
    for axis in part.axes:
        named = re.compile(rf"([\"']){axis.name}\1|\.{axis.name}\b")
        found = set()
        for path in LIBRARY.rglob("*.py"):
            inside = path.relative_to(LIBRARY)
            if path.is_relative_to(home) or inside.parts[0] in ("theory", "experiments"):
                continue
            if named.search(path.read_text()):
                found.add(str(inside))
        assert found <= ALLOWED, f"{axis.name} named in {sorted(found - ALLOWED)}"


def test_every_axis_declared_once_with_a_colour_of_its_own():
    names = [a.name for part in (*parts.CORE_PARTS, *parts.PARTS) for a in part.axes]
    assert len(names) == len(set(names)) and set(names) == set(parts.AXES)
    colours = list(parts.AXIS_COLORS.values())
    assert len(colours) == len(set(colours)) and set(parts.AXIS_COLORS) == set(parts.AXES)
    assert plots.AXIS_COLORS is parts.AXIS_COLORS and mesh.AXES is parts.AXES
    for order in parts.ORDERS.values():
        assert sorted(order) == sorted(parts.AXES)
    # Megatron-LM's "tp-cp-ep-dp-pp", innermost first, and Llama 3's "[TP, CP, PP, DP]"
    # (HSDP's dp_shard just inside dp, as torchtitan's ["pp", "dp_replicate", "dp_shard",
    # "cp", "tp"])
    assert parts.ORDERS["megatron"] == ("pp", "dp", "dp_shard", "ep", "cp", "tp")
    assert parts.ORDERS["llama3"] == ("dp", "pp", "dp_shard", "ep", "cp", "tp")


def test_the_plan_holds_every_parts_fields_and_reads_its_words_back():
    fields = {f.name: f for f in dataclasses.fields(ParallelPlan)}
    for name in (*parts.PART_AXES, *parts.PART_FIELDS):
        assert name in fields and fields[name].metadata["help"], name
    for axis in parts.PART_AXES:
        assert fields[axis].default == 1, axis
    plan = ParallelPlan(dp=2, cp=2, cp_method="ulysses", ep=2, dp_shard=3, microbatches=2)
    assert ParallelPlan.parse(plan.label()) == plan
    assert plan.shape == {"dp": 2, "tp": 1, "pp": 1, "cp": 2, "ep": 2, "dp_shard": 3}
    assert plan.gpus == 24


def test_roles_worked_by_hand():
    """The groups of lesson 09's table: the dense replicas are dp's, ep's and cp's (in the
    mesh's nesting order, as "dp-ep-cp"), the experts' dp's and cp's; the norm sums over
    the ranks whose gradients differ, and under ZeRO over the dense replicas too; the
    batch is cut over dp and ep."""
    moe = GPTConfig(experts=4)
    r = Roles.from_sizes({"dp": 2, "tp": 2, "pp": 2})
    assert (r.batch, r.dense, r.experts, r.norm) == (("dp",),) * 3 + (("tp", "pp"),)
    assert r.replicas == 2 and r.loss == ("dp",)
    r = Roles.from_sizes({"dp": 2, "cp": 2}, zero=1)
    assert (r.batch, r.dense, r.experts) == (("dp",), ("dp", "cp"), ("dp", "cp"))
    assert r.norm == ("dp", "cp", "tp", "pp") and r.replicas == 2 and r.size("dense") == 4
    r = Roles.from_sizes({"dp": 2, "ep": 2, "cp": 2}, config=moe)
    assert (r.batch, r.dense, r.experts) == (("dp", "ep"), ("dp", "ep", "cp"), ("dp", "cp"))
    assert r.norm == ("tp", "pp", "ep") and r.replicas == 4 and r.label("dense") == "dp-ep-cp"
    # which rows a rank takes: dp's coordinate, and inside it ep's
    assert [r.index({"dp": d, "ep": e, "cp": 1}) for d in (0, 1) for e in (0, 1)] == [0, 1, 2, 3]
    # a GPT without experts: ep's ranks hold the same gradients, so the norm skips them
    assert Roles.from_sizes({"ep": 2}, config=GPTConfig()).norm == ("tp", "pp")
    assert ParallelPlan(dp=2, ep=2).replicas == 4 == ParallelPlan(dp=2, ep=2).roles.replicas
    # HSDP: ZeRO's slices over dp_shard (and the parts' axes averaging the same weights),
    # replicated across dp; the norm sums each slice once
    r = Roles.from_sizes({"dp": 2, "dp_shard": 2, "ep": 2}, zero=3, config=moe)
    assert (r.shard, r.replicate, r.expert_shard) == (("dp_shard", "ep"), ("dp",), ("dp_shard",))
    assert r.batch == ("dp", "dp_shard", "ep") and r.norm == ("dp_shard", "ep", "tp", "pp")
    assert Roles.from_sizes({"dp": 2}).shard == ("dp",) == Roles.from_sizes({"dp": 2}).dense


def test_both_gradient_syncs_answer_the_same_moments():
    """Lesson 02's buckets and ZeRO's units over a pipeline's stages: the same calls."""
    moments = ("on_weight_gradients", "around", "finalize", "step", "gradients", "held")
    for name in (*moments, "whole_weights", "check"):
        assert hasattr(BucketedStages, name) and hasattr(ShardedStages, name), name


def test_functions_a_reader_can_hold():
    """No function in the library over 80 lines (as formatted), and the 3D step, which
    composes every part, in at most 350: what a change that threads an axis through the
    step instead of plugging it in would break first."""
    import ast

    long = []
    for path in LIBRARY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if function and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{path.relative_to(LIBRARY)}:{node.name}")
    assert long == []
    assert len((LIBRARY / "hybrid.py").read_text().splitlines()) <= 350

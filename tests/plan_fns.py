"""Rank functions for the plan's tests (importable by name in the ranks)."""

from parcourse.hybrid import Hybrid
from parcourse.mesh import Mesh
from parcourse.models import GPTConfig, gpt

CONFIG = GPTConfig(vocab=64, block_size=16, n_layers=4, n_heads=4, d_model=32)


def from_plan_refusals(ctx):
    """What `Hybrid.from_plan` says to a keyword the plan holds and to a plan of 2 ranks,
    on one rank."""
    said = []
    mesh = Mesh({"dp": 1}, ctx.group)
    for label, kwargs in (("dp1 tp1 pp1 1f1b m1", {"zero": 1}), ("dp2 1f1b m1", {})):
        try:
            Hybrid.from_plan(gpt(CONFIG), mesh, label, **kwargs)
            said.append(None)
        except ValueError as e:
            said.append(str(e))
    return said


def hybrid_keyword_refusals(ctx, cases):
    """What `Hybrid(model, mesh, **keywords)` says to each of `cases` (a shape and its
    keywords) on these ranks: None where it builds."""
    said = []
    for shape, kwargs in cases:
        try:
            Hybrid(gpt(CONFIG), Mesh(shape, ctx.group), **kwargs)
            said.append(None)
        except ValueError as e:
            said.append(str(e))
    return said

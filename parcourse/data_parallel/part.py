"""Data parallelism as a part of a run (`parcourse.parts`): the mesh's dp axis, whose ranks
each take their own rows of the batch and average every gradient."""

from __future__ import annotations

from parcourse.part import Axis, Part

PART = Part(
    "data parallelism",
    axes=(Axis("dp", "C0", batch=True, dense=True, experts=True),),
)

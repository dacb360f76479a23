"""Pipeline parallelism as a part of a run (`parcourse.parts`): the mesh's pp axis, whose
ranks each hold their own stages of the model (and so different gradients)."""

from __future__ import annotations

from parcourse.part import Axis, Part

PART = Part(
    "pipeline parallelism",
    axes=(Axis("pp", "C1", splits_gradients=True),),
)

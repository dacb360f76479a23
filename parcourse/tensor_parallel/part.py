"""Tensor parallelism as a part of a run (`parcourse.parts`): the mesh's tp axis, whose
ranks each hold a slice of every weight it cuts (and so different gradients)."""

from __future__ import annotations

from parcourse.part import Axis, Part

PART = Part(
    "tensor parallelism",
    axes=(Axis("tp", "C2", splits_gradients=True),),
)

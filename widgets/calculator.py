"""A ZeRO memory calculator: parameters, world size, stage, dtype -> bytes per rank.

Pure arithmetic (parcourse.theory.zero_bytes), recomputed as the sliders move;
computed once when made, so a headless run exercises the same path.
"""

from __future__ import annotations

import html

import ipywidgets as W
import torch
from IPython.display import display

from parcourse.memory import format_bytes
from parcourse.theory import zero_bytes


class MemoryCalculator:
    def __init__(self, params_billions: float = 7.0, world_size: int = 8, stage: int = 0,
                 dtype: str = "bf16 + fp32 master") -> None:
        self.params = W.FloatLogSlider(value=params_billions, base=10, min=-3, max=3,
                                       description="params (B)")
        self.world = W.IntSlider(value=world_size, min=1, max=1024, description="world size")
        self.stage = W.ToggleButtons(options=[0, 1, 2, 3], value=stage, description="ZeRO stage")
        self.dtype = W.ToggleButtons(options=["fp32", "bf16 + fp32 master"], value=dtype,
                                     description="precision")
        self.out = W.HTML()
        for control in (self.params, self.world, self.stage, self.dtype):
            control.observe(lambda _: self.update(), names="value")
        self.widget = W.VBox([self.params, self.world, self.stage, self.dtype, self.out])
        self.update()

    def bytes_per_rank(self) -> dict[str, float]:
        dtype = torch.float32 if self.dtype.value == "fp32" else torch.bfloat16
        return zero_bytes(int(self.params.value * 1e9), self.world.value, self.stage.value, dtype)

    def update(self) -> None:
        per = self.bytes_per_rank()
        rows = "".join(f"<tr><td>{html.escape(k)}</td><td style='text-align:right'>"
                       f"{format_bytes(v)}</td></tr>" for k, v in per.items())
        total = format_bytes(sum(per.values()))
        self.out.value = (f"<table>{rows}<tr><td><b>total per rank</b></td>"
                          f"<td style='text-align:right'><b>{total}</b></td></tr></table>"
                          "<small>plus activations and temporary buffers</small>")

    def _ipython_display_(self) -> None:
        display(self.widget)

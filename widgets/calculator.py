"""A ZeRO memory calculator: parameters, world size, stage, dtype -> bytes per rank.

Pure arithmetic (parcourse.theory.zero_bytes), redrawn as the controls change:
a bar per category and the total, beside the memory of real GPUs. Computed once
when made, so a headless run exercises the same path.
"""

from __future__ import annotations

import html

import ipywidgets as W
import torch
from IPython.display import display
from matplotlib.figure import Figure
from parcourse.widgets.outputs import show

from parcourse import plots
from parcourse.memory import format_bytes
from parcourse.theory import zero_bytes

WORLD_SIZES = [2**k for k in range(11)]  # 1 .. 1024: how clusters grow


class MemoryCalculator:
    """ZeRO's bytes per rank for a model of `params_billions` on `world_size` ranks at
    `stage`, in `dtype` (fp32, or bf16 with fp32 masters): controls and a chart, redrawn
    as they change (lesson 03). Display it as a cell's last value."""

    def __init__(
        self,
        params_billions: float = 7.0,
        world_size: int = 8,
        stage: int = 0,
        dtype: str = "bf16 + fp32 master",
    ) -> None:
        if world_size not in WORLD_SIZES:
            raise ValueError(f"world_size must be a power of two from 1 to 1024, got {world_size}")
        # A text box, not a log slider: a slider snaps 7 to its nearest step (6.31).
        self.params = W.FloatText(value=params_billions, step=0.1, description="params (B)")
        self.world = W.Dropdown(options=WORLD_SIZES, value=world_size, description="world size")
        self.stage = W.ToggleButtons(options=[0, 1, 2, 3], value=stage, description="ZeRO stage")
        self.dtype = W.ToggleButtons(
            options=["fp32", "bf16 + fp32 master"], value=dtype, description="precision"
        )
        self.out = W.HTML()
        self.chart = W.Output()
        self.figure: Figure | None = None
        for control in (self.params, self.world, self.stage, self.dtype):
            control.observe(lambda _: self.update(), names="value")
        self.widget = W.VBox(
            [self.params, self.world, self.stage, self.dtype, self.out, self.chart]
        )
        self.update()

    def bytes_per_rank(self) -> dict[str, float]:
        dtype = torch.float32 if self.dtype.value == "fp32" else torch.bfloat16
        return zero_bytes(round(self.params.value * 1e9), self.world.value, self.stage.value, dtype)

    def update(self) -> None:
        if not self.params.value > 0:
            self.out.value = "<span style='color:#b00'>type a number of parameters above 0</span>"
            return
        per = self.bytes_per_rank()
        total = sum(per.values())
        fits = [
            f"{name} ({size:g} GB)"
            for name, size in plots.GPU_MEMORY_GB.items()
            if total <= size * 1024**3
        ]
        where = f"fits on {', '.join(fits)}" if fits else "fits on none of these GPUs"
        self.out.value = (
            f"<b>total per rank: {format_bytes(total)}</b> "
            f"({html.escape(where)}), plus activations and temporary buffers"
        )
        n = self.world.value
        title = (
            f"{self.params.value:g} B parameters, {self.dtype.value}, ZeRO stage "
            f"{self.stage.value}, {n} rank{'s' * (n > 1)}"
        )
        self.figure = plots.memory_against_gpus(per, title=title)
        show(self.chart, self.figure)

    def _ipython_display_(self) -> None:
        display(self.widget)

"""The planner as a panel (lesson 09, part 2): model size, GPUs, GPU type, links, global
batch and sequence -> the ranked configurations, the busiest rank's memory against the
GPU's, the predicted step split into compute / tp / bubble / dp, and MFU.

Pure prediction (parcourse.planner), no ranks: a Plan button reruns it (a large cluster
takes a few seconds to search). Computed once when made, so a headless run exercises the
same path.
"""

from __future__ import annotations

import dataclasses
import html
import time

import ipywidgets as W
from IPython.display import HTML, display
from parcourse.widgets.outputs import show

from parcourse.comm import SimulatedLink
from parcourse.experiments import figures
from parcourse.planner import MODELS, Cluster, format_plans, model, parameters, plan

GPUS = [8, 16, 32, 64, 128, 256, 512]


class PlannerPanel:
    """The planner on a published cluster (lesson 09): `model_name` of Narayanan et al.'s
    table on `gpus` GPUs of type `gpu`, a global `batch` of sequences of `seq` tokens; the
    `top` plans ranked with their memory and step split, redrawn by its Plan button."""

    def __init__(
        self,
        model_name: str = "13B",
        gpus: int = 32,
        gpu: str = "h100",
        batch: int = 256,
        seq: int = 4096,
        top: int = 6,
    ) -> None:
        if model_name not in MODELS:
            raise ValueError(f"unknown model {model_name!r}; choose one of {', '.join(MODELS)}")
        if gpus not in GPUS:
            raise ValueError(f"gpus must be one of {GPUS}, got {gpus}")
        style = {"description_width": "150px"}  # "between nodes GB/s" whole
        self.model = W.Dropdown(
            options=list(MODELS), value=model_name, description="model", style=style
        )
        self.gpus = W.Dropdown(options=GPUS, value=gpus, description="GPUs", style=style)
        self.gpu = W.ToggleButtons(
            options=["a100", "h100", "h200"], value=gpu, description="GPU", style=style
        )
        self.between = W.FloatText(
            value=Cluster.PRESETS[gpu][3], description="between nodes GB/s", style=style
        )
        self.batch = W.IntText(value=batch, description="global batch (seqs)", style=style)
        self.seq = W.Dropdown(
            options=[1024, 2048, 4096, 8192], value=seq, description="sequence", style=style
        )
        self.top = top
        self.button = W.Button(description="Plan", button_style="primary", icon="play")
        self.status = W.HTML()
        self.out = W.Output()
        self.text = ""
        self.button.on_click(lambda _: self.update())
        self.widget = W.VBox(
            [
                self.model,
                self.gpus,
                self.gpu,
                self.between,
                self.batch,
                self.seq,
                W.HBox([self.button, self.status]),
                self.out,
            ]
        )
        self.update()

    def update(self) -> None:
        if self.batch.value < 1 or not self.between.value > 0:
            self._refuse("the batch and the bandwidth must be above 0")
            return
        start = time.perf_counter()
        self.button.disabled = True
        self.status.value = "planning…"
        try:
            config = model(self.model.value, self.seq.value)
            preset = Cluster.preset(self.gpu.value, self.gpus.value)
            cluster = dataclasses.replace(
                preset, between=SimulatedLink.of(preset.between.latency_s * 1e6, self.between.value)
            )
            plans = plan(config, cluster, self.batch.value, dtype="bf16")
            self.text = format_plans(plans, self.top)
            title = (
                f"{self.model.value} ({parameters(config) / 1e9:.1f}B) on "
                f"{self.gpus.value} x {self.gpu.value}, batch {self.batch.value} x "
                f"{self.seq.value} tokens"
            )
            fig = figures.plan_bars(plans, cluster.memory, top=self.top, title=title)
            # the table as it is, one row a line (scrolled sideways, never wrapped)
            table = HTML(
                "<pre style='white-space: pre; overflow-x: auto; margin: 0'>"
                f"{html.escape(self.text)}</pre>"
            )
            show(self.out, table, fig)
            self.status.value = html.escape(
                f"{len(plans.ranked) + len(plans.rejected)} configurations in "
                f"{time.perf_counter() - start:.1f} s"
            )
        except ValueError as e:  # an input the planner refuses, in its words
            self._refuse(str(e))
        finally:
            self.button.disabled = False

    def _refuse(self, why: str) -> None:
        """Say why, and take the last result away: it answered other inputs."""
        self.text = ""
        show(self.out)
        self.status.value = f"<span style='color:#b00'>{html.escape(why)}</span>"

    def _ipython_display_(self) -> None:
        display(self.widget)

"""A reusable run panel: controls -> Run -> live progress -> figures and a summary.

    panel = RunPanel(
        show_collective,                         # a rank function from parcourse
        controls={"op": Dropdown(options=COLLECTIVES), "numel": IntSlider(4, 1, 8)},
        render=lambda run, op, numel: plots.tensors_before_after(...),
        world_size=4,
    )
    panel                                        # shows it; it has already run once

Each control's value is passed to the rank function and to `render` under the
control's name; a control named `world_size` picks the pool. `fixed` values go
to the rank function too (e.g. the lesson's model and step count), and the panel
lists them under its title, so that what it runs is on screen. The first run
happens when the panel is made, so a notebook executed headless (CI) runs the
same path a learner's click does; a failure of that first run raises, so that a
broken panel fails the notebook instead of hiding in its output. Failures after
a click are shown in the panel.

`check(world_size=, **arguments)` runs before any rank starts: it raises ValueError
for a choice that cannot run (shown in one line), and may return a dict of the
arguments the ranks get instead of the controls' values: e.g. the `Schedule` built
once from the schedule's name, so that ranks receive the value, never a name to
rebuild. `render` still gets the controls' values.
"""

from __future__ import annotations

import html
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ipywidgets as W
from IPython.display import HTML, display
from matplotlib.figure import Figure
from parcourse.widgets.explorer import SpanExplorer
from parcourse.widgets.outputs import show

from parcourse import LaunchError, Pool, Run
from parcourse.launch import group_ranks
from parcourse.launch.shared import shared_pool

Rendered = str | Figure | Iterable[str | Figure] | None
_WHY_SLOW = (
    "a new world size: the first run starts the ranks, each imports torch and joins "
    "the process group; later runs reuse them"
)


class RunPanel:
    """Controls, a Run button, progress while ranks work, then results."""

    def __init__(
        self,
        rank_fn: Callable[..., Any],
        controls: Mapping[str, W.ValueWidget] | None = None,
        render: Callable[..., Rendered] | None = None,
        *,
        world_size: int = 2,
        pool: Pool | None = None,
        check: Callable[..., Mapping[str, Any] | None] | None = None,
        fixed: Mapping[str, Any] | None = None,
        title: str = "",
        timeout: float = 60.0,
        run_now: bool = True,
    ) -> None:
        self.rank_fn, self.render, self.check = rank_fn, render, check
        self.controls = dict(controls or {})
        for control in self.controls.values():  # room for long labels ("microbatches")
            if hasattr(getattr(control, "style", None), "description_width"):
                control.style.description_width = "initial"
        self.fixed = dict(fixed or {})
        # Each control's value at the last run: a clamp note only for a value moved since.
        self._initial = {name: c.value for name, c in self.controls.items()}
        self.world_size, self.pool, self.timeout = world_size, pool, timeout
        self.last_run: Run | None = None
        self.last_error: str | None = None
        self.summary: str = ""
        self.button = W.Button(description="Run", button_style="primary", icon="play")
        self.status = W.HTML()
        self.output = W.Output()
        self.explorer = SpanExplorer()
        self.title = title
        self.button.on_click(lambda _: self.run())
        header = [W.HTML(f"<b>{html.escape(title)}</b>")] if title else []
        if self.fixed:
            runs = ", ".join(
                f"{k} = {v:g}" if isinstance(v, float) else f"{k} = {v}"
                for k, v in self.fixed.items()
            )
            header.append(W.HTML(f"<small>runs with {html.escape(runs)}</small>"))
        self.widget = W.VBox(
            [
                *header,
                *self.controls.values(),
                W.HBox([self.button, self.status]),
                self.output,
                self.explorer.widget,
            ]
        )
        if run_now:
            self.run(raise_errors=True)

    def _ipython_display_(self) -> None:
        display(self.widget)

    def params(self) -> dict[str, Any]:
        return {name: control.value for name, control in self.controls.items()}

    def _pool_for(self, world_size: int) -> Pool:
        if self.pool is not None and self.pool.world_size == world_size:
            return self.pool
        return shared_pool(world_size)

    def _show_progress(self, pool: Pool, t0: float, statuses: list[str]) -> None:
        """What the ranks are doing, one line per distinct status."""
        n, elapsed = len(statuses), time.perf_counter() - t0
        if pool.starting:
            ready = statuses.count("ready")
            head = f"starting {n} rank{'s' * (n > 1)}… {elapsed:.1f} s, {ready} ready ({_WHY_SLOW})"
            busy = {r: s for r, s in enumerate(statuses) if s != "ready"}
        else:
            head = (
                f"running… {elapsed:.1f} s, {statuses.count('done')} of {n} "
                f"rank{'s' * (n != 1)} done"
            )
            busy = {r: s for r, s in enumerate(statuses) if s != "done"}
        rows = "".join(f"<br>&nbsp;&nbsp;{html.escape(line)}" for line in group_ranks(busy))
        self.status.value = f"<span>{html.escape(head)}{rows}</span>"

    def run(self, raise_errors: bool = False) -> Run | None:
        """What the button does: run on real ranks, then show results or the error."""
        params = self.params()
        rank_kwargs = {**self.fixed, **{k: v for k, v in params.items() if k != "world_size"}}
        world_size = params.get("world_size", self.world_size)
        self.button.disabled = True
        self.last_error = None
        show(self.output)  # the last run's figures or error go: this run is new
        t0 = time.perf_counter()
        try:
            if self.check is not None:
                built = self.check(world_size=world_size, **rank_kwargs)
                rank_kwargs = {**rank_kwargs, **(built or {})}
            pool = self._pool_for(world_size)
            self.status.value = html.escape(
                "running…"
                if pool.alive
                else f"starting {world_size} rank{'s' * (world_size != 1)}… ({_WHY_SLOW})"
            )
            run = pool.run(
                self.rank_fn,
                timeout=self.timeout,
                on_progress=lambda s, _: self._show_progress(pool, t0, s),
                **rank_kwargs,
            )
            self.last_run = run
            started = (
                f", of which {run.startup_s:.1f} s starting the ranks"
                if run.startup_s >= 0.05
                else ""
            )
            notes = "".join(f"<br>{html.escape(n)}" for n in self._clamped())
            self._initial = dict(params)
            # The ranks are done, the figures not yet: say so until they are drawn.
            self.status.value = html.escape(f"ranks done in {run.wall_s * 1e3:.0f} ms; drawing…")
            self._show(run, params)
            self.explorer.show(run.trace, self.title or getattr(self.rank_fn, "__name__", ""))
            self.status.value = (
                f"{world_size} rank{'s' * (world_size > 1)}, {run.backend}: "
                f"{run.wall_s * 1e3:.0f} ms{started} (panel, drawing included: "
                f"{1e3 * (time.perf_counter() - t0):.0f} ms){notes}"
            )
            return run
        except (LaunchError, ValueError) as e:
            self._fail(f"{type(e).__name__}: {e}")
            if raise_errors:
                raise
        except Exception:  # noqa: BLE001 - a bug in render must not kill the panel
            self._fail(traceback.format_exc())
            if raise_errors:
                raise
        finally:
            self.button.disabled = False
        return None

    def edges(self) -> list[tuple[str, Any]]:
        """Each control's two ends: a slider's min and max, a list's first and last
        option, both states of a checkbox (what `try_edges` runs)."""
        ends = []
        for name, control in self.controls.items():
            if isinstance(control, W.Checkbox):
                values: list[Any] = [False, True]
            elif hasattr(control, "base"):  # a log slider: min and max are exponents
                values = [control.base**control.min, control.base**control.max]
            elif hasattr(control, "min") and hasattr(control, "max"):
                values = [control.min, control.max]
            elif getattr(control, "options", None):
                values = [control.options[0], control.options[-1]]
                values = [v[1] if isinstance(v, tuple) else v for v in values]
            else:
                continue
            unique = [v for k, v in enumerate(values) if v not in values[:k]]  # dicts too
            ends += [(name, v) for v in unique if v != control.value]
        return ends

    def try_edges(self, start: Mapping[str, Any] | None = None) -> list[str]:
        """Run the panel with each control at each of its ends, one at a time, from
        `start` (values for some controls; the others keep their current values), which
        runs first where it moves a control; every value is restored after. Returns what
        went wrong, one line per failure. A refusal before any rank starts (the panel's
        `check`: a ValueError in one line) is a right answer; a traceback, or a rank
        that failed, is not."""
        current = {name: c.value for name, c in self.controls.items()}
        unknown = sorted(set(start or {}) - set(current))
        if unknown:
            raise ValueError(
                f"no control named {', '.join(unknown)}; the panel has {', '.join(current)}"
            )
        base = {**current, **(start or {})}
        problems: list[str] = []

        def attempt(what: str) -> None:
            self.run()
            error = self.last_error
            if error is not None and not (
                error.startswith("ValueError: ") and "\n" not in error.strip()
            ):
                problems.append(
                    f"{self.title or 'panel'}, {what}: {error.strip().splitlines()[-1]}"
                )

        try:
            for name, value in base.items():
                self.controls[name].value = value
            moved = [
                f"{name} = {value!r}" for name, value in base.items() if value != current[name]
            ]
            if moved:
                attempt(", ".join(moved))
            for name, value in self.edges():
                self.controls[name].value = value
                attempt(f"{name} = {value!r}")
                self.controls[name].value = base[name]
        finally:
            for name, value in current.items():
                self.controls[name].value = value
        return problems

    def _clamped(self) -> list[str]:
        """Sliders clamp what is typed into them, silently: say so when a value sits at
        a bound it has been moved to since the last run (not again on the next run). The
        kernel sees only the clamped value, dragged there or typed beyond, so the note
        holds for both."""
        notes = []
        for name, control in self.controls.items():
            low, high = getattr(control, "min", None), getattr(control, "max", None)
            value = control.value
            if (
                low is None
                or high is None
                or isinstance(value, bool)
                or value == self._initial.get(name)
            ):
                continue
            label = control.description or name
            if value == high:
                notes.append(
                    f"{label} = {value:g} is the slider's maximum: it goes no higher, "
                    "also where a larger value is typed in"
                )
            elif value == low:
                notes.append(
                    f"{label} = {value:g} is the slider's minimum: it goes no lower, "
                    "also where a smaller value is typed in"
                )
        return notes

    def _show(self, run: Run, params: dict[str, Any]) -> None:
        rendered = self.render(run, **params) if self.render else repr(run.results)
        items = [rendered] if isinstance(rendered, (str, Figure)) or rendered is None else rendered
        shown = [item for item in items if item is not None]
        show(self.output, *shown)
        self.summary = "\n".join(str(item) for item in shown if not isinstance(item, Figure))

    def _fail(self, message: str) -> None:
        self.last_error = message
        self.status.value = "<span style='color:#b00'>failed, see below</span>"
        show(
            self.output,
            HTML(f"<pre style='color:#b00; white-space:pre-wrap'>{html.escape(message)}</pre>"),
        )

"""A reusable run panel: controls -> Run -> live progress -> figures and a summary.

    panel = RunPanel(
        show_collective,                         # a rank function from parcourse
        controls={"op": Dropdown(options=COLLECTIVES), "numel": IntSlider(4, 1, 8)},
        render=lambda run, op, numel: plots.tensors_before_after(...),
        world_size=4,
    )
    panel                                        # shows it; it has already run once

Each control's value is passed to the rank function and to `render` under the
control's name; a control named `world_size` picks the pool. The first run
happens when the panel is made, so a notebook executed headless (CI) runs the
same path a learner's click does; a failure of that first run raises, so that a
broken panel fails the notebook instead of hiding in its output. Failures after
a click are shown in the panel.
"""

from __future__ import annotations

import html
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ipywidgets as W
import matplotlib.pyplot as plt
from IPython.display import HTML, display
from matplotlib.figure import Figure

from parcourse import LaunchError, Pool, Run

_POOLS: OrderedDict[tuple[int, str], Pool] = OrderedDict()
_MAX_POOLS = 2  # each rank holds a copy of torch in memory; keep a laptop comfortable


def shared_pool(world_size: int, backend: str = "auto") -> Pool:
    """A Pool shared by every panel (and cell) that asks for the same size.

    Keeps the two most recently used sizes alive; older ones are closed.
    """
    key = (world_size, backend)
    if key in _POOLS:
        _POOLS.move_to_end(key)
        return _POOLS[key]
    pool = Pool(world_size, backend=backend)  # type: ignore[arg-type]
    _POOLS[key] = pool
    while len(_POOLS) > _MAX_POOLS:
        _, old = _POOLS.popitem(last=False)
        old.close()
    return pool


def close_shared_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


Rendered = str | Figure | Iterable[str | Figure] | None


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
        check: Callable[..., None] | None = None,
        title: str = "",
        timeout: float = 60.0,
        run_now: bool = True,
    ) -> None:
        self.rank_fn, self.render, self.check = rank_fn, render, check
        self.controls = dict(controls or {})
        self.world_size, self.pool, self.timeout = world_size, pool, timeout
        self.last_run: Run | None = None
        self.last_error: str | None = None
        self.summary: str = ""
        self.button = W.Button(description="Run", button_style="primary", icon="play")
        self.status = W.HTML()
        self.output = W.Output()
        self.button.on_click(lambda _: self.run())
        header = [W.HTML(f"<b>{html.escape(title)}</b>")] if title else []
        self.widget = W.VBox(
            [*header, *self.controls.values(), W.HBox([self.button, self.status]), self.output]
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

    def _progress(self, statuses: list[str], elapsed: float) -> None:
        rows = "".join(
            f"<br>&nbsp;&nbsp;rank {r}: {html.escape(s)}" for r, s in enumerate(statuses)
        )
        self.status.value = f"<span>running… {elapsed:.1f} s{rows}</span>"

    def run(self, raise_errors: bool = False) -> Run | None:
        """What the button does: run on real ranks, then show results or the error."""
        params = self.params()
        rank_kwargs = {k: v for k, v in params.items() if k != "world_size"}
        world_size = params.get("world_size", self.world_size)
        self.button.disabled = True
        self.last_error = None
        self.status.value = "starting ranks…"
        t0 = time.perf_counter()
        try:
            if self.check is not None:
                self.check(world_size=world_size, **rank_kwargs)
            pool = self._pool_for(world_size)
            run = pool.run(self.rank_fn, timeout=self.timeout, on_progress=self._progress,
                           **rank_kwargs)
            self.last_run = run
            self.status.value = (
                f"{world_size} ranks, {run.backend}: {run.wall_s * 1e3:.0f} ms "
                f"(panel {1e3 * (time.perf_counter() - t0):.0f} ms)"
            )
            self._show(run, params)
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

    def _show(self, run: Run, params: dict[str, Any]) -> None:
        rendered = self.render(run, **params) if self.render else repr(run.results)
        items = [rendered] if isinstance(rendered, (str, Figure)) or rendered is None else rendered
        texts = []
        self.output.clear_output(wait=True)
        with self.output:
            for item in items:
                if isinstance(item, Figure):
                    display(item)
                    plt.close(item)
                elif item is not None:
                    texts.append(str(item))
                    print(item)
        self.summary = "\n".join(texts)

    def _fail(self, message: str) -> None:
        self.last_error = message
        self.status.value = "<span style='color:#b00'>failed, see below</span>"
        self.output.clear_output(wait=True)
        with self.output:
            display(HTML(f"<pre style='color:#b00; white-space:pre-wrap'>"
                         f"{html.escape(message)}</pre>"))

"""What a learner sees: every lesson run in JupyterLab in a real (headless) browser.

papermill and nbval (tests/test_lessons.py) check what the kernel computes; neither renders a
figure or a widget. Here JupyterLab serves a copy of each lesson with the small parameters of
tests/test_lessons.py at world size 3 (a size that divides nothing: in CI this run stands in
for papermill's runs, see tests/conftest.py), Chromium (driven by Playwright) runs all cells,
and the test checks:

- no cell shows an error, and every cell that ends in plt.show() shows a loaded image;
- every RunPanel renders; one of its controls is moved, Run is clicked, and the panel's
  output shows a figure and its status line a finished run (ranks, backend, time);
- in the lessons of tests/test_lessons.py's EDGES_TRIED, every panel then runs at each
  control's ends, in the same kernel (in CI this stands in for papermill's run of it);
- last, each exercise's check, given an answer of the wrong type in the same kernel, prints
  a hint and returns False, without a traceback.

Screenshots go to out/browser/ (git-ignored; CI keeps it): the whole notebook after Run All,
each panel after its run, and the page at a failure. Progress lines (lesson, cell, seconds)
are printed and written to out/browser/<lesson>.log, so a hang shows where it happened.

Needs Debian's Chromium at /usr/bin/chromium (`apt-get install chromium`; Playwright's own
browser downloads are never used) and the `playwright` Python package (test extras);
skips without either.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from cell_limits import lesson_limit, limit, too_long
from process_tree import free_port, kill_tree
from test_lessons import AWKWARD, EDGES_TRIED, LESSONS, PANELS_AT_THEIR_EDGES, SMALL

from parcourse.classroom import exercises

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
)
pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (pip install -e '.[lab]')")

CHROMIUM = Path(os.environ.get("PARCOURSE_CHROMIUM", "/usr/bin/chromium"))
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(
        f"no Chromium at {CHROMIUM} (Debian/Ubuntu: apt-get install chromium)",
        allow_module_level=True,
    )

REPO = Path(__file__).resolve().parent.parent
SHOTS = REPO / "out" / "browser"
# Generous but bounded. A cell's limit and Run All's are its measured seconds times a
# margin (tests/cell_limits.py).
SERVER_START_S = 90
KERNEL_START_S = 120
PANEL_RUN_S = 120
EDGES_S = 300  # every panel of lesson 07 at its controls' ends: about 80 s on 2 cores
VIEWPORT = {"width": 1280, "height": 1000}
SHOT_MAX_H = 8000  # taller notebooks are saved in parts of this height


def browser_processes() -> list[psutil.Process]:
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "chrom" in p.name() or "playwright" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


class Lab:
    """A JupyterLab server on 127.0.0.1 with a generated token and its own settings,
    workspaces, runtime and config folders (nothing of the user's is read or written)."""

    def __init__(self, root: Path) -> None:
        self.notebooks = root / "notebooks"
        self.notebooks.mkdir()
        settings = root / "lab-settings"
        # Every cell in the DOM (no windowing), so the page shows and the test sees them all;
        # no news or update pop-ups in the screenshots.
        self._write_settings(settings, "notebook-extension/tracker", {"windowingMode": "none"})
        self._write_settings(
            settings,
            "apputils-extension/notification",
            {"fetchNews": "false", "checkForUpdates": False},
        )
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("JUPYTER", "JPY_")) and k != "MPLBACKEND"
        }
        # conftest.py sets MPLBACKEND=Agg for this process; kernels need the inline backend.
        env.update(
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(root / "lab-workspaces"),
            JUPYTER_RUNTIME_DIR=str(root / "runtime"),
            JUPYTER_CONFIG_DIR=str(root / "config"),
            JUPYTER_DATA_DIR=str(root / "data"),
            IPYTHONDIR=str(root / "ipython"),
        )
        cmd = [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.notebooks}",
            "--LabApp.expose_app_in_browser=True",
        ]  # window.jupyterapp: its commands
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        self.log_path = root / "jupyterlab.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=self.notebooks,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_up()

    @staticmethod
    def _write_settings(folder: Path, plugin: str, values: dict) -> None:
        path = folder / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))

    def _api(self, path: str, method: str = "GET") -> object:
        req = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else None

    def _wait_up(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                self._api("/api/status")
                return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError(
            f"JupyterLab did not start in {SERVER_START_S} s:\n" + self.log_path.read_text()[-3000:]
        )

    def shutdown_kernels(self) -> None:
        for kernel in self._api("/api/kernels"):  # type: ignore[union-attr]
            self._api(f"/api/kernels/{kernel['id']}", method="DELETE")

    def close(self) -> list[psutil.Process]:
        survivors = kill_tree(self.proc.pid)
        self.proc.wait(timeout=10)
        self._log.close()
        return survivors


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    server = Lab(tmp_path_factory.mktemp("jupyterlab"))
    yield server
    survivors = server.close()
    assert not survivors, f"processes of JupyterLab still running: {survivors}"


@pytest.fixture(scope="module")
def browser():
    pw = sync_api.sync_playwright().start()
    try:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True)
    except Exception:
        pw.stop()
        raise
    yield chromium
    try:
        chromium.close()
    finally:
        pw.stop()
    # Playwright's driver ends its browser; make sure, since a stray Chromium is costly.
    left = browser_processes()
    for p in left:
        kill_tree(p.pid, grace_s=5)
    assert not left, f"browser processes still running after the test: {left}"


class Progress:
    """Prints progress and keeps it in out/browser/<lesson>.log."""

    def __init__(self, lesson: str) -> None:
        self.lesson, self.t0 = lesson, time.monotonic()
        self.file = (SHOTS / f"{lesson}.log").open("w")

    def __call__(self, message: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f} s] {self.lesson}: {message}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


def with_small_parameters(src: Path, dst: Path) -> list[str]:
    """Copy a lesson, appending its small parameters (world size 3) to the parameters cell;
    returns the sources of its code cells."""
    nb = json.loads(src.read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    lines = [f"{name} = {value!r}" for name, value in {**SMALL[src.stem], **AWKWARD}.items()]
    cell["source"] = (
        "".join(cell["source"]).rstrip("\n")
        + "\n# small parameters (lessons/small_parameters.json), at world size 3:\n"
    )
    cell["source"] += "\n".join(lines) + "\n"
    dst.write_text(json.dumps(nb, indent=1))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


# JavaScript run in the page; each function starts by finding the lesson's notebook panel.
FIND = """const w = [...window.jupyterapp.shell.widgets('main')]
        .find(w => w.context && w.context.path === name);"""
KERNEL_IDLE = (
    """(name) => {
    if (!window.jupyterapp || !window.jupyterapp.shell) return false;  // still loading
    """
    + FIND
    + """
    const kernel = w && w.context.isReady && w.sessionContext.session
        && w.sessionContext.session.kernel;
    return !!kernel && kernel.status === 'idle';
}"""
)
PROMPTS = (
    """(name) => {"""
    + FIND
    + """
    const session = w.sessionContext.session;
    const status = session && session.kernel ? session.kernel.status : 'no kernel';
    const prompts = [...w.content.node.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')]
        .map(p => p.textContent.trim());
    return {status, prompts};
}"""
)
# Per code cell: its outputs (type, stream name, MIME types, error text) from the notebook
# model, and its images in the page with whether each has loaded.
CELLS = (
    """(name) => {"""
    + FIND
    + """
    const cells = [...w.content.widgets].filter(c => c.model.type === 'code');
    return cells.map(c => ({
        outputs: c.model.outputs.toJSON().map(o => ({
            type: o.output_type, stream: o.name || null, mimes: Object.keys(o.data || {}),
            error: o.output_type === 'error'
                ? `${o.ename}: ${o.evalue}\\n${(o.traceback || []).join('\\n')}` : null,
        })),
        images: [...c.node.querySelectorAll('.jp-OutputArea img')]
            .map(i => i.complete && i.naturalWidth > 0),
    }));
}"""
)
VISIBLE_ERRORS = """() => [...document.querySelectorAll(
        '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"], '
        + '.widget-output pre, .jp-Dialog')]
    .map(e => e.innerText.trim()).filter(t => t)"""
SCROLLER = ".jp-NotebookPanel .jp-WindowedPanel-outer"
# Down to the last cell's bottom (the notebook's scroll area goes on past it).
CONTENT_HEIGHT = f"""() => {{
    const scroller = document.querySelector('{SCROLLER}');
    const cells = scroller.querySelectorAll('.jp-Cell');
    const bottom = cells[cells.length - 1].getBoundingClientRect().bottom;
    return Math.ceil(bottom - scroller.getBoundingClientRect().top + scroller.scrollTop + 24);
}}"""
# A RunPanel: a VBox whose row of button and status holds a button (Run).
PANEL = ".jp-OutputArea .widget-vbox:has(> .widget-hbox > button.widget-button)"
# The panel's run is over when its output has changed and the kernel has gone idle (the
# kernel publishes every output of the click's handler before it reports idle).
PANEL_DONE = (
    """([name, index, before]) => {"""
    + FIND
    + """
    const panel = w.content.node.querySelectorAll(PANEL)[index];
    const output = panel.querySelector(':scope > .widget-output');
    const button = panel.querySelector(':scope > .widget-hbox > button');
    return output.innerHTML !== before && !button.disabled
        && w.sessionContext.session.kernel.status === 'idle';
}""".replace("PANEL", json.dumps(PANEL))
)
# Code run in the lesson's kernel, out of the notebook's sight (no cell, no history): its
# status, any error and what it printed, or 'timeout' after `ms`.
EXECUTE = (
    """async ([name, code, ms]) => {"""
    + FIND
    + """
    const future = w.sessionContext.session.kernel.requestExecute(
        {code, store_history: false, silent: false});
    let out = '';
    future.onIOPub = msg => { if (msg.header.msg_type === 'stream') out += msg.content.text; };
    const done = future.done.then(reply => ({
        status: reply.content.status, out,
        error: reply.content.status === 'error'
            ? `${reply.content.ename}: ${reply.content.evalue}` : null}));
    const late = new Promise(resolve => setTimeout(
        () => resolve({status: 'timeout', error: null, out}), ms));
    return await Promise.race([done, late]);
}"""
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXPLORER = "Zoom into the timeline, read each span, export"  # widgets/explorer.py's title


class Failure(AssertionError):
    pass


def fail(page, lesson: str, message: str, cell: int | None = None) -> None:
    """Fail with the page's visible error text, saving a screenshot of it (scrolled to
    code cell `cell` when given)."""
    shot = SHOTS / f"{lesson}-failure.png"
    try:
        if cell is not None:
            page.locator(".jp-Notebook .jp-CodeCell").nth(cell).scroll_into_view_if_needed(
                timeout=5000
            )
        page.screenshot(path=str(shot))
        errors = page.evaluate(VISIBLE_ERRORS)
    except Exception as e:  # noqa: BLE001 - the page itself may be what failed
        errors = [f"(could not read the page: {e})"]
    visible = "\n---\n".join(ANSI.sub("", t)[-2000:] for t in errors) or "(none)"
    raise Failure(f"{lesson}: {message}\nscreenshot: {shot}\nvisible error text:\n{visible}")


def run_all_cells(page, name: str, lesson: str, log: Progress) -> list[str]:
    """Run All, as from the Run menu; returns the code cells' prompts once it is over."""
    # Not awaited: the command's promise resolves only when every cell has run.
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    start = time.monotonic()
    running, since = None, start
    while True:
        time.sleep(0.5)
        state = page.evaluate(PROMPTS, name)
        prompts = state["prompts"]
        busy = [i for i, p in enumerate(prompts) if p == "[*]:"]
        done = [i for i, p in enumerate(prompts) if re.fullmatch(r"\[\d+\]:", p)]
        if not busy and done and state["status"] == "idle":
            log(
                f"all cells ran ({len(done)} of {len(prompts)} code cells numbered) "
                f"in {time.monotonic() - start:.1f} s"
            )
            return prompts
        if state["status"] in ("dead", "no kernel", "autorestarting", "restarting"):
            fail(page, lesson, f"the kernel died (status {state['status']!r}, prompts {prompts})")
        now = time.monotonic()
        if busy and busy[0] != running:
            if running is not None:
                log(f"code cell {running} took {now - since:.1f} s")
            running, since = busy[0], now
            log(f"running code cell {running} of {len(prompts)}")
        if busy and now - since > limit(lesson, running, "small"):
            fail(page, lesson, too_long(lesson, running, "small", now - since), running)
        if now - start > lesson_limit(lesson, "small"):
            fail(
                page,
                lesson,
                f"Run All not finished after {now - start:.0f} s, past its limit of "
                f"{lesson_limit(lesson, 'small'):.0f} s (tests/cell_limits.py; prompts: {prompts})",
            )


def check_cells(
    page, name: str, lesson: str, sources: list[str], prompts: list[str], log: Progress
) -> None:
    cells = page.evaluate(CELLS, name)
    assert len(cells) == len(sources), f"{lesson}: {len(cells)} code cells in the page"
    errors = {i: o["error"] for i, c in enumerate(cells) for o in c["outputs"] if o["error"]}
    if errors:
        text = "\n".join(f"code cell {i}: {e}" for i, e in errors.items())
        fail(page, lesson, "cells show errors:\n" + ANSI.sub("", text)[-4000:], min(errors))
    skipped = [i for i, p in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:", p)]
    if skipped:
        fail(page, lesson, f"code cells {skipped} did not run (prompts {prompts})", skipped[0])
    stderr = [i for i, c in enumerate(cells) if any(o["stream"] == "stderr" for o in c["outputs"])]
    missing: dict[int, str] = {}
    for i, (cell, src) in enumerate(zip(cells, sources)):
        if "plt.show()" not in src:
            continue
        pngs = sum("image/png" in o["mimes"] for o in cell["outputs"])
        if not pngs or not cell["images"] or not all(cell["images"]):
            missing[i] = (
                f"code cell {i}: {pngs} image outputs, images loaded in the page: {cell['images']}"
            )
    if missing:
        fail(page, lesson, "figures not rendered:\n" + "\n".join(missing.values()), min(missing))
    broken = [i for i, c in enumerate(cells) if not all(c["images"])]
    if broken:
        fail(page, lesson, f"images that did not load in code cells {broken}", broken[0])
    figures = sum(len(c["images"]) for c in cells)
    log(
        f"no errors; {figures} images in {sum(bool(c['images']) for c in cells)} cells"
        + (f"; stderr shown in code cells {stderr}" if stderr else "")
    )


def screenshot_notebook(page, lesson: str) -> list[Path]:
    """The whole notebook: a viewport as tall as its content (in parts if very tall)."""
    page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
    page.wait_for_timeout(300)
    height = page.evaluate(CONTENT_HEIGHT)
    chrome = VIEWPORT["height"] - page.evaluate(
        f"() => document.querySelector('{SCROLLER}').clientHeight"
    )
    part_h = min(height, SHOT_MAX_H)
    page.set_viewport_size({"width": VIEWPORT["width"], "height": part_h + chrome})
    paths = []
    parts = -(-height // part_h)
    for k in range(parts):
        if k == parts - 1 and k:  # the last part only as tall as what is left
            page.set_viewport_size(
                {"width": VIEWPORT["width"], "height": height - k * part_h + chrome}
            )
        page.evaluate(f"(y) => document.querySelector('{SCROLLER}').scrollTop = y", k * part_h)
        page.wait_for_timeout(300)
        path = SHOTS / (f"{lesson}.png" if parts == 1 else f"{lesson}-part{k + 1}.png")
        page.screenshot(path=str(path))
        paths.append(path)
    page.set_viewport_size(VIEWPORT)
    page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
    return paths


def change_a_control(panel) -> str:
    """Moves one control the way a learner would: a checkbox, else a toggle button, else a
    dropdown, else a slider one step left (world size last: it starts a new pool)."""
    box = panel.locator(":scope > .widget-checkbox input[type=checkbox]")
    if box.count():
        before = box.first.is_checked()
        box.first.click()
        assert box.first.is_checked() != before, "the checkbox did not change"
        return f"checkbox -> {not before}"
    toggles = panel.locator(":scope > .widget-toggle-buttons")
    if toggles.count():
        buttons = toggles.first.locator("button.widget-toggle-button")
        classes = buttons.evaluate_all("bs => bs.map(b => b.className)")
        k = next(k for k, c in enumerate(classes) if "mod-active" not in c)
        buttons.nth(k).click()
        assert "mod-active" in (buttons.nth(k).get_attribute("class") or ""), "no toggle"
        return f"toggle -> {buttons.nth(k).inner_text().strip()}"
    select = panel.locator(":scope > .widget-dropdown select")
    if select.count():
        current = select.first.input_value()
        options = select.first.locator("option").all_inner_texts()
        choice = next(o for o in options if o != current)
        select.first.select_option(label=choice)
        return f"dropdown -> {choice}"
    sliders = panel.locator(":scope > .widget-slider")
    for k in range(sliders.count()):
        slider = sliders.nth(k)
        label = slider.locator(".widget-label").inner_text().strip()
        if label == "world size" and k < sliders.count() - 1:
            continue
        readout = slider.locator(".widget-readout")
        before = readout.inner_text()
        for key in ("ArrowLeft", "ArrowRight"):  # right only where it sits at its minimum
            slider.locator(".noUi-handle").press(key)
            if readout.inner_text() != before:
                return f"slider {label!r}: {before} -> {readout.inner_text()}"
        raise AssertionError(f"slider {label!r} did not move")
    raise AssertionError("the panel has no control to change")


def run_panels(page, name: str, lesson: str, expected: int, log: Progress) -> None:
    panels = page.locator(PANEL)
    try:
        page.wait_for_function(
            f'() => document.querySelectorAll("{PANEL}").length >= {expected}', timeout=30_000
        )
    except sync_api.TimeoutError:
        fail(page, lesson, f"{panels.count()} of {expected} run panels rendered")
    for k in range(expected):
        panel = panels.nth(k)
        title = panel.locator(":scope > .widget-html b").first
        title = title.inner_text() if title.count() else f"panel {k}"
        panel.scroll_into_view_if_needed()
        changed = change_a_control(panel)
        output = panel.locator(":scope > .widget-output")
        before = output.inner_html()
        log(f"panel {title!r}: {changed}, Run")
        t0 = time.monotonic()
        panel.locator(":scope > .widget-hbox > button.widget-button").click()
        try:
            page.wait_for_function(PANEL_DONE, arg=[name, k, before], timeout=PANEL_RUN_S * 1000)
        except sync_api.TimeoutError:
            fail(page, lesson, f"panel {title!r}: no result {PANEL_RUN_S} s after Run")
        status = panel.locator(":scope > .widget-hbox > .widget-html").inner_text().strip()
        page.wait_for_timeout(300)  # let the new image decode before checking and shooting
        images = output.locator("img").evaluate_all(
            "imgs => imgs.map(i => i.complete && i.naturalWidth > 0)"
        )
        text = output.inner_text().strip()
        shot = SHOTS / f"{lesson}-panel{k}.png"
        panel.screenshot(path=str(shot))
        log(
            f"panel {title!r}: {time.monotonic() - t0:.1f} s, status {status!r}, "
            f"{len(images)} images, summary {text[:80]!r}"
        )
        if "failed" in status or not re.search(r"\d+ ranks?, \w+: \d+ ms", status):
            fail(page, lesson, f"panel {title!r} after Run: status {status!r}")
        if not images or not all(images):
            fail(page, lesson, f"panel {title!r} after Run: no figure (images {images})")
        explorer = panel.get_by_text(EXPLORER, exact=True)
        if k == 0 and explorer.count() and explorer.first.is_visible():
            explorer.first.click()  # open the span explorer: the zoomed timeline and table
            table = panel.get_by_text("duration (ms)").first
            try:
                table.wait_for(timeout=30_000)
            except sync_api.TimeoutError:
                fail(page, lesson, f"panel {title!r}: the span explorer shows no table")
            table.scroll_into_view_if_needed()
            page.wait_for_timeout(300)
            page.screenshot(path=str(SHOTS / f"{lesson}-panel{k}-spans.png"))
            log(f"panel {title!r}: span explorer open")


def try_the_panels_ends(page, name: str, lesson: str, log: Progress) -> None:
    """Where this test runs a lesson, tests/test_lessons.py's trial of every panel at each
    control's ends runs here, in the lesson's kernel after the clicks (tests/conftest.py
    skips papermill's run of the whole lesson for it)."""
    log("every panel at its controls' ends")
    t0 = time.monotonic()
    # A launcher tab over the notebook while they run: the page then draws none of the
    # panels' many figures (a third of the time on 2 cores); the kernel is the same.
    page.evaluate("() => { window.jupyterapp.commands.execute('launcher:create'); }")
    result = page.evaluate(EXECUTE, [name, PANELS_AT_THEIR_EDGES, EDGES_S * 1000])
    if result["status"] == "timeout":
        fail(page, lesson, f"the panels at their ends: not done after {EDGES_S} s")
    if result["status"] != "ok":
        fail(page, lesson, f"the panels at their ends: {ANSI.sub('', result['error'] or '')}")
    log(
        f"every panel ran (or refused in one line) at its controls' ends in "
        f"{time.monotonic() - t0:.1f} s"
    )


# The exercise's function replaced by one that returns a string (its class, by a subclass
# whose public methods do: an autograd Function's private `_backward_cls` must stay, torch
# crashes without it), then its check asked again, the verdict printed after its hint.
WRONG_ANSWER = """
if isinstance({name}, type):
    class {name}({name}):
        pass
    for _k, _v in vars({name}.__base__).items():
        if not _k.startswith("_") and callable(_v):
            setattr({name}, _k, staticmethod(lambda *args, **kwargs: "wrong"))
else:
    def {name}(*args, **kwargs):
        return "wrong"
print("passed:", {check})
"""


def give_wrong_answers(page, name: str, lesson: str, path: Path, log: Progress) -> None:
    """Each exercise of the lesson, answered with the wrong type in the lesson's kernel, with
    its own names and pool (tests/test_exercise_checks.py asks the checks outside a kernel):
    the check prints a hint and returns False, and raises nothing. Last, as the answers stay
    replaced in the kernel."""
    for exercise in exercises(json.loads(path.read_text()), lesson):
        code = WRONG_ANSWER.format(name=exercise.name, check=exercise.check)
        result = page.evaluate(EXECUTE, [name, code, PANEL_RUN_S * 1000])
        hint, _, verdict = ANSI.sub("", result["out"]).strip().rpartition("\n")
        first = hint.strip().splitlines()[0] if hint.strip() else ""
        outcome = verdict if result["status"] == "ok" else result["status"]
        log(f"exercise {exercise.name}, a wrong type: {outcome}, {first!r}")
        if result["status"] != "ok" or "Traceback" in hint:
            fail(
                page,
                lesson,
                f"{exercise.check} with a wrong type: {result['status']} "
                f"{ANSI.sub('', result['error'] or '')}\n{hint}",
            )
        if verdict != "passed: False" or not hint.strip():
            fail(
                page,
                lesson,
                f"{exercise.check} with a wrong type: {verdict!r} after "
                f"{hint!r} (expected a hint and False)",
            )


SAVE = (
    """async (name) => {"""
    + FIND
    + """
    await w.context.save();
    return true;
}"""
)


def keep_executed(page, lab: Lab, name: str, lesson: str, executed: Path, log: Progress) -> None:
    """The notebook after Run All, saved by JupyterLab with its outputs, left in `executed`
    for the site's build (tests/test_site.py), which then does not execute it again."""
    page.evaluate(SAVE, name)
    copy = executed / f".{name}.part"
    copy.write_text((lab.notebooks / name).read_text())
    copy.rename(executed / name)  # whole, or not there: the site's build polls for it
    log(f"executed notebook kept for the site: {executed / name}")


def open_lesson(page, lab: Lab, name: str, lesson: str, log: Progress) -> None:
    page.goto(f"{lab.url}/lab/tree/{name}?reset&token={lab.token}", timeout=90_000)
    try:
        page.wait_for_function(KERNEL_IDLE, arg=name, timeout=KERNEL_START_S * 1000, polling=500)
    except sync_api.TimeoutError:
        fail(page, lesson, f"notebook or kernel not ready after {KERNEL_START_S} s")
    log("kernel ready")


# The lessons run here; tests/test_browser_rest.py runs the others, so that `make test`'s
# processes run the two halves side by side. About as long each (seconds in CI, beside the
# rest of the suite): 07 167, 11 74, 05 48, 10 45, 02 35, 00 32 here; 12 87, 08 75, 04 72,
# 09 72, 06 39, 01 30, 03 25 there.
HERE = {
    "07_1f1b_and_beyond",
    "11_long_context_and_experts",
    "05_tensor_parallel",
    "02_data_parallel",
    "10_training_for_real",
    "00_launching_ranks",
}


@pytest.mark.notebook
@pytest.mark.parametrize("path", [p for p in LESSONS if p.stem in HERE], ids=lambda p: p.stem)
def test_lesson_in_the_browser(path, lab, browser, executed_lessons):
    lesson_in_the_browser(path, lab, browser, executed_lessons)


def lesson_in_the_browser(path: Path, lab: Lab, browser, executed: Path) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    lesson, name = path.stem, path.name
    if lesson not in SMALL:
        pytest.fail(f"{lesson}: no small parameters in tests/test_lessons.py (SMALL)")
    for old in SHOTS.glob(f"{lesson}*"):
        old.unlink()
    log = Progress(lesson)
    sources = with_small_parameters(path, lab.notebooks / name)
    panels = sum(src.count("RunPanel(") for src in sources)
    page = browser.new_page(viewport=VIEWPORT)
    try:
        open_lesson(page, lab, name, lesson, log)
        prompts = run_all_cells(page, name, lesson, log)
        check_cells(page, name, lesson, sources, prompts, log)
        keep_executed(page, lab, name, lesson, executed, log)
        shots = screenshot_notebook(page, lesson)
        log(f"screenshot {', '.join(p.name for p in shots)}")
        run_panels(page, name, lesson, panels, log)
        if lesson in EDGES_TRIED:
            try_the_panels_ends(page, name, lesson, log)
        give_wrong_answers(page, name, lesson, path, log)
    finally:
        if not (executed / name).exists():  # the site's build stops waiting for it
            (executed / f"{name}.failed").touch()
        page.close()
        lab.shutdown_kernels()  # and with each kernel, its pool's ranks
        log.file.close()

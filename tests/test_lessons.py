"""Every lesson runs end to end (papermill, small parameters) and follows the cell pattern.

nbval (`--nbval-lax`, configured in pyproject.toml) separately re-runs each lesson with
its default parameters and compares the cells marked NBVAL_CHECK_OUTPUT.
"""

import json
import re
import time
from pathlib import Path

import cell_limits
import nbformat
import papermill
import pytest
from cell_limits import SECONDS, limit, too_long
from nbclient.exceptions import CellTimeoutError

LESSONS = sorted((Path(__file__).parent.parent / "lessons").glob("[0-9][0-9]_*.ipynb"))
# Small enough to run in seconds on a 2-core machine; the same fields as each parameters
# cell. The site's build (site/build.py) executes the lessons with the same.
SMALL = json.loads((Path(__file__).parent.parent / "lessons" / "small_parameters.json").read_text())
# A world size that divides nothing, as a learner may type it into the parameters cell:
# whatever depends on it (chunks, slices, batches) must be derived, not assumed.
AWKWARD = {"world_size": 3}
# A kernel starting beside busy work can take more than papermill's 60 s (seen in CI
# beside two busy processes): the start is not what these tests check.
KERNEL_START_S = 300


def code_cells(path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def source(cell):
    return "".join(cell["source"])


def test_there_are_lessons():
    assert LESSONS, "no lessons found"
    assert set(SMALL) == {p.stem for p in LESSONS}, "every lesson needs small CI parameters"


def execute(path, out, parameters, then=None):
    """Run the lesson under papermill (with the code `then` as one more cell at its end)
    and assert no cell failed; each cell within its limit (tests/cell_limits.py)."""
    lesson = path.stem
    index = {c.get("id"): i for i, c in enumerate(code_cells(path))}
    running: dict = {}

    def cell_limit(cell):  # nbclient asks as each cell starts
        running.update(cell=index.get(cell.get("id")), since=time.monotonic())
        return int(limit(lesson, running["cell"], "small"))

    if then is not None:
        notebook = json.loads(path.read_text())
        notebook["cells"].append(
            {
                "cell_type": "code",
                "execution_count": None,
                "id": "then",
                "metadata": {},
                "outputs": [],
                "source": then,
            }
        )
        copy = out.with_name("with_then_" + path.name)
        copy.write_text(json.dumps(notebook))
        path = copy
    for attempt in (1, 2):
        try:
            papermill.execute_notebook(
                str(path),
                str(out),
                parameters=parameters,
                kernel_name="python3",
                cwd=str(path.parent),
                progress_bar=False,
                start_timeout=KERNEL_START_S,
                timeout_func=cell_limit,
            )
            break
        except CellTimeoutError:
            ran = time.monotonic() - running["since"]
            raise AssertionError(too_long(lesson, running["cell"], "small", ran)) from None
        except RuntimeError as e:
            # Only the kernel's own start is tried again: jupyter_client picks its ports
            # before the kernel binds them, and beside busy work another process took one
            # in between once ("Address already in use"). A cell's error is
            # PapermillExecutionError and fails at once.
            if attempt == 2 or "Kernel died before replying" not in str(e):
                raise
    executed = json.loads(out.read_text())
    errors = [
        o
        for c in executed["cells"]
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors


# After a lesson has run, every panel it made runs with each control at each end (one
# at a time): a panel must run there, or refuse in one line before starting ranks. The
# ends are tried from the cheapest start: two ranks (the fewest that talk) and every
# simulated duration (a control named *_ms) at its minimum, so that an end costs what it
# adds itself; the start runs first.
PANELS_AT_THEIR_EDGES = """
from parcourse.widgets import RunPanel
def _cheapest(panel):
    start = {name: c.min for name, c in panel.controls.items() if name.endswith("_ms")}
    if "world_size" in panel.controls:
        start["world_size"] = min(max(2, panel.controls["world_size"].min),
                                  panel.controls["world_size"].max)
    return start
panels = {id(v): v for k, v in globals().items()  # not _, _12: IPython's output history
          if isinstance(v, RunPanel) and not k.startswith("_")}
problems = [p for panel in panels.values() for p in panel.try_edges(_cheapest(panel))]
assert not problems, "\\n".join(problems)
"""
EDGES_TRIED = {
    "04_zero3",
    "05_tensor_parallel",
    "06_pipelines",
    "07_1f1b_and_beyond",
    "08_activation_checkpointing",
    "09_mesh_and_3d",
}


@pytest.mark.notebook
@pytest.mark.parametrize(
    "path", [p for p in LESSONS if p.stem not in EDGES_TRIED], ids=lambda p: p.stem
)
def test_lesson_executes_with_small_parameters(path, tmp_path):
    """The lessons with panels tried at their ends run at their small parameters in
    test_panels_run_at_their_controls_ends, which executes the whole lesson first."""
    execute(path, tmp_path / path.name, SMALL[path.stem])


@pytest.mark.notebook
@pytest.mark.parametrize(
    "path", [p for p in LESSONS if p.stem in EDGES_TRIED], ids=lambda p: p.stem
)
def test_panels_run_at_their_controls_ends(path, tmp_path):
    """The lesson at its small parameters, then every panel it made at each control's
    ends (PANELS_AT_THEIR_EDGES). Where tests/test_browser.py runs the lesson, it tries
    the ends in its own kernel instead (tests/conftest.py)."""
    execute(path, tmp_path / path.name, SMALL[path.stem], then=PANELS_AT_THEIR_EDGES)


@pytest.mark.notebook
@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_executes_at_world_size_3(path, tmp_path):
    execute(path, tmp_path / path.name, {**SMALL[path.stem], **AWKWARD})


def advertised(path):
    """The world sizes a lesson's parameters cell promises, read from the comment on its
    `world_size = ...` line: "1 to 8", "1 or more", "1 to 4, or 6"."""
    cell = next(c for c in code_cells(path) if "parameters" in c["metadata"].get("tags", []))
    match = re.search(r"^world_size = (?:None|\d+)\s*#(.*)$", source(cell), re.M)
    assert match, f"{path.stem}: the world_size line says which sizes work"
    comment, sizes = match.group(1), set()
    if m := re.search(r"(\d+) to (\d+)", comment):
        sizes |= set(range(int(m[1]), int(m[2]) + 1))
    if m := re.search(r"(\d+) or more", comment):
        sizes.add(int(m[1]))
    sizes |= {int(k) for k in re.findall(r"\bor (\d+)\b", comment)}
    assert sizes, f"{path.stem}: no world sizes in {comment!r}"
    return sorted(sizes)


def test_every_lesson_has_its_cells_measured():
    """The limits a cell may take (tests/cell_limits.py) come from its measured seconds,
    one for each code cell, at the small parameters and at the defaults."""
    for path in LESSONS:
        cells = len(code_cells(path))
        measured = SECONDS.get(path.stem, {})
        for kind in ("small", "defaults"):
            assert len(measured.get(kind, [])) == cells, (
                f"{path.stem}: lessons/cell_seconds.json has "
                f"{len(measured.get(kind, []))} {kind} cells, the lesson {cells}: "
                f"run python benchmarks/suite.py --cells {path.stem}"
            )


def test_a_cell_past_its_limit_fails_naming_it(tmp_path, monkeypatch):
    """A hung cell fails at its limit (what it takes times the margin), and the failure
    says which cell, what it takes and how long it ran."""
    nb = nbformat.v4.new_notebook(
        metadata={
            "kernelspec": {"name": "python3", "language": "python", "display_name": "Python 3"}
        }
    )
    nb.cells = [
        nbformat.v4.new_code_cell("n = 1", id="p", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("import time; time.sleep(60)", id="hang"),
    ]
    path = tmp_path / "99_hangs.ipynb"
    nbformat.write(nb, path)
    monkeypatch.setitem(cell_limits.SECONDS, "99_hangs", {"small": [0.1, 0.5]})
    monkeypatch.setattr(cell_limits, "FLOOR_S", 1.0)
    monkeypatch.setattr(cell_limits, "MARGIN", 4)
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"code cell 1 still running after \d+ s, past"):
        execute(path, tmp_path / "out.ipynb", {"n": 2})
    assert time.monotonic() - start < 45, "the limit (2 s) did not stop the cell"


def test_every_lesson_says_which_world_sizes_it_runs_at():
    for path in LESSONS:
        assert 1 in advertised(path), path.stem


# Sizes a lesson names beyond a contiguous range ("1 to 4, or 6"): each runs here, so that
# the comment and the lesson cannot drift apart (2 and 3 run above, the defaults in nbval).
EXTRA = [
    (path, size)
    for path in LESSONS
    for size in advertised(path)
    if size - 1 not in advertised(path) and size > 1
]


@pytest.mark.notebook
@pytest.mark.parametrize(("path", "size"), EXTRA, ids=[f"{p.stem}-{n}" for p, n in EXTRA])
def test_lesson_executes_at_every_size_it_names(path, size, tmp_path):
    execute(path, tmp_path / path.name, {**SMALL[path.stem], "world_size": size})


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_hygiene(path):
    cells = code_cells(path)
    tagged = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    assert cells.index(tagged[0]) == 0, "the parameters cell comes first"
    params = set(re.findall(r"^(\w+)\s*=", source(tagged[0]), re.M))
    assert params >= set(SMALL[path.stem]), "CI overrides only parameters the lesson has"
    assert any("NBVAL_CHECK_OUTPUT" in source(c) for c in cells)
    for i, cell in enumerate(cells):
        text = source(cell).rstrip()
        assert "interact_manual" not in text, f"cell {i}: interact_manual never runs headless"
        if re.search(r"\b(RunPanel|Button|Output)\(", text):
            assert "NBVAL_IGNORE_OUTPUT" in text, f"cell {i}: a panel without NBVAL_IGNORE_OUTPUT"
        assert not text.endswith(";"), f"cell {i}: nbval does not honour a trailing ';'"
        last = text.splitlines()[-1] if text else ""
        assert not re.match(r"[\w.]*check\w*\(", last), (
            f"cell {i}: a check's verdict would echo as Out: False; assign it (passed = ...)"
        )
        if "NBVAL_CHECK_OUTPUT" not in text:
            assert not cell.get("outputs"), f"cell {i}: commit notebooks without noisy outputs"
        else:
            assert cell.get("outputs"), f"cell {i}: a checked cell needs its expected output"
    exercises = [c for c in cells if "raise NotImplementedError" in source(c)]
    for stub in exercises:
        after = cells[cells.index(stub) + 1 :]
        assert any("check" in source(c) for c in after), "every exercise stub has a check"
        assert any("solution" in source(c).lower() for c in after), "…and a solution"
    for i, cell in enumerate(cells):
        if source(cell).lstrip().startswith("def solution"):
            assert cell["metadata"].get("jupyter", {}).get("source_hidden"), (
                f"cell {i}: a solution starts collapsed (metadata jupyter.source_hidden)"
            )

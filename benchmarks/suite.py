"""Where the test suite's time goes, so that its budget (12 minutes of pytest on 2 cores,
`make test`) can be watched as the course grows.

    python benchmarks/suite.py [JUNIT]           # the ten slowest items and files, and shares
    python benchmarks/suite.py --write-costs     # ...and tests/suite_costs.json from them
    python benchmarks/suite.py --cells [LESSON ...]  # lessons/cell_seconds.json, measured

`make test` writes its report to out/suite.xml (pytest's JUnit XML), which is the default
JUNIT. An item's time is its setup, call and teardown. The shares are of the items' summed
time, which is more than the run's wall time: several pytest processes share the cores.

`--write-costs` keeps each file's seconds in tests/suite_costs.json; tests/conftest.py hands
files to `make test`'s processes costliest first (the longest-processing-time rule), so that
the long lessons and browser runs start at once and the short files fill in behind them.

`--cells` executes each lesson (papermill, one at a time) at its small parameters at world
size 3 (what tests/test_browser.py runs) and at its defaults (what nbval runs), and writes
each code cell's seconds to lessons/cell_seconds.json: the limits a cell may take in the
tests are that times a margin (tests/cell_limits.py). Rerun it for a lesson whose cells
changed (tests/test_lessons.py fails until then); about ten minutes for all on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JUNIT = REPO / "out" / "suite.xml"
COSTS = REPO / "tests" / "suite_costs.json"
CELLS = REPO / "lessons" / "cell_seconds.json"
AWKWARD = {"world_size": 3}  # as tests/test_lessons.py


def read(junit: Path) -> tuple[float, dict[str, float], dict[str, float]]:
    """The run's wall seconds, each item's seconds and each file's."""
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    wall = sum(float(s.get("time", 0)) for s in suites)
    items: dict[str, float] = {}
    files: dict[str, float] = defaultdict(float)
    for case in root.iter("testcase"):
        path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        name = f"{path}::{case.get('name')}"
        seconds = float(case.get("time", 0))
        items[name] = items.get(name, 0.0) + seconds
        files[path] += seconds
    return wall, items, dict(files)


def table(title: str, rows: dict[str, float], total: float, n: int = 10) -> None:
    print(f"\n{title}")
    print(f"{'seconds':>8} {'share':>6}  item")
    top = sorted(rows.items(), key=lambda kv: -kv[1])[:n]
    for name, seconds in top:
        print(f"{seconds:8.1f} {seconds / total:6.1%}  {name}")
    rest = sum(rows.values()) - sum(s for _, s in top)
    print(f"{rest:8.1f} {rest / total:6.1%}  (the other {max(len(rows) - n, 0)})")


def report(junit: Path, write_costs: bool) -> None:
    if not junit.exists():
        sys.exit(f"no {junit}: run `make test` first (it writes it), or name a JUnit XML file")
    wall, items, files = read(junit)
    total = sum(items.values())
    print(f"{junit}: {len(items)} items, {total:.0f} s summed, {wall:.0f} s of wall time")
    print(f"(budget: 720 s of wall time on a quiet 2-core machine; {wall / 720:.0%} of it)")
    table("the ten slowest items", items, total)
    table("the ten costliest files", files, total)
    if write_costs:
        COSTS.write_text(
            json.dumps({f: round(s, 1) for f, s in sorted(files.items())}, indent=1) + "\n"
        )
        print(f"\nwrote {COSTS}")


def execute(lesson: Path, parameters: dict) -> list[float]:
    """Each code cell's seconds, the lesson run by papermill with `parameters`."""
    import papermill

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / lesson.name
        papermill.execute_notebook(
            str(lesson),
            str(out),
            parameters=parameters,
            kernel_name="python3",
            cwd=str(lesson.parent),
            progress_bar=False,
            start_timeout=300,
        )
        cells = json.loads(out.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    code = [c for c in code if "injected-parameters" not in c["metadata"].get("tags", [])]
    return [round(c["metadata"]["papermill"]["duration"] or 0.0, 1) for c in code]


def measure_cells(names: list[str]) -> None:
    os.environ.pop("MPLBACKEND", None)
    small = json.loads((REPO / "lessons" / "small_parameters.json").read_text())
    kept = json.loads(CELLS.read_text()) if CELLS.exists() else {}
    lessons = sorted((REPO / "lessons").glob("[0-9][0-9]_*.ipynb"))
    for lesson in lessons:
        if names and not any(lesson.stem.startswith(n) for n in names):
            continue
        print(f"{lesson.stem}: small at world size 3 ...", flush=True)
        at_small = execute(lesson, {**small[lesson.stem], **AWKWARD})
        print(f"{lesson.stem}: defaults ...", flush=True)
        at_defaults = execute(lesson, {})
        kept[lesson.stem] = {"small": at_small, "defaults": at_defaults}
        print(f"  {sum(at_small):.0f} s small, {sum(at_defaults):.0f} s at its defaults")
        CELLS.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    print(f"wrote {CELLS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", nargs="?", default=str(JUNIT), help="pytest's JUnit XML")
    parser.add_argument("--write-costs", action="store_true", help=f"write {COSTS.name}")
    parser.add_argument(
        "--cells", nargs="*", metavar="LESSON", help="measure the lessons' cells (all, or these)"
    )
    args = parser.parse_args()
    if args.cells is not None:
        measure_cells(args.cells)
    else:
        report(Path(args.junit), args.write_costs)


if __name__ == "__main__":
    main()

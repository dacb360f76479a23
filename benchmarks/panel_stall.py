"""Do panel cells stall? Many headless executions of the panel-heavy lessons, timed cell by
cell, with each slow cell taken apart by the kernel's own timestamps.

    python benchmarks/panel_stall.py [--runs 60] [--lessons 04 05 06 07] [--parallel 2]
                                     [--browser 0] [--out out/stall]

Executes the lessons with papermill (small parameters, those of tests/test_lessons.py),
`--parallel` at a time so that the runs load the cores as other work would, round robin
over `--lessons` until `--runs` executions are done. Every output notebook keeps, per
cell, papermill's start and end (the client's clock) and the kernel's message times
(nbclient's `record_timing`): status busy, execute_input, status idle, execute_reply.
Those split a slow cell into where its time went:

    queued   start -> busy       the request waited before the kernel took it up
    ran      busy -> idle        the kernel executed the cell (our code, its hooks)
    replied  idle -> reply       the execute_reply left after the kernel went idle
    received reply -> end        the client took the reply in (and the cell's outputs)

A cell is slow when it takes more than twice its median over all runs of its lesson and at
least 1 s more than it (below that, a few milliseconds of scheduling noise on a loaded
machine doubles a tiny cell). A cell is stalled when its request or its reply waited more
than 1 s outside the kernel (queued or received): the kernel was idle, and the time was
lost between it and the client. Prints each lesson's table (runs, slowest cell against
its median) and every slow cell, split as above, then both counts. Stalls are the defect
(see widgets/outputs.py); a slow cell that ran long in the kernel is the machine's load
(two lessons at once on two cores, each starting its ranks).

`--browser N` also runs lesson 05 N times through tests/test_browser.py's driver
(JupyterLab in Chromium; skips without Chromium) and counts the runs that passed and
each one's slowest cell against its median, from the driver's log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from test_lessons import LESSONS, SMALL  # noqa: E402 - the lessons' small CI parameters

PHASES = ("queued", "ran", "replied", "received")


def when(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def execute(path: Path, out: Path) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "papermill",
        str(path),
        str(out),
        "--cwd",
        str(path.parent),
        "--execution-timeout",
        "300",
        "--no-progress-bar",
        "--log-level",
        "ERROR",
    ]
    for name, value in SMALL[path.stem].items():
        args += ["-p", name, str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


def cells_of(out: Path) -> list[dict]:
    """Per code cell: its duration and the four phases, in seconds (None if unrecorded)."""
    cells = []
    for i, cell in enumerate(json.loads(out.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        pm, ex = cell["metadata"].get("papermill", {}), cell["metadata"].get("execution", {})
        if not pm.get("start_time") or not pm.get("end_time"):
            continue
        start, end = when(pm["start_time"]), when(pm["end_time"])
        marks = [
            ex.get(k) for k in ("iopub.status.busy", "iopub.status.idle", "shell.execute_reply")
        ]
        phases = None
        if all(marks):
            busy, idle, reply = map(when, marks)
            phases = dict(
                zip(PHASES, (busy - start, idle - busy, reply - idle, end - max(reply, idle)))
            )
        first = "".join(cell["source"]).strip().splitlines()
        cells.append(
            {
                "index": i,
                "s": end - start,
                "phases": phases,
                "line": next((ln for ln in first if not ln.startswith("#")), "")[:60],
            }
        )
    return cells


def headless(args: argparse.Namespace) -> int:
    paths = [p for p in LESSONS if p.stem[:2] in args.lessons]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [(k, paths[k % len(paths)]) for k in range(args.runs)]
    running: list[tuple[int, Path, Path, subprocess.Popen, float]] = []
    runs: dict[str, list[tuple[int, float, list[dict]]]] = {p.stem: [] for p in paths}
    failed = []
    t0 = time.perf_counter()
    while todo or running:
        while todo and len(running) < args.parallel:
            k, path = todo.pop(0)
            out = out_dir / f"{k:03d}_{path.name}"
            running.append((k, path, out, execute(path, out), time.perf_counter()))
        time.sleep(0.2)
        for item in [r for r in running if r[3].poll() is not None]:
            running.remove(item)
            k, path, out, proc, started = item
            wall = time.perf_counter() - started
            if proc.returncode != 0:
                failed.append((k, path.stem, proc.stderr.read().decode()[-300:]))
            if out.exists():
                runs[path.stem].append((k, wall, cells_of(out)))
            done = sum(len(v) for v in runs.values())
            print(
                f"[{time.perf_counter() - t0:6.0f} s] run {k:3d} {path.stem}: {wall:5.1f} s "
                f"({done} of {args.runs} done)",
                flush=True,
            )
    slow_total = stalls = 0
    for stem, done in runs.items():
        if not done:
            continue
        by_cell: dict[int, list[float]] = {}
        for _, _, cells in done:
            for c in cells:
                by_cell.setdefault(c["index"], []).append(c["s"])
        median = {i: statistics.median(v) for i, v in by_cell.items()}
        walls = [w for _, w, _ in done]
        slow = [
            (k, c)
            for k, _, cells in done
            for c in cells
            if c["s"] > max(2 * median[c["index"]], median[c["index"]] + 1.0)
        ]
        slow_total += len(slow)
        stalls += sum(
            1
            for _, _, cells in done
            for c in cells
            if c["phases"] and max(c["phases"]["queued"], c["phases"]["received"]) > 1.0
        )
        worst = max(
            (
                (c["s"] / median[c["index"]], c)
                for _, _, cs in done
                for c in cs
                if median[c["index"]] > 0.05
            ),
            key=lambda t: t[0],
        )
        print(
            f"\n{stem}: {len(done)} runs, {statistics.median(walls):.1f} s median "
            f"({min(walls):.1f}-{max(walls):.1f}); slow cells: {len(slow)}; the worst "
            f"cell against its median: {worst[0]:.2f}x (cell {worst[1]['index']}, "
            f"{worst[1]['s']:.2f} s against {median[worst[1]['index']]:.2f} s)"
        )
        for k, c in slow:
            split = (
                ", ".join(f"{p} {c['phases'][p]:.2f} s" for p in PHASES)
                if c["phases"]
                else "no kernel timestamps"
            )
            print(
                f"  run {k}, cell {c['index']} ({c['line']}): {c['s']:.2f} s against a "
                f"median of {median[c['index']]:.2f} s: {split}"
            )
    for k, stem, err in failed:
        print(f"\nrun {k} {stem} FAILED: {err}")
    print(
        f"\n{sum(len(v) for v in runs.values())} executions, {len(failed)} failed, "
        f"{stalls} stalled cells (over 1 s queued or received), {slow_total} slow cells "
        "(over twice their median and 1 s more)"
    )
    return stalls + len(failed)


def browser(n: int) -> int:
    """Lesson 05 through the browser test's driver, n times; its log gives each cell's
    seconds."""
    log = REPO / "out" / "browser" / "05_tensor_parallel.log"
    failures, per_run = 0, []
    for k in range(n):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                str(REPO / "tests" / "test_browser.py"),
                "-k",
                "05",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        if "skipped" in tail and "passed" not in tail:
            print(f"browser: skipped ({tail})")
            return 0
        failures += proc.returncode != 0
        seconds = {}
        if log.exists():
            for line in log.read_text().splitlines():
                if m := re.search(r"code cell (\d+) took ([\d.]+) s", line):
                    seconds[int(m[1])] = float(m[2])
        per_run.append(seconds)
        print(f"browser run {k}: {tail}", flush=True)
    cells = {i for s in per_run for i in s}
    worst, slow = (0.0, ""), []
    for i in sorted(cells):
        values = [s[i] for s in per_run if i in s]
        med = statistics.median(values)
        worst = max(
            worst, (max(values) / med, f"code cell {i}: {max(values):.1f} s against {med:.1f} s")
        )
        slow += [(k, i, v, med) for k, v in enumerate(values) if v > max(2 * med, med + 1.0)]
    print(
        f"browser: {n} runs of lesson 05, {failures} failed; the worst cell against its "
        f"median: {worst[0]:.2f}x ({worst[1]}; the driver reads a cell's time to 0.5 s); "
        f"slow cells (over twice their median and 1 s more): {len(slow)}"
    )
    for k, i, v, med in slow:
        print(f"  run {k}, code cell {i}: {v:.1f} s against a median of {med:.1f} s")
    return failures + len(slow)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--lessons", nargs="+", default=["04", "05", "06", "07"])
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--browser", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "out" / "stall"))
    args = parser.parse_args()
    bad = headless(args) if args.runs else 0
    bad += browser(args.browser) if args.browser else 0
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

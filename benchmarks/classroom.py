"""What one student's lessons take: each lesson run whole (papermill, its defaults), its kernel
and every process it started (ranks, forkserver) sampled while it runs.

    python benchmarks/classroom.py [--lessons 00,03] [--out parcourse/lesson_peaks.json]

Per lesson: the ranks it ran, its Run All time, the peak memory of the kernel's process tree
(PSS: shared pages divided among the processes sharing them, so the sum is what the tree
really holds), the peak number of processes and of TCP sockets (the kernel's five, the
store's, gloo's connections between ranks). Prints a table and writes it as JSON, with the
machine it was measured on: `python -m parcourse doctor --class N` reads it to size a
class server (parcourse.classroom.class_sizing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from parcourse.classroom import lessons_in  # noqa: E402
from parcourse.launch import usable_cpus  # noqa: E402

SAMPLE_S = 0.5


class Sampler(threading.Thread):
    """The peaks of this process' children (the kernel and everything it started)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.pss = self.processes = self.sockets = 0

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.wait(SAMPLE_S):
            pss = sockets = 0
            tree = me.children(recursive=True)
            for p in tree:
                try:
                    pss += p.memory_full_info().pss
                    sockets += len(p.net_connections(kind="tcp"))
                except psutil.Error:
                    pass
            self.pss = max(self.pss, pss)
            self.processes = max(self.processes, len(tree))
            self.sockets = max(self.sockets, sockets)


def measure(path: Path) -> dict[str, float]:
    import papermill

    sampler = Sampler()
    sampler.start()
    out = Path(tempfile.mkdtemp()) / path.name
    t0 = time.perf_counter()
    papermill.execute_notebook(
        str(path),
        str(out),
        kernel_name="python3",
        progress_bar=False,
        cwd=str(path.parent),
        start_timeout=300,
    )
    seconds = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    said = "".join(
        "".join(o.get("text", ""))
        for c in json.loads(out.read_text())["cells"]
        for o in c.get("outputs", [])
    )
    ranks = next((int(w.split()[0]) for w in said.split("here: running ")[1:2]), 0)
    return {
        "ranks": ranks,
        "run_all_s": round(seconds, 1),
        "peak_mib": round(sampler.pss / 2**20),
        "processes": sampler.processes,
        "sockets": sampler.sockets,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lessons", default="", help="lesson numbers, e.g. 00,03 (default: all)")
    p.add_argument("--out", default=str(REPO / "parcourse" / "lesson_peaks.json"))
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    wanted = {w for w in args.lessons.split(",") if w}
    out = Path(args.out)
    # some lessons measured again: the others' rows stay as they were
    rows = json.loads(out.read_text())["lessons"] if wanted and out.exists() else {}
    print(
        f"{'lesson':<34} {'ranks':>5} {'Run All s':>9} {'peak MiB':>9} {'processes':>9} "
        f"{'sockets':>8}",
        flush=True,
    )
    for path in lessons_in(REPO / "lessons"):
        if wanted and path.name[:2] not in wanted:
            continue
        r = rows[path.stem] = measure(path)
        print(
            f"{path.stem:<34} {r['ranks']:>5} {r['run_all_s']:>9.1f} {r['peak_mib']:>9} "
            f"{r['processes']:>9} {r['sockets']:>8}",
            flush=True,
        )
    machine = {
        "cpus": usable_cpus(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d"),
    }
    rows = {k: rows[k] for k in sorted(rows)}
    out.write_text(json.dumps({"machine": machine, "lessons": rows}, indent=1) + "\n")
    print(f"wrote {args.out} (measured on {machine['cpus']} CPUs)")


if __name__ == "__main__":
    main()

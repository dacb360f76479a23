"""Stanford CS336's systems suite (assignment 2: DDP, FSDP in fp32 and fp16, the sharded
optimizer) run twice in one go: through the course's classes and through torch's own,
each test's outcome side by side and the score of each.

    python benchmarks/cs336_systems.py --suite PATH [--timeout 600]

PATH: a checkout of the assignment (its `tests/` and `cs336-basics/`; not on PyPI, so it
is not fetched here). Its model code needs einops, einx and jaxtyping: pinned below and
installed with pip into runs/cs336-deps (nothing else of the environment changes). Each
run copies the suite's tests to a temporary folder, puts
`benchmarks/cs336/{course,torch}_adapters.py` in place of its `tests/adapters.py`, and
runs pytest there (the attention tests are left out: they are not distributed training).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ADAPTERS = Path(__file__).resolve().parent / "cs336"
DEPS = REPO / "runs" / "cs336-deps"
# what cs336_basics.model imports, with their own dependencies; --no-deps keeps torch's
PINNED = [
    "einops==0.8.2",
    "einx==0.4.3",
    "frozendict==2.5.1",
    "jaxtyping==0.3.11",
    "wadler_lindig==0.1.8",
]
FILES = ["test_ddp.py", "test_fsdp.py", "test_sharded_optimizer.py"]


def install_deps() -> None:
    stamp = DEPS / ".installed"
    if stamp.exists() and stamp.read_text().split() == PINNED:
        return
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(DEPS), *PINNED],
        check=True,
    )
    stamp.write_text("\n".join(PINNED))


def run_suite(suite: Path, impl: str, timeout: float) -> dict[str, str]:
    """Each test's outcome ("passed", "failed", "error", "skipped") with `impl`'s adapters."""
    with tempfile.TemporaryDirectory() as tmp:
        tests = Path(tmp) / "tests"
        shutil.copytree(suite / "tests", tests)
        shutil.copy(ADAPTERS / f"{impl}_adapters.py", tests / "adapters.py")
        junit = Path(tmp) / "junit.xml"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(DEPS), str(suite / "cs336-basics"), str(REPO)]),
            "OMP_NUM_THREADS": "1",
        }
        try:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    f"--junitxml={junit}",
                    *(f"tests/{f}" for f in FILES),
                ],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return {"(the whole run)": f"timed out after {timeout:g} s"}
        outcomes = {}
        for case in ET.parse(junit).iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
            outcomes[name] = {"failure": "failed"}.get(bad[0].tag, bad[0].tag) if bad else "passed"
            if bad and bad[0].tag != "skipped":
                outcomes[name] += ": " + _why(bad[0].text or bad[0].get("message", ""))
        return outcomes


def _why(text: str) -> str:
    """The last assertion or exception line of a failure (a rank's, inside spawn's)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith(("AssertionError", "E   ", "RuntimeError"))]
    last = (said or lines or [""])[-1].removeprefix("E").strip()
    return last[:160]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", required=True, type=Path, help="a checkout of the assignment")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each run")
    args = p.parse_args()
    suite = args.suite.resolve()
    missing = [
        f for f in ["cs336-basics", *(f"tests/{f}" for f in FILES)] if not (suite / f).exists()
    ]
    if missing:
        p.error(f"{suite} is not a checkout of CS336's assignment 2: no {', '.join(missing)}")
    install_deps()
    results = {impl: run_suite(suite, impl, args.timeout) for impl in ("course", "torch")}
    names = sorted(set(results["course"]) | set(results["torch"]))
    width = max(len(n) for n in names) + 2
    print(
        f"CS336 assignment 2 (systems), {suite.name}; torch {torch_version()}, CPU, gloo, 2 ranks"
    )
    print(f"{'test':<{width}}{'course':>10}{'torch':>10}")
    for name in names:
        course, peer = (results[impl].get(name, "-").split(":")[0] for impl in ("course", "torch"))
        print(f"{name:<{width}}{course:>10}{peer:>10}")
    scores = {impl: sum(v == "passed" for v in r.values()) for impl, r in results.items()}
    print(f"{'passed':<{width}}{scores['course']:>7}/{len(names)}{scores['torch']:>7}/{len(names)}")
    for impl, outcomes in results.items():
        for name, outcome in outcomes.items():
            if ": " in outcome:
                print(f"{impl}, {name}: {outcome.split(': ', 1)[1]}")


def torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()

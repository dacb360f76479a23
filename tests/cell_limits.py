"""How long a lesson's cell may run in the tests before it counts as hung.

A limit guards a hang, not a speed: each code cell may take MARGIN times what it was
measured to take on the 2-core machine (lessons/cell_seconds.json, written by
`python benchmarks/suite.py --cells`), and never less than FLOOR_S. In a suite beside an
8-rank job a cell has been seen to take 14 times that (lesson 10's training cell at its
defaults: 189 s against 13.6 s); MARGIN leaves room above it. "small" is a lesson at its small
parameters at world size 3 (papermill and the browser test), "defaults" at its own
parameters (nbval).
"""

from __future__ import annotations

import json
from pathlib import Path

CELLS = Path(__file__).resolve().parent.parent / "lessons" / "cell_seconds.json"
SECONDS: dict[str, dict[str, list[float]]] = json.loads(CELLS.read_text()) if CELLS.exists() else {}
MARGIN = 25
FLOOR_S = 120.0
UNMEASURED_S = 300.0  # a cell a test adds, or one not measured yet


def expected(lesson: str, cell: int | None, kind: str) -> float | None:
    """What code cell `cell` of `lesson` was measured to take (None if never)."""
    measured = SECONDS.get(lesson, {}).get(kind, [])
    return measured[cell] if cell is not None and 0 <= cell < len(measured) else None


def limit(lesson: str, cell: int | None, kind: str) -> float:
    seconds = expected(lesson, cell, kind)
    return UNMEASURED_S if seconds is None else max(FLOOR_S, MARGIN * seconds)


def lesson_limit(lesson: str, kind: str) -> float:
    """All of a lesson's cells, one after another."""
    measured = SECONDS.get(lesson, {}).get(kind)
    return UNMEASURED_S * 4 if not measured else FLOOR_S + MARGIN * sum(measured)


def too_long(lesson: str, cell: int | None, kind: str, ran: float) -> str:
    """The sentence a timeout fails with: the cell, what it takes, how long it ran."""
    seconds = expected(lesson, cell, kind)
    takes = (
        f"it takes {seconds:.1f} s ({kind}, {CELLS.name})"
        if seconds is not None
        else "never measured"
    )
    where = f"code cell {cell}" if cell is not None else "a cell the test added"
    return (
        f"{lesson}: {where} still running after {ran:.0f} s, past its limit of "
        f"{limit(lesson, cell, kind):.0f} s; {takes}: a hang, or the cell got "
        f"{MARGIN} times slower (remeasure: python benchmarks/suite.py --cells {lesson})"
    )

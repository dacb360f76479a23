"""For a class: the lessons without their solutions, and the exercises graded.

A lesson's exercise is three things in its notebook: a stub (a code cell whose function
raises NotImplementedError until the learner writes it), the check right after it
(`passed = check_x(my_x, ...)`: it prints a hint and returns False until the answer is
right, "Not written yet" while the stub is untouched), and the solution, in cells tagged
`solution` (its heading and explanation, its code, the check of it).

- `student_build(lessons, out)`: every lesson with its solution cells removed and its
  outputs cleared. Nothing after an exercise needs its answer (a lesson's later cells use
  the library's own code, or the learner's once its check passes), so Run All runs to the
  end with every exercise unsolved, each check saying "Not written yet".
- `grade(submissions, lessons)`: each student's notebooks (SUBMISSIONS/STUDENT/LESSON.ipynb)
  executed in a kernel of their own (nbclient); after the last cell, each exercise's check
  is asked again in that kernel on the learner's own function. A point an exercise; the
  checks try cases the lesson does not show (random ones among them), so a hard-coded
  answer to the printed example does not pass. Returns the table student x exercise.

A small grader on nbclient, not nbgrader: nbgrader's autograding needs its own cell
metadata, a course database and an exchange directory, where the course already has a
check per exercise that prints its hint; running that check again is the whole grade.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SOLUTION_TAG = "solution"
_STUB = "raise NotImplementedError"


@dataclass(frozen=True)
class Exercise:
    """One exercise of a lesson: its id ("02 my_buckets"), the stub's function or class
    name, and the check call that judges it (the check cell's source, without `passed =`)."""

    lesson: str
    name: str
    check: str

    @property
    def id(self) -> str:
        return f"{self.lesson[:2]} {self.name}"


def lessons_in(directory: str | Path) -> list[Path]:
    return sorted(Path(directory).glob("[0-9][0-9]_*.ipynb"))


def _source(cell: dict[str, Any]) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def is_solution(cell: dict[str, Any]) -> bool:
    return SOLUTION_TAG in cell.get("metadata", {}).get("tags", [])


def exercises(notebook: dict[str, Any], lesson: str) -> list[Exercise]:
    """The lesson's exercises, in order: each stub and the check cell after it."""
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    out = []
    for i, cell in enumerate(cells):
        text = _source(cell)
        if _STUB not in text or is_solution(cell):
            continue
        defined = re.findall(r"^(?:def|class) (\w+)", text, re.M)
        after = next((_source(c) for c in cells[i + 1 :] if "check" in _source(c)), None)
        if not defined or after is None:
            raise ValueError(
                f"{lesson}: the exercise stub {defined or text[:40]!r} has no "
                "function and check after it"
            )
        call = re.search(r"^passed = (.+)$", after, re.M)
        if call is None:
            raise ValueError(
                f"{lesson}: the check after {defined[-1]} does not read `passed = check(...)`"
            )
        name = next((d for d in defined if re.search(rf"\b{d}\b", call.group(1))), None)
        if name is None:
            raise ValueError(
                f"{lesson}: the check {call.group(1)!r} asks none of {', '.join(defined)}"
            )
        out.append(Exercise(lesson, name, call.group(1)))
    return out


def student_notebook(notebook: dict[str, Any]) -> dict[str, Any]:
    """The notebook without its solution cells, every output cleared."""
    nb = copy.deepcopy(notebook)
    nb["cells"] = [c for c in nb["cells"] if not is_solution(c)]
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    nb.get("metadata", {}).pop("widgets", None)
    return nb


def student_build(lessons: str | Path, out: str | Path) -> list[Path]:
    """Every lesson under `lessons` written to `out` for students; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in lessons_in(lessons):
        notebook = json.loads(path.read_text())
        exercises(notebook, path.stem)  # every exercise well formed, or say which is not
        target = out / path.name
        target.write_text(
            json.dumps(student_notebook(notebook), indent=1, ensure_ascii=False) + "\n"
        )
        written.append(target)
    return written


@dataclass
class Grades:
    """Student x exercise: True (passed), False (did not), None (no notebook handed in);
    and what each failed check said."""

    exercises: list[str]
    marks: dict[str, dict[str, bool | None]] = field(default_factory=dict)
    said: dict[tuple[str, str], str] = field(default_factory=dict)
    errors: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # cells that raised

    def points(self, student: str) -> int:
        return sum(1 for v in self.marks[student].values() if v)

    def table(self) -> str:
        """One row per student, one column per exercise: 1, 0, or - (not handed in)."""
        width = max([7, *(len(s) for s in self.marks)])
        head = f"{'student':<{width}} " + " ".join(self.exercises) + "  points"
        rows = [head]
        for student, marks in sorted(self.marks.items()):
            cells = " ".join(f"{_shown(marks[e]):^{len(e)}}" for e in self.exercises)
            rows.append(
                f"{student:<{width}} {cells}  {self.points(student):>3}/{len(self.exercises)}"
            )
        return "\n".join(rows)


def _shown(mark: bool | None) -> str:
    """A mark as `Grades.table` shows it: 1, 0, or - (not handed in)."""
    return "-" if mark is None else str(int(mark))


_ASK = """
import contextlib as _c, io as _io, json as _j
_verdicts = {}
for _id, _call in %s:
    _said = _io.StringIO()
    try:
        with _c.redirect_stdout(_said):
            _ok = bool(eval(_call))
    except Exception as _e:  # a check never raises; a kernel that lost a name might
        _ok, _said = False, _io.StringIO(f"{type(_e).__name__}: {_e}")
    _verdicts[_id] = [_ok, _said.getvalue().strip()[:300]]
print("__verdicts__" + _j.dumps(_verdicts))
"""


def grade_notebook(
    path: Path, found: list[Exercise], timeout: float = 600
) -> tuple[dict[str, Any], list[str]]:
    """Execute a student's notebook (a cell that raises does not stop it), then ask each
    exercise's check again in its kernel: ({exercise id: [passed, what the check said]},
    the errors the notebook's own cells raised, one line each)."""
    import nbformat
    from nbclient import NotebookClient

    calls = [(e.id, e.check) for e in found]
    for attempt in (1, 2):
        nb = nbformat.read(str(path), as_version=4)
        nb.cells.append(nbformat.v4.new_code_cell(_ASK % repr(calls)))
        try:
            NotebookClient(
                nb,
                timeout=timeout,
                kernel_name="python3",
                allow_errors=True,
                startup_timeout=300,  # a class's server starts many kernels at once
                resources={"metadata": {"path": str(path.parent)}},
            ).execute()
            break
        except RuntimeError as e:
            # Only a kernel that never answered its start is started once more:
            # jupyter_client picks its ports before the kernel binds them, and beside
            # other work another process can take one in between.
            started = "Kernel didn't respond" in str(e) or "Kernel died before" in str(e)
            if attempt == 2 or not started:
                raise
    errors = [
        f"{o.get('ename')}: {o.get('evalue', '')}"[:200]
        for c in nb.cells[:-1]
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    for output in nb.cells[-1].get("outputs", []):
        text = output.get("text", "")
        if "__verdicts__" in text:
            verdicts: dict[str, Any] = json.loads(text.split("__verdicts__", 1)[1])
            return verdicts, errors
    return {e.id: [False, "the notebook did not run to its end"] for e in found}, errors


def grade(submissions: str | Path, lessons: str | Path, timeout: float = 600) -> Grades:
    """Every student's notebooks under `submissions` (one folder a student, the lessons'
    own file names) graded against the exercises of the lessons under `lessons`."""
    by_lesson = {p.name: exercises(json.loads(p.read_text()), p.stem) for p in lessons_in(lessons)}
    ids = [e.id for found in by_lesson.values() for e in found]
    grades = Grades(ids)
    students = sorted(p for p in Path(submissions).iterdir() if p.is_dir())
    if not students:
        raise ValueError(
            f"no student folders under {submissions} (one folder a student, "
            "holding their lesson notebooks)"
        )
    for student in students:
        marks: dict[str, bool | None] = {i: None for i in ids}
        for name, found in by_lesson.items():
            handed_in = student / name
            if not found or not handed_in.exists():
                continue
            verdicts, errors = grade_notebook(handed_in, found, timeout)
            if errors:
                grades.errors[(student.name, name)] = errors
            for exercise_id, (ok, said) in verdicts.items():
                marks[exercise_id] = ok
                if not ok:
                    grades.said[(student.name, exercise_id)] = said
        grades.marks[student.name] = marks
    return grades


# -- sizing a class server

PEAKS_FILE = Path(__file__).with_name("lesson_peaks.json")
HEADROOM = 1.25  # on a student's heaviest lesson: the server, a notebook left open
STUDENT_CPUS = 2  # the lessons' Run All times were measured with 2 CPUs


def lesson_peaks(path: str | Path = PEAKS_FILE) -> dict[str, Any]:
    """What each lesson took when run whole at its defaults (`benchmarks/classroom.py`
    measures and writes it): {"machine": {...}, "lessons": {lesson: {"ranks", "run_all_s",
    "peak_mib", "processes", "sockets"}}}."""
    return json.loads(Path(path).read_text())


def _ephemeral_ports() -> int | None:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(high) - int(low) + 1
    except (OSError, ValueError):
        return None


def class_sizing(
    students: int, peaks: dict[str, Any] | None = None, here: dict[str, float | None] | None = None
) -> tuple[str, bool]:
    """The server a class of `students` needs, from the measured lesson peaks, against this
    machine (`here`: {"cpus", "memory_gib", "ports"}; default: measured now). Returns the
    text and whether this machine is enough. One lesson open at a time per student: a
    kernel left running keeps its ranks (the Running tab of JupyterLab shuts it down)."""
    import psutil

    from parcourse.launch import usable_cpus

    if students < 1:
        raise ValueError(f"a class needs 1 student or more, got {students}")
    peaks = lesson_peaks() if peaks is None else peaks
    rows = peaks["lessons"]
    if not rows:
        raise ValueError("no lesson measured: python benchmarks/classroom.py")
    if here is None:
        here = {
            "cpus": usable_cpus(),
            "memory_gib": psutil.virtual_memory().total / 2**30,
            "ports": _ephemeral_ports(),
        }
    m = peaks["machine"]
    lines = [
        f"each lesson at its defaults, run whole (measured on {m['cpus']} CPUs, "
        f"{m['date']}: python benchmarks/classroom.py)",
        f"  {'lesson':<32} {'ranks':>5} {'Run All s':>9} {'peak MiB':>9} {'sockets':>8}",
    ]
    for lesson, r in rows.items():
        lines.append(
            f"  {lesson:<32} {r['ranks']:>5} {r['run_all_s']:>9.1f} "
            f"{r['peak_mib']:>9} {r['sockets']:>8}"
        )
    heaviest = max(rows, key=lambda k: rows[k]["peak_mib"])
    memory_gib = rows[heaviest]["peak_mib"] * HEADROOM / 1024
    sockets = max(r["sockets"] for r in rows.values())
    need = {
        "cpus": STUDENT_CPUS * students,
        "memory_gib": memory_gib * students,
        "ports": sockets * students,
    }
    lines += [
        f"a student: {STUDENT_CPUS} CPUs (1 at the least: the lessons then start fewer "
        f"ranks and say so), {memory_gib:.1f} GiB ({heaviest[:2]}'s peak + "
        f"{HEADROOM - 1:.0%}), {sockets} TCP sockets",
        f"a class of {students}: {need['cpus']} CPUs, {need['memory_gib']:.1f} GiB, "
        f"{need['ports']} sockets",
    ]

    def below(key: str) -> bool:
        return here[key] is not None and here[key] < need[key]

    # Memory and ports must hold; CPUs short of 2 a student only slow the lessons down,
    # short of one a student they do not run as measured.
    too_few_cpus = here["cpus"] is not None and here["cpus"] < students
    short = []
    if below("cpus"):
        short.append(
            f"{here['cpus']} CPUs of {need['cpus']}"
            + (
                f", under one a student ({students})"
                if too_few_cpus
                else " (at least one a student: lessons run fewer ranks, slower)"
            )
        )
    if below("memory_gib"):
        short.append(f"{here['memory_gib']:.1f} GiB of memory of {need['memory_gib']:.1f}")
    if below("ports"):
        short.append(f"{here['ports']} ephemeral ports of {need['ports']}")
    memory = "?" if here["memory_gib"] is None else f"{here['memory_gib']:.1f}"
    lines.append(
        f"this machine: {here['cpus']} CPUs, {memory} GiB, "
        f"{here['ports'] or '?'} ephemeral ports: "
        + ("enough" if not short else "short: " + "; ".join(short))
    )
    enough = not (too_few_cpus or below("memory_gib") or below("ports"))
    return "\n".join(lines), enough

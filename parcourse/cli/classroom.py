"""`python -m parcourse build-student OUT` and `python -m parcourse grade SUBMISSIONS`: the
lessons without their solutions for a class, and the class's notebooks graded
(parcourse.classroom)."""

from __future__ import annotations

import argparse
from pathlib import Path


class BuildStudent:
    HELP = "the lessons without their solutions, outputs cleared, for a class"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("out", help="where the student notebooks go")
        p.add_argument("--lessons", default="lessons", help="the course's lessons")

    @staticmethod
    def check(args: argparse.Namespace) -> str | None:
        if not any(Path(args.lessons).glob("[0-9][0-9]_*.ipynb")):
            return f"no lessons under {args.lessons} (give --lessons, the course's folder)"
        if Path(args.out).resolve() == Path(args.lessons).resolve():
            return "the student build would overwrite the lessons: give another folder"
        return None

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        import json

        from parcourse.classroom import exercises, student_build

        written = student_build(args.lessons, args.out)
        count = sum(len(exercises(json.loads(p.read_text()), p.stem)) for p in written)
        print(
            f"build-student  {len(written)} lessons, {count} exercises, solutions removed "
            f"and outputs cleared, in {args.out}"
        )
        return 0


class Grade:
    HELP = "grade a class: SUBMISSIONS/STUDENT/LESSON.ipynb, a table student x exercise"

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("submissions", help="one folder a student, holding their notebooks")
        p.add_argument("--lessons", default="lessons", help="the course's lessons")
        p.add_argument("--timeout", type=float, default=600.0, help="seconds a cell")

    @staticmethod
    def check(args: argparse.Namespace) -> str | None:
        if not Path(args.submissions).is_dir():
            return f"{args.submissions} is not a folder (one folder a student inside)"
        if not any(Path(args.lessons).glob("[0-9][0-9]_*.ipynb")):
            return f"no lessons under {args.lessons} (give --lessons, the course's folder)"
        return None

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from parcourse.classroom import grade

        grades = grade(args.submissions, args.lessons, args.timeout)
        print(grades.table())
        for (student, exercise), said in sorted(grades.said.items()):
            first = said.splitlines()[0] if said else "(no answer)"
            print(f"  {student}, {exercise}: {first}")
        return 0

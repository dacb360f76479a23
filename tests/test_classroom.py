"""The classroom: a student build without solutions that runs to its end with every
exercise unsolved, and a grader that gives the solutions full marks, the stubs none, and
names the exercise a wrong answer fails."""

import json
import re
import shutil
from pathlib import Path

import pytest

from parcourse.classroom import exercises, grade, is_solution, lessons_in, student_build
from parcourse.cli import main

REPO = Path(__file__).resolve().parent.parent
LESSONS = REPO / "lessons"
SOLUTION_NAME = re.compile(r"\b(solution_\w+|Solution\w*)\b")


def _source(cell):
    return "".join(cell["source"])


def at_small(notebook, name):
    """The notebook's parameters cell set to the lesson's small parameters (as a student
    may set their own): the values CI runs it at."""
    small = json.loads((LESSONS / "small_parameters.json").read_text())[Path(name).stem]
    cell = next(c for c in notebook["cells"] if "parameters" in c["metadata"].get("tags", []))
    text = _source(cell)
    for key, value in small.items():
        text, found = re.subn(rf"^{key} = .*$", f"{key} = {value!r}", text, flags=re.M)
        assert found == 1, (name, key)
    cell["source"] = text


def solved(notebook):
    """The student notebook with each stub replaced by its lesson's solution (the
    solution's names turned into the stub's): what a class that solved every exercise
    hands in."""
    lesson = notebook["_lesson"]
    solutions = [
        _source(c)
        for c in lesson["cells"]
        if is_solution(c)
        and c["cell_type"] == "code"
        and re.search(r"^(def|class) (solution_|Solution)", _source(c), re.M)
    ]
    out = json.loads(json.dumps(notebook["_student"]))
    stubs = [c for c in out["cells"] if "raise NotImplementedError" in _source(c)]
    assert len(stubs) == len(solutions)
    for stub, answer in zip(stubs, solutions):
        mine = re.findall(r"^(?:def|class) (\w+)", _source(stub), re.M)[-1]
        theirs = re.findall(r"^(?:def|class) (solution_\w+|Solution\w*)", answer, re.M)[-1]
        keep = [
            line for line in _source(stub).splitlines() if line.startswith(("import ", "from "))
        ]  # the stub cell's own imports
        stub["source"] = "\n".join(keep + [""] + [re.sub(rf"\b{theirs}\b", mine, answer)])
    return out


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    student_build(LESSONS, out)
    return out


def test_the_student_build_has_no_solution_text(build):
    for lesson in lessons_in(LESSONS):
        source = json.loads(lesson.read_text())
        text = (build / lesson.name).read_text()
        student = json.loads(text)
        assert not SOLUTION_NAME.search(text), lesson.stem
        assert all(not c.get("outputs") for c in student["cells"] if c["cell_type"] == "code")
        given = "\n".join(
            _source(c)
            for c in source["cells"]  # what the lesson says anyway
            if not is_solution(c)
        )
        for cell in source["cells"]:
            if not is_solution(cell):
                continue
            for line in _source(cell).splitlines():
                line = line.strip()
                if len(line) > 25 and not line.startswith("#") and line not in given:
                    assert json.dumps(line)[1:-1] not in text, (lesson.stem, line)
        assert len(exercises(student, lesson.stem)) == len(exercises(source, lesson.stem))


def test_every_exercise_is_found_with_its_check_and_solution():
    found = [
        e
        for lesson in lessons_in(LESSONS)
        for e in exercises(json.loads(lesson.read_text()), lesson.stem)
    ]
    assert len(found) >= 16
    for lesson in lessons_in(LESSONS):
        notebook = json.loads(lesson.read_text())
        stubs = len(exercises(notebook, lesson.stem))
        answers = [
            c
            for c in notebook["cells"]
            if is_solution(c)
            and c["cell_type"] == "code"
            and re.search(r"^(def|class) (solution_|Solution)", _source(c), re.M)
        ]
        assert len(answers) == stubs, lesson.stem
        for cell in notebook["cells"]:  # nothing outside the solution needs the solution
            if not is_solution(cell):
                assert not SOLUTION_NAME.search(_source(cell)), (lesson.stem, _source(cell))


def test_the_grader_gives_the_solutions_full_marks_the_stubs_none(build, tmp_path):
    """Lesson 03 handed in by three students: every exercise solved, none (the student
    build as it is: it runs to its end, each check saying "Not written yet"), and one wrong
    answer (the grader names the exercise and the check's hint)."""
    name = "03_memory_and_zero.ipynb"
    lesson = json.loads((LESSONS / name).read_text())
    student = json.loads((build / name).read_text())
    wrong = json.loads(json.dumps(student))
    for cell in wrong["cells"]:
        if "raise NotImplementedError" in _source(cell):
            cell["source"] = re.sub(
                r"raise NotImplementedError", "return param.flatten()", _source(cell)
            )
    hand_in = {"ada": solved({"_lesson": lesson, "_student": student}), "bob": student, "cy": wrong}
    for notebook in hand_in.values():  # each ran at the lesson's small parameters, in seconds
        at_small(notebook, name)
    submissions, only = tmp_path / "submissions", tmp_path / "lessons"
    for who, notebook in hand_in.items():
        (submissions / who).mkdir(parents=True)
        (submissions / who / name).write_text(json.dumps(notebook))
    only.mkdir()
    shutil.copy(LESSONS / name, only / name)
    grades = grade(submissions, only)
    both = ["03 my_update", "03 my_rows"]
    assert grades.exercises == both
    assert grades.marks == {
        "ada": dict.fromkeys(both, True),
        "bob": dict.fromkeys(both, False),
        "cy": dict.fromkeys(both, False),
    }
    assert not grades.errors, grades.errors  # Run All ran to the end, unsolved too
    assert grades.said[("bob", "03 my_rows")].startswith("Not written yet")
    assert grades.said[("cy", "03 my_rows")].startswith("Not quite")  # the check's hint
    assert grades.said[("cy", "03 my_update")].startswith("Not yet")  # its NameError, named
    table = grades.table()  # what `python -m parcourse grade` prints, with the hints
    assert re.search(r"^ada\s+1\s+1\s+2/2$", table, re.M), table
    assert re.search(r"^bob\s+0\s+0\s+0/2$", table, re.M), table


def test_solved_builds_replace_every_stub():
    """For every lesson the solutions pasted into the stubs leave no stub (what a class
    that solved everything would hand in), and the check cells still ask the stubs' names."""
    for lesson in lessons_in(LESSONS):
        source = json.loads(lesson.read_text())
        from parcourse.classroom import student_notebook

        student = student_notebook(source)
        answered = solved({"_lesson": source, "_student": student})
        assert "raise NotImplementedError" not in json.dumps(answered), lesson.stem
        for e in exercises(source, lesson.stem):
            assert any(
                re.search(rf"^(def|class) {e.name}\b", _source(c), re.M) for c in answered["cells"]
            ), (lesson.stem, e.name)


def test_build_student_and_grade_refuse_bad_folders_in_one_line(capsys, tmp_path):
    for argv, said in (
        (["build-student", str(LESSONS), "--lessons", str(LESSONS)], "would overwrite the lessons"),
        (["grade", str(tmp_path / "none")], "is not a folder"),
        (["grade", str(tmp_path), "--lessons", str(tmp_path)], "no lessons under"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert said in capsys.readouterr().err
    with pytest.raises(ValueError, match="no student folders"):
        grade(tmp_path, LESSONS)


PEAKS = {
    "machine": {"cpus": 2, "memory_gib": 16, "platform": "Linux", "date": "2026-11-28"},
    "lessons": {
        "00_launching_ranks": {
            "ranks": 4,
            "run_all_s": 9.7,
            "peak_mib": 560,
            "processes": 7,
            "sockets": 41,
        },
        "09_mesh_and_3d": {
            "ranks": 8,
            "run_all_s": 46.0,
            "peak_mib": 2048,
            "processes": 11,
            "sockets": 120,
        },
    },
}


def test_a_class_is_sized_from_its_heaviest_lesson():
    """30 students: 2 CPUs each, the heaviest lesson's peak + 25% each (2.5 GiB), its
    sockets each; a machine short of memory is not enough, one short of CPUs only slower."""
    from parcourse.classroom import class_sizing

    text, enough = class_sizing(30, PEAKS, {"cpus": 64, "memory_gib": 100, "ports": 28232})
    assert "a student: 2 CPUs" in text and "2.5 GiB (09's peak + 25%), 120 TCP sockets" in text
    assert "a class of 30: 60 CPUs, 75.0 GiB, 3600 sockets" in text
    assert enough and text.endswith("enough")
    text, enough = class_sizing(30, PEAKS, {"cpus": 40, "memory_gib": 100, "ports": 28232})
    assert enough and "40 CPUs of 60 (at least one a student" in text
    text, enough = class_sizing(30, PEAKS, {"cpus": 64, "memory_gib": 64, "ports": 3000})
    assert not enough and "64.0 GiB of memory of 75.0" in text and "3000 ephemeral ports" in text
    text, enough = class_sizing(30, PEAKS, {"cpus": 16, "memory_gib": 100, "ports": None})
    assert not enough and "under one a student (30)" in text
    with pytest.raises(ValueError, match="1 student or more"):
        class_sizing(0, PEAKS)

"""The CPUs a process is given (affinity and cgroup quota, not os.cpu_count()) and the ranks
a lesson starts on them; a lesson run under a 1-CPU affinity."""

import json
import os
import shutil

import pytest

from parcourse.launch import cpus
from parcourse.launch.cpus import lesson_ranks, usable_cpus


def test_a_lesson_keeps_its_default_where_the_cpus_carry_it(capsys):
    assert lesson_ranks(None, 4, cpus=2) == 4
    said = capsys.readouterr().out
    assert said == "2 CPUs here: running 4 ranks on 2 cores, timings are shared\n"
    assert lesson_ranks(None, 4, cpus=16) == 4
    assert capsys.readouterr().out == "16 CPUs here: running 4 ranks, a core each\n"


def test_on_fewer_cpus_a_lesson_runs_fewer_ranks_among_its_sizes_and_says_so(capsys):
    assert lesson_ranks(None, 4, cpus=1) == 2
    assert "(fewer than the lesson's 4: set world_size to choose)" in capsys.readouterr().out
    # only among the sizes the lesson runs at (tensor parallelism's divide its heads)
    assert lesson_ranks(None, 6, sizes=(1, 2, 3, 4, 6), cpus=2) == 4
    assert lesson_ranks(None, 6, sizes=(1, 2, 3, 4, 6), cpus=1) == 2
    assert lesson_ranks(None, 8, per_cpu=4, cpus=2) == 8  # ranks asleep in simulated compute
    assert lesson_ranks(None, 8, sizes=(4, 8), cpus=1) == 4  # never below the smallest size


def test_a_learners_own_number_is_kept_with_a_warning_when_it_is_many_a_cpu(capsys):
    assert lesson_ranks(8, 4, cpus=1) == 8
    assert "expect it slower" in capsys.readouterr().out
    assert lesson_ranks(1, 4, cpus=1, say=False) == 1
    for wrong in (0, -2, 2.0, "4", True):
        with pytest.raises(ValueError, match="whole number of ranks"):
            lesson_ranks(wrong, 4, cpus=2)


def test_usable_cpus_follows_the_affinity_mask():
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})  # this thread's mask
    try:
        assert usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, before)
    assert 1 <= usable_cpus() <= len(before)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_a_cgroup_quota_caps_the_cpus(version, tmp_path, monkeypatch):
    """A container given 1.5 CPUs by its quota on a many-core machine: 1 usable. The
    tightest quota along the cgroup's parents counts."""
    leaf = tmp_path / "kubepods" / "student"
    leaf.mkdir(parents=True)
    if version == "v2":
        (leaf / "cpu.max").write_text("150000 100000\n")
        (tmp_path / "kubepods" / "cpu.max").write_text("max 100000\n")
    else:
        (leaf / "cpu.cfs_quota_us").write_text("150000\n")
        (leaf / "cpu.cfs_period_us").write_text("100000\n")
        (tmp_path / "kubepods" / "cpu.cfs_quota_us").write_text("400000\n")
        (tmp_path / "kubepods" / "cpu.cfs_period_us").write_text("100000\n")
    monkeypatch.setattr(cpus, "CGROUP", tmp_path)
    monkeypatch.setattr(cpus, "_cgroup_paths", lambda: [(version, leaf)])
    assert cpus.cgroup_cpu_quota() == 1.5
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert usable_cpus() == 1
    (leaf / ("cpu.max" if version == "v2" else "cpu.cfs_quota_us")).write_text(
        "max 100000\n" if version == "v2" else "-1\n"
    )
    assert cpus.cgroup_cpu_quota() == (None if version == "v2" else 4.0)


@pytest.mark.notebook
@pytest.mark.skipif(
    bool(shutil.which("node") and shutil.which("npm")),
    reason="tests/test_class_server.py runs lesson 00 this way, its world size "
    "left to the lesson, for each of its students (each on one core)",
)
def test_a_lesson_under_one_cpu_picks_ranks_it_can_run_and_finishes(tmp_path):
    """Lesson 00 with its world size left to the machine, its kernel (and so its ranks)
    pinned to one CPU: it says so in one line, runs 2 ranks, and runs to its end."""
    import papermill
    from test_lessons import KERNEL_START_S, LESSONS, SMALL

    path = next(p for p in LESSONS if p.stem == "00_launching_ranks")
    parameters = {k: v for k, v in SMALL[path.stem].items() if k != "world_size"}
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})  # this thread's mask, which the kernel inherits
    try:
        papermill.execute_notebook(
            str(path),
            str(tmp_path / path.name),
            parameters=parameters,
            kernel_name="python3",
            progress_bar=False,
            start_timeout=KERNEL_START_S,
            cwd=str(path.parent),
        )
    finally:
        os.sched_setaffinity(0, before)
    cells = json.loads((tmp_path / path.name).read_text())["cells"]
    said = "".join(
        "".join(o.get("text", ""))
        for c in cells
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
    )
    assert "1 CPU here: running 2 ranks on 1 core" in said
    assert "rank 1 of 2" in said

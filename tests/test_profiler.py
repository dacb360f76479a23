"""torch.profiler on the ranks (`launch(..., profile=...)`, `Pool.run(..., profile=...)`):
each rank's profile comes back, the merged Perfetto file holds the course's spans and
torch's operators of every rank, and both are on one clock: a course span contains the
operators that ran inside it, on the rank's own thread and on gloo's."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parcourse.launch import Pool, launch
from parcourse.profiler import COURSE_TRACKS, Profile


def matmuls_and_reduces(ctx, n: int = 3):
    """`n` times: a matmul of a rank's own size in a span, then an all-reduce in one."""
    size = 32 + 8 * ctx.rank  # each rank's shapes its own
    a, total = torch.randn(size, size), torch.zeros(64)
    for i in range(n):
        with ctx.tracer.span("matmul", step=i):
            b = a @ a
        total[0] = b.sum()
        with ctx.tracer.span("all_reduce", kind="comm", step=i):
            dist.all_reduce(total)
    return torch._C._autograd._profiler_enabled()


def test_bad_profile_refused_before_any_process_starts():
    for bad in ("yes", 1, None, {"memory": True}):
        with pytest.raises(ValueError, match="profile must be True, False or a Profile"):
            launch(matmuls_and_reduces, 2, profile=bad)
    with pytest.raises(ValueError, match="top must be an int >= 1"):
        Profile(top=0)
    with pytest.raises(ValueError, match="within must be a span's name"):
        Profile(within="")
    with pytest.raises(ValueError, match="memory must be True or False"):
        Profile(memory="no")
    pool = Pool(2, start=False)
    try:
        with pytest.raises(ValueError, match="profile must be"):
            pool.run(matmuls_and_reduces, profile="all")
        assert not pool.holds_ranks  # refused before any rank was started
    finally:
        pool.close()


def test_one_file_holds_both_sources_of_every_rank_on_one_clock(tmp_path):
    run = launch(matmuls_and_reduces, 4, profile=True)
    assert run.results == [True] * 4 and run.profiles is not None
    assert [p.rank for p in run.profiles] == [0, 1, 2, 3]
    for p in run.profiles:
        size = 32 + 8 * p.rank
        spans = run.trace.spans_of(rank=p.rank, name="matmul")
        mms = [o for o in p.ops_named("aten::mm") if o.shapes == ((size, size), (size, size))]
        assert len(spans) == len(mms) == 3
        for span, mm in zip(spans, mms):  # the clocks agree: each matmul inside its span
            assert span.start_ns < mm.start_ns and mm.end_ns < span.end_ns
            # its output allocated then too (profile_memory), on the same clock
            assert any(
                m.bytes == 4 * size * size and mm.start_ns <= m.t_ns <= mm.end_ns for m in p.memory
            )
        reduces = run.trace.spans_of(rank=p.rank, name="all_reduce")
        gloo = p.ops_named("gloo:all_reduce")
        assert len(reduces) == len(gloo) == 3
        for span, op in zip(reduces, gloo):  # on gloo's worker thread, inside the span
            assert op.thread != p.main_thread and "gloo" in p.threads[op.thread]
            assert span.start_ns < op.start_ns and op.end_ns < span.end_ns
        assert "aten::mm" in p.table and "Self CPU" in p.table
        assert {"aten::mm", "c10d::allreduce_"} <= {r.name for r in p.averages}
        assert p.clock_spread_ns < 100_000  # the two clocks' offset read within 0.1 ms

    events = json.loads(run.to_chrome(tmp_path / "run.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    for rank in range(4):
        assert names[rank] == f"rank {rank}"
        mine = [e for e in events if e.get("pid") == rank and e.get("ph") == "X"]
        course = [e for e in mine if e["tid"] in COURSE_TRACKS.values()]
        torch_ops = [e for e in mine if e.get("cat") == "cpu_op"]
        assert {e["name"] for e in course} == {"matmul", "all_reduce"}
        size = 32 + 8 * rank
        mms = [
            e
            for e in torch_ops
            if e["name"] == "aten::mm" and e["args"]["Input Dims"] == [[size, size]] * 2
        ]
        spans = sorted((e for e in course if e["name"] == "matmul"), key=lambda e: e["ts"])
        for span, mm in zip(spans, sorted(mms, key=lambda e: e["ts"]), strict=True):
            assert span["ts"] < mm["ts"] and mm["ts"] + mm["dur"] < span["ts"] + span["dur"]
    assert min(e["ts"] for e in events if "ts" in e) >= 0
    threads = [e["args"]["name"] for e in events if e.get("name") == "thread_name"]
    assert threads.count("course: compute") == 4 and sum("gloo" in t for t in threads) >= 4


def test_the_table_can_count_one_span_alone():
    run = launch(matmuls_and_reduces, 2, profile=Profile(within="matmul", top=5))
    assert run.profiles is not None
    for p in run.profiles:
        rows = {r.name: r for r in p.averages}
        assert rows["aten::mm"].calls == 3
        assert "c10d::allreduce_" not in rows and "aten::randn" not in rows
        assert len(p.ops_named("c10d::allreduce_")) == 3  # the timeline keeps everything
        assert p.table.count("aten::") <= 5


def test_a_span_the_rank_never_opened_is_an_error_of_the_run():
    from parcourse.launch import RankError

    with pytest.raises(RankError, match="no such span"):
        launch(matmuls_and_reduces, 2, profile=Profile(within="step"))


def test_a_pool_profiles_twice_in_a_row_and_then_not_at_all():
    with Pool(2) as pool:
        pids = pool.pids
        first = pool.run(matmuls_and_reduces, profile=True)
        second = pool.run(matmuls_and_reduces, 2, profile=Profile(memory=False))
        plain = pool.run(matmuls_and_reduces)
        assert pool.pids == pids and pool.startups == 1  # the same ranks throughout
    assert first.profiles is not None and second.profiles is not None
    assert [len(p.ops_named("aten::mm")) for p in first.profiles] == [3, 3]
    assert [len(p.ops_named("aten::mm")) for p in second.profiles] == [2, 2]
    assert all(p.memory and not q.memory for p, q in zip(first.profiles, second.profiles))
    # profiling off: no profiler ran, nothing came back, the trace as ever
    assert plain.profiles is None and plain.results == [False, False]
    assert [s.name for s in plain.trace.spans_of(rank=0)] == [
        s.name for s in first.trace.spans_of(rank=0)
    ]


def test_an_unprofiled_run_writes_the_file_it_always_wrote(tmp_path):
    run = launch(matmuls_and_reduces, 2)
    assert run.profiles is None and run.results == [False, False]
    a = run.to_chrome(tmp_path / "a.json").read_text()
    b = run.trace.to_chrome(tmp_path / "b.json").read_text()
    assert a == b
    events = json.loads(a)["traceEvents"]  # one process, a thread per rank
    assert {e["pid"] for e in events} == {0}
    assert {e["tid"] for e in events if e["ph"] == "X"} == {0, 1}


def test_a_job_under_torchrun_profiles_every_rank(tmp_path):
    from torchrun import torchrun

    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
        import os, sys
        sys.path.insert(0, sys.argv[1])
        from parcourse import launch
        from test_profiler import matmuls_and_reduces
        run = launch(matmuls_and_reduces, 2, profile=True)
        if os.environ["RANK"] == "0":  # every rank has every rank's profile; print once
            print("RESULT", run.results, [len(p.ops_named("aten::mm")) for p in run.profiles])
        """
        )
    )
    here = str(Path(__file__).parent)
    code, stdout, stderr = torchrun(
        "--standalone", "--nproc-per-node", "2", str(script), here, timeout=120
    )
    assert code == 0, stderr[-3000:]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT")]
    assert lines == ["RESULT [True, True] [3, 3]"], stdout


def test_the_lessons_step_shows_a_buckets_all_reduce_beside_the_backward():
    import matplotlib.pyplot as plt

    from parcourse.experiments.profiling import (
        bucket_window,
        operator_table,
        operator_timeline,
        profile_step,
    )

    run = profile_step(2)
    table = operator_table(run, top=8)
    assert table.splitlines()[0].startswith("operator") and len(table.splitlines()) == 10
    assert "aten::mm" in table
    p = run.profiles[0]
    lo, hi = bucket_window(run, rank=0, bucket=0)
    (step,) = run.trace.spans_of(rank=0, name="step")
    assert step.start_ns <= lo < hi
    backward = [s for s in run.trace.spans_of(rank=0, name="backward") if s.start_ns > lo - 10**9]
    assert backward, "the step's backward is traced"
    # inside the step: its backward's matmuls on the main thread, its buckets' all-reduces
    # on gloo's, all within the step's span
    in_step = [o for o in p.ops if step.start_ns <= o.start_ns and o.end_ns <= step.end_ns]
    assert any(o.name == "aten::mm" and o.thread == p.main_thread for o in in_step)
    assert any(o.name == "gloo:all_reduce" and o.thread != p.main_thread for o in in_step)
    fig = operator_timeline(run, window=(lo, hi))
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert ticks[:3] == ["course: compute", "course: comm", "torch: main thread"]
    plt.close(fig)
    with pytest.raises(ValueError, match="not profiled"):
        operator_table(type(run)([], run.trace, 0.0, 2, "gloo"))


QUIET_CHILD = """
import os, sys, torch
from torch.profiler import ProfilerActivity, profile
from parcourse.profiler import quiet_torch

before = torch.ones(1000)  # allocated before the profile, freed inside it
quiet = quiet_torch() if sys.argv[1] == "quiet" else open(os.devnull)
with quiet, profile(activities=[ProfilerActivity.CPU], profile_memory=True):
    del before
    os.write(2, b"a line of the run's own\\n")
    print("and one from Python", file=sys.stderr)
"""


@pytest.mark.parametrize("quiet", [False, True])
def test_quiet_torch_drops_the_profilers_own_lines_and_keeps_the_rest(quiet):
    """Without `quiet_torch` a memory profile prints libkineto's start and stop lines and
    c10's warning about a block allocated before it; with it, only the run's own lines."""
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-c", QUIET_CHILD, "quiet" if quiet else "loud"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    err = child.stderr
    assert "a line of the run's own" in err and "and one from Python" in err, err
    noisy = "profiler_start" in err and "Memory block of unknown size" in err
    assert noisy is not quiet, err

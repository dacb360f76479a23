"""The launcher: real processes, real process groups, every failure mode."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from rankfns import (
    deadlock,
    die,
    fail_on,
    ignore_sigint,
    rank_and_sum,
    slow,
    unpicklable_result,
)
from torchrun import torchrun

import parcourse
from parcourse import (
    Pool,
    RankDied,
    RankError,
    RankTimeout,
    SerializationError,
    close_pools,
    launch,
    limit_pools,
    live_pools,
)
from parcourse.launch.plan import make_plan


def rank_processes():
    """Our live rank processes among this test process's descendants, as a set of pids.
    A rank forked by the forkserver keeps the forkserver's command line, so it is told
    by its parent's; one started otherwise, by being neither the forkserver nor the
    resource tracker. Module-scoped pools' ranks count too: compare with a set read
    before."""
    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd, parent = " ".join(p.cmdline()), p.parent()
            forked = parent is not None and "forkserver" in " ".join(parent.cmdline())
            if forked or ("forkserver" not in cmd and "resource_tracker" not in cmd):
                found.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_gone(pid_dir, before):
    pids = [int(p.name) for p in Path(pid_dir).iterdir()]
    assert pids, "the rank function did not record its pid"
    for pid in pids:
        alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert not alive, f"rank process {pid} outlived the failed run"
    assert rank_processes() <= before


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_per_rank(world_size):
    before = rank_processes()
    run = launch(rank_and_sum, world_size, 10)
    expected = sum(range(world_size)) + 10
    assert [r["rank"] for r in run.results] == list(range(world_size))
    assert all(r["sum"] == expected and r["world"] == world_size for r in run.results)
    assert all(r["threads"] == 1 for r in run.results), "one thread per rank on CPU"
    assert len({r["pid"] for r in run.results}) == world_size
    # CPU tensors reduce in every run: an NCCL run (one GPU per rank) keeps gloo beside it
    backend = make_plan(world_size, "auto", "auto", None).backend
    moves = {"cpu": "gloo", "cuda": backend}
    assert all(r["backend"] == backend and r["moves"] == moves for r in run.results)
    assert run.backend == backend and run.wall_s > run.startup_s > 0
    assert len(run.trace.spans_of(name="all_reduce")) == world_size
    assert rank_processes() <= before


def test_exception_carries_rank_and_remote_traceback(tmp_path):
    before = rank_processes()
    with pytest.raises(RankError) as info:
        launch(fail_on, 4, 2, str(tmp_path), timeout=30)
    err = info.value
    assert err.rank == 2 and err.exc_type == "ValueError"
    assert "bad value on rank 2" in str(err)
    assert "in fail_on" in err.remote_traceback and "raise ValueError" in err.remote_traceback
    assert_all_gone(tmp_path, before)


def test_deadlock_times_out_naming_ranks_and_spans(tmp_path):
    before = rank_processes()
    t0 = time.perf_counter()
    with pytest.raises(RankTimeout) as info:
        launch(deadlock, 2, str(tmp_path), timeout=2)
    assert time.perf_counter() - t0 < 15
    err = info.value
    assert sorted(err.running) == [0, 1]
    assert "recv from 1" in err.running[0] and "recv from 0" in err.running[1]
    assert "in deadlock" in str(err), "the message shows where each rank was stuck"
    # Both ranks are stuck at the same line: one stack, named for both, not two copies.
    assert str(err).count("--- where") == 1 and "--- where ranks 0, 1 were stuck" in str(err)
    assert isinstance(err, TimeoutError)
    assert_all_gone(tmp_path, before)


@pytest.mark.parametrize(("how", "code"), [("kill", -signal.SIGKILL), ("exit", 3)])
def test_killed_rank_is_reported(tmp_path, how, code):
    before = rank_processes()
    with pytest.raises(RankDied) as info:
        launch(die, 3, how, str(tmp_path), timeout=30)
    err = info.value
    assert err.rank == 1 and err.exitcode == code
    assert ("SIGKILL" if how == "kill" else "exited with code 3") in str(err)
    assert "about to die" in str(err)
    assert_all_gone(tmp_path, before)


def test_two_launches_at_once_do_not_collide():
    out = {}

    def go(key, offset):
        out[key] = launch(rank_and_sum, 2, offset).results

    threads = [threading.Thread(target=go, args=(k, k * 100)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r["sum"] for r in out[0]] == [1, 1] and [r["sum"] for r in out[1]] == [101, 101]

    with Pool(2) as a, Pool(2) as b:
        for _ in range(3):
            assert a.run(rank_and_sum, 1).results[0]["sum"] == 2
            assert b.run(rank_and_sum, 2).results[0]["sum"] == 3


def test_function_defined_in_a_notebook_cell():
    # What a notebook cell defines lives in __main__ and is not importable by name.
    cell = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        scale = 3.0
        def my_rank_fn(ctx):
            t = torch.tensor([ctx.rank * scale])
            dist.all_reduce(t, group=ctx.group)
            return t.item()
        """
    )
    namespace = {"__name__": "__main__"}
    exec(cell, namespace)
    assert launch(namespace["my_rank_fn"], 2).results == [3.0, 3.0]
    assert launch(lambda ctx, k: ctx.rank * k, 2, 5).results == [0, 5]


def test_pool_reuses_its_ranks_across_runs(pool4):
    # What makes a warm run fast: no process is started. How fast is measured by
    # benchmarks/launch.py, not asserted here (a time bound fails on a loaded machine).
    pids = [r["pid"] for r in pool4.run(rank_and_sum).results]
    startups = pool4.startups
    for _ in range(10):
        run = pool4.run(rank_and_sum, 1)
        assert [r["pid"] for r in run.results] == pids
        assert all(r["sum"] == 7 for r in run.results)
        assert run.startup_s == 0.0
    assert pool4.startups == startups and pool4.pids == pids


def test_pool_recovers_after_each_kind_of_failure(tmp_path):
    with Pool(2, timeout=30) as pool:
        pids = pool.pids
        with pytest.raises(RankError):
            pool.run(fail_on, 0)
        assert not any(psutil.pid_exists(p) for p in pids)
        assert pool.run(rank_and_sum).results[1]["sum"] == 1
        with pytest.raises(RankTimeout):
            pool.run(deadlock, timeout=1)
        assert pool.run(rank_and_sum).results[1]["sum"] == 1
        with pytest.raises(RankDied):
            pool.run(die, "kill")
        run = pool.run(rank_and_sum)
        assert run.results[1]["sum"] == 1 and run.startup_s > 0
        assert pool.startups == 4


def test_pool_survives_a_kernel_interrupt():
    def interrupt(statuses, elapsed):
        if elapsed > 0.2:
            raise KeyboardInterrupt  # what the kernel raises in the waiting caller

    with Pool(2) as pool:
        pids = pool.pids
        progress = []
        pool.run(slow, 1.0, on_progress=lambda s, e: progress.append(s))  # ticks every 0.1 s
        assert any("slow step" in s for ss in progress for s in ss), progress
        with pytest.raises(KeyboardInterrupt):
            pool.run(slow, 30, on_progress=interrupt)
        assert not any(psutil.pid_exists(p) for p in pids)
        assert pool.run(rank_and_sum).results[0]["sum"] == 1


def test_ranks_ignore_sigint(pool2):
    assert pool2.run(ignore_sigint).results == [0, 1]


def test_serialization_errors_are_clear(pool2):
    lock = threading.Lock()
    before = rank_processes()
    with pytest.raises(SerializationError, match="cannot send the function"):
        launch(lambda ctx: lock, 2)
    assert rank_processes() <= before, "nothing started for an unpicklable function"
    with pytest.raises(SerializationError, match="rank 0 returned a generator"):
        pool2.run(unpicklable_result)
    assert pool2.run(rank_and_sum).results[0]["sum"] == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"world_size": -2}, "world_size must be an int >= 1"),
        ({"world_size": 2.0}, "world_size must be an int >= 1"),
        ({"world_size": 2, "backend": "mpi"}, "unknown backend 'mpi'"),
        ({"world_size": 2, "device": "tpu"}, "unknown device 'tpu'"),
        ({"world_size": 2, "threads": 0}, "threads must be"),
    ],
)
def test_bad_arguments_fail_before_any_process_starts(kwargs, message):
    before = rank_processes()
    with pytest.raises(ValueError, match=message):
        launch(rank_and_sum, **kwargs)
    with pytest.raises(ValueError, match=message):
        Pool(**kwargs)
    assert rank_processes() <= before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_nccl_without_gpus_is_refused():
    with pytest.raises(ValueError, match="nccl backend needs GPUs"):
        launch(rank_and_sum, 2, backend="nccl")
    with pytest.raises(ValueError, match="sees no GPU"):
        launch(rank_and_sum, 2, device="cuda")


def test_ranks_exit_when_the_caller_is_killed(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(
        textwrap.dedent(
            """
        import sys, time
        sys.path.insert(0, sys.argv[1])
        from parcourse import Pool
        from rankfns import slow
        pool = Pool(2)
        print(*pool.pids, flush=True)
        pool.run(slow, 60)
        """
        )
    )
    tests_dir = str(Path(__file__).parent)
    owner = subprocess.Popen(
        [sys.executable, str(script), tests_dir], stdout=subprocess.PIPE, text=True
    )
    pids = [int(p) for p in owner.stdout.readline().split()]
    assert len(pids) == 2
    time.sleep(0.5)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) for p in pids), "ranks outlived a killed caller"


def test_a_start_removes_the_stack_folders_of_callers_that_are_gone(tmp_path, monkeypatch):
    """Each start's ranks write their stacks (at a timeout) in parcourse-<pid>-...; a
    caller killed with its ranks leaves its folder, and the next start anywhere removes
    it. A live caller's folder stays, and a run's own folder goes with its ranks."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for pid in (gone.pid, os.getppid()):
        (tmp_path / f"parcourse-{pid}-left").mkdir()
        (tmp_path / f"parcourse-{pid}-left" / "rank0.txt").write_text("")
    assert launch(rank_and_sum, 2).results
    left = sorted(p.name for p in tmp_path.glob("parcourse-*"))
    assert left == [f"parcourse-{os.getppid()}-left"]


def test_a_kernel_that_ran_ranks_shuts_down_by_itself(tmp_path):
    """A Jupyter kernel asked to shut down, its pool still open (a lesson's panels keep
    theirs), ends by itself: exit code 0, not the SIGTERM its client sends after a wait,
    and with its exit handlers run, so nothing is left in the temporary folder (before,
    multiprocessing's pymp-* folder and the ranks' stack folder stayed)."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    # Its client's SIGTERM comes at half this (2.5 s by default): what is checked is that
    # the kernel ends by itself, not how fast a busy machine lets it close its pool.
    km.shutdown_wait_time = 30
    km.start_kernel(env={**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    kernel = km.provisioner.process
    client = km.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        code = (
            "from parcourse import Pool\npool = Pool(2)\n"
            "print(*pool.pids, sum(pool.run(lambda ctx: ctx.rank + 1).results))"
        )
        out = []
        reply = client.execute_interactive(
            code, timeout=120, output_hook=lambda m: out.append(m["content"].get("text", ""))
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        *pids, total = map(int, "".join(out).split())
        assert total == 3 and len(pids) == 2
        assert any(tmp_path.glob("pymp-*")) and any(tmp_path.glob("parcourse-*"))
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=False)
    assert kernel.wait(timeout=40) == 0, "the kernel was killed by its client"
    assert not any(alive(p) for p in pids), "the ranks outlived their kernel"
    # torch's own cache folder (torchinductor_<user>, made when torch._dynamo is first
    # imported: the ranks' forkserver preloads it, as any torch.optim optimizer would) is
    # one per user and kept on purpose; what a run leaves behind is not.
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == []


def test_same_function_runs_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
        import os, sys
        sys.path.insert(0, sys.argv[1])
        from parcourse import Pool, launch
        from rankfns import rank_and_sum
        run = launch(rank_and_sum, 2, 10)
        if os.environ["RANK"] == "0":  # every rank has every result; print once
            print("RESULT", run.backend, [r["sum"] for r in run.results], len(run.trace.spans),
                  Pool(2).external)
        """
        )
    )
    code, stdout, stderr = torchrun(
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        str(Path(__file__).parent),
        timeout=120,
    )
    assert code == 0, stderr[-3000:]
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT")]
    assert lines == ["RESULT gloo [11.0, 11.0] 2 True"], stdout
    assert not parcourse.Pool(2).external  # started here, its ranks are this process's


def test_public_api_is_exported():
    for name in ("launch", "Pool", "RankContext", "Run", "Trace", "Tracer", "RankError"):
        assert hasattr(parcourse, name)


def test_live_pools_count_against_the_limit_and_can_be_closed():
    # Lesson 00's scenario: the notebook's own pool, then a panel asks for two other sizes.
    # Every pool that holds ranks counts, including one restarted after it was closed.
    def mine():
        return [info.pool for info in live_pools() if info.pool in pools]

    previous = limit_pools(2)
    try:
        own = Pool(1, start=False)
        pools = [own]
        assert mine() == [], "start=False: no ranks until the first run"
        own.run(rank_and_sum)
        second = Pool(2)
        pools.append(second)
        assert mine() == [own, second]
        third = Pool(1)
        pools.append(third)
        assert not own.alive, "the least recently used pool made room"
        assert mine() == [second, third]
        assert own.run(rank_and_sum).results[0]["sum"] == 0, "a closed pool starts afresh..."
        assert mine() == [third, own] and not second.alive, "...and counts again"
        launch(rank_and_sum, 2)  # a pool for one run closes no other
        assert mine() == [third, own]
        info = {i.pool: i for i in live_pools()}[own]
        assert info.pids == own.pids and info.memory_bytes > 1 << 20
        assert str(info).startswith(f"1 rank ({own.plan.backend}), pid ")
        pids = own.pids + third.pids
        assert close_pools() >= 2 and mine() == []
        assert not any(psutil.pid_exists(p) for p in pids)
    finally:
        limit_pools(previous)
        for pool in pools:
            pool.close()


def test_a_long_run_in_a_notebook_shows_a_live_status_line(capsys):
    # In a kernel: a line under the cell, updated while ranks work, emptied at the end
    # (shown empty first, so nbval, which ignores updates, has nothing to compare).
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from parcourse import launch\nfrom rankfns import slow\n"
            "print(launch(slow, 2, 4.5).results)"
        )
    ]
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=120,
        startup_timeout=300,
        resources={"metadata": {"path": str(Path(__file__).parent)}},
    )
    seen = []
    process = client.process_message

    def spy(msg, cell, index):
        if msg["msg_type"] in ("display_data", "update_display_data"):
            seen.append(msg["content"]["data"].get("text/plain", ""))
        return process(msg, cell, index)

    client.process_message = spy
    client.execute()
    assert seen[0] == "" and seen[-1] == "", seen
    assert any("0 of 2 ranks done; ranks 0, 1: in 'slow step' (compute)" in s for s in seen), seen
    outputs = nb.cells[0].outputs
    assert [o.output_type for o in outputs] == ["display_data", "stream"]
    assert outputs[0].data == {} and outputs[1].text == "[0, 1]\n"
    # In a script or a test, nothing is shown.
    launch(slow, 2, 3.2)
    assert capsys.readouterr().out == ""


def test_messages_between_caller_and_ranks_pickle_by_name():
    """Ranks start from a forkserver (or spawn): every message must pickle as a module-level
    class, and come back equal."""
    import pickle

    from parcourse.launch.messages import Done, Failed, Ready, Stop, Task, Unpicklable
    from parcourse.trace import TraceData

    for message in (
        Task(b"payload"),
        Stop(),
        Ready(1),
        Done(1, b"result", TraceData(1), 0.5),
        Failed(2, 7, "ValueError", "bad", "traceback", TraceData(2)),
        Unpicklable(3, "rank 3 returned a generator"),
    ):
        assert pickle.loads(pickle.dumps(message)) == message
    assert Failed(2, 7, "ValueError", "bad", "tb", TraceData(2)).summary == "ValueError: bad"


def test_the_default_timeout_reads_parcourse_timeout():
    """PARCOURSE_TIMEOUT sets a run's default limit (the suite sets 300: a hang guard on a
    loaded machine); a value that is not a positive number is refused, naming it."""
    import subprocess
    import sys

    code = "from parcourse import Pool; print(Pool(2, start=False).timeout)"

    def with_value(value):
        env = {**os.environ, "PARCOURSE_TIMEOUT": value}
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )

    assert with_value("7").stdout.strip() == "7.0"
    bad = with_value("soon")
    assert bad.returncode != 0 and "PARCOURSE_TIMEOUT must be a number of seconds" in bad.stderr


def test_a_peer_gone_mid_collective_is_named_by_its_address():
    """gloo's words for a peer gone (a host lost, under torchrun) read as one sentence
    naming the peer and what an elastic job does; other errors are left as they are."""
    from parcourse.launch.external import peer_lost

    said = peer_lost(
        3,
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[10.77.0.2]:45743: Connection reset by peer. This is typically caused by ...",
    )
    assert said is not None and said.startswith("rank 3 lost its peer at 10.77.0.2 mid-collect")
    assert "(gloo: Read error [10.77.0.2]:45743: Connection reset by peer)" in said
    assert "--nnodes 1:2" in said
    closed = peer_lost(0, "[pair.cc:553] Connection closed by peer [10.0.0.9]:24980. Check")
    assert closed is not None and "its peer at 10.0.0.9" in closed
    assert peer_lost(0, "CUDA out of memory") is None

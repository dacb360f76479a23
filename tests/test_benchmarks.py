"""The collectives and training benchmarks run end to end on tiny sizes and print their
tables; the planner benchmark reads what else held the processors."""

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "collectives.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


def test_collectives_benchmark_prints_a_ratio_per_size_and_per_pool():
    done = run("--world-sizes", "2", "--min-size", "4KB", "--max-size", "16KB",
               "--repeats", "1", "--pools", "2")
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()
            if re.match(r"\s+(4|16) KB\s", line)]
    assert [r[:2] for r in rows] == [["4", "KB"], ["16", "KB"]]
    for r in rows:
        # size, 2 x (busbw, GB/s), ratio, interval, pairs, one ratio per pool
        ratio, (lo, hi), pairs, pools = float(r[6]), r[7].split("-"), int(r[8]), r[9:]
        assert float(lo) <= ratio <= float(hi)
        # repeats_for gives 1600 all-reduces at 4 and 16 KB: 800 per pool, 100 samples of 8
        assert pairs == 200
        assert len(pools) == 2 and all(float(p) > 0 for p in pools)
    assert "loopback p2p ceiling" in done.stdout


def test_collectives_benchmark_refuses_zero_pools():
    done = run("--pools", "0")
    assert done.returncode == 2 and "--pools must be >= 1, got 0" in done.stderr


def test_collectives_benchmark_refuses_a_batch_float32_cannot_sum_exactly():
    # A sample of 13 all-reduces on 4 ranks sums ones to 4**13 = 2**26, past float32's 2**24.
    done = run("--world-sizes", "2", "4", "--batch", "13")
    assert done.returncode == 2 and "got 13 with world size 4" in done.stderr
    done = run("--batch", "0")
    assert done.returncode == 2 and "--batch must be >= 1" in done.stderr


def test_training_benchmark_prints_the_plan_and_the_checkpoint_costs():
    script = SCRIPT.parent / "training.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "12", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"measured / planned tokens/s: \d+\.\d\d", done.stdout)
    for label in ("parcourse.checkpoint.save", "parcourse.checkpoint.load",
                  "gather + torch.save on rank 0"):
        assert re.search(rf"{re.escape(label)}\s+\d+\.\d+\s+\d+\.\d\d", done.stdout), label
    assert "bytes written per rank: rank 0:" in done.stdout


def _spin(ctx, seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


BURN = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_the_planner_benchmark_tells_other_processes_from_its_ranks():
    """benchmarks/planner.py's Contention, printed beside each measured row: the ranks'
    and the benchmark's own processor time is not counted as other processes'; the
    0.6 s of a process outside the pool is (its start's time too, hence "at least")."""
    from parcourse import Pool

    spec = importlib.util.spec_from_file_location(
        "planner_benchmark", SCRIPT.with_name("planner.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with Pool(2, timeout=60) as pool:
        pool.run(_spin, 0.01)  # the ranks started
        with bench.Contention(pool) as alone:
            pool.run(_spin, 0.6)
        with bench.Contention(pool) as beside:
            burner = subprocess.Popen([sys.executable, "-c", BURN])
            pool.run(_spin, 0.6)
            burner.wait(timeout=60)
    for c in (alone, beside):
        assert 0 <= c.steal <= 1 and 0 <= c.others <= 1, (c.steal, c.others)
    # 1.2 s of the ranks' own spinning (and the pool's messages) read as nobody else's
    assert alone.others * alone.cpu_s < 0.15, (alone.others, alone.cpu_s)
    assert beside.others * beside.cpu_s > 0.5, (beside.others, beside.cpu_s)

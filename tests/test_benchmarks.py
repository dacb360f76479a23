"""The collectives and training benchmarks run end to end on tiny sizes and print their
tables."""

import re
import subprocess
import sys
from pathlib import Path

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

"""The collectives and training benchmarks run end to end on tiny sizes and print their
tables."""

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "collectives.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


def test_collectives_benchmark_prints_a_ratio_per_size_and_per_pool():
    done = run(
        "--world-sizes",
        "2",
        "--min-size",
        "4KB",
        "--max-size",
        "16KB",
        "--repeats",
        "1",
        "--pools",
        "2",
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if re.match(r"\s+(4|16) KB\s", line)]
    assert [r[:2] for r in rows] == [["4", "KB"], ["16", "KB"]]
    for r in rows:
        # size, 2 x (busbw, GB/s), ratio, interval, pairs, one ratio per pool
        # the interval's own figures: test_the_medians_interval_holds_it_95_times_in_100
        ratio, (lo, hi), pairs, pools = float(r[6]), r[7].split("-"), int(r[8]), r[9:]
        assert ratio > 0 and float(lo) <= float(hi)
        # repeats_for gives 1600 all-reduces at 4 and 16 KB: 800 per pool, 100 samples of 8
        assert pairs == 200
        assert len(pools) == 2 and all(float(p) > 0 for p in pools)
    assert "loopback p2p ceiling" in done.stdout


def test_the_medians_interval_holds_it_95_times_in_100():
    """The "95% interval" column: x(k) to x(n-1-k) holds the median unless k or fewer of
    the n values fall below it, or k or fewer above (binomial, n and 1/2): at least 95%,
    and k as large as allows it (the next k would not). Exact, against the counts."""
    spec = importlib.util.spec_from_file_location("collectives_benchmark", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def holds(n, k):  # P(k < B < n - k), B ~ binomial(n, 1/2)
        return sum(math.comb(n, b) for b in range(k + 1, n - k)) / 2**n

    for n in (6, 7, 10, 20, 50, 99, 100, 200, 800, 1600):
        xs = [float(x) for x in range(n)][::-1]  # any order
        lo, hi = bench.median_interval(xs)
        k = int(lo)
        assert hi == n - 1 - k, n
        assert holds(n, k) >= 0.95 > holds(n, k + 1), (n, k, holds(n, k))
    assert bench.median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few: all of them


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
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "12", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"measured / planned tokens/s: \d+\.\d\d", done.stdout)
    for label in (
        "parcourse.checkpoint.save",
        "parcourse.checkpoint.load",
        "gather + torch.save on rank 0",
    ):
        assert re.search(rf"{re.escape(label)}\s+\d+\.\d+\s+\d+\.\d\d", done.stdout), label
    assert "bytes written per rank: rank 0:" in done.stdout


def test_context_parallel_benchmark_prints_the_balance_and_torchs_answer():
    """Tiny sizes: a row per cp and cut, with the busiest rank over the least busy; the
    memory each cp keeps, equal to the formula; and torch's context_parallel run beside
    ours or its error said in a line (CPU ranks)."""
    script = SCRIPT.parent / "context_parallel.py"
    done = subprocess.run(
        [sys.executable, str(script), "--tokens", "64", "--heads", "2", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        line.split()
        for line in done.stdout.splitlines()
        if re.match(r"\s+[24]\s+(contiguous|zigzag)\s", line)
    ]
    assert [(r[0], r[1]) for r in rows] == [
        ("2", "contiguous"),
        ("2", "zigzag"),
        ("4", "contiguous"),
        ("4", "zigzag"),
    ]
    assert all(float(r[-2 if r[1] == "zigzag" else -1]) >= 1.0 for r in rows)
    assert re.search(r"equal to theory.ring_attention_kept, all 9: True", done.stdout), done.stdout
    assert re.search(r"ours alone, ranks on \w+: [\d.]+ ms", done.stdout), done.stdout
    for rotate in ("allgather", "alltoall"):
        assert re.search(
            rf"torch's \(K/V by {rotate}\) (does not run here: "
            rf"NotImplementedError|crashed)|K/V by {rotate}: ours .* ours / torch",
            done.stdout,
        ), done.stdout
    bad = subprocess.run(
        [sys.executable, str(script), "--tokens", "0"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "--tokens must be >= 1, got 0" in bad.stderr


def test_experts_benchmark_prints_its_four_tables(tmp_path):
    """Tiny sizes: the step-time rows at 2 and 4 ranks with their ratios, the bytes and
    memory equal to the formulas, a balance row per method (a corpus of the test's own,
    small), and DualPipe's three rows against 1F1B at 4 microbatches, two steps."""
    script = SCRIPT.parent / "experts.py"
    corpus = tmp_path / "corpus"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--tokens",
            "64",
            "--width",
            "16",
            "--rounds",
            "1",
            "--steps",
            "4",
            "--corpus",
            str(corpus),
            "--microbatches",
            "4",
            "--pipeline-steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[24]\s+[\d.]+ms", line)]
    assert [r[0] for r in rows] == ["2", "4"]
    assert re.search(r"\s+2\s.*\s(met|MISSED)$", out, re.M)
    assert len(re.findall(r"equal\s+\S+ \S+\s+\S+ \S+\s+equal", out)) == 2, out
    for method in ("none", "aux loss", "bias"):
        assert re.search(rf"^\s+{method}\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.M), out
    piped = re.findall(
        r"^\s+4 (1F1B|DualPipe, pairs apart|DualPipe, overlapped)\s+\d+ms"
        r"\s+[\d.]+ms\s+[\d.]+ms\s+[\d.]+ms\s+([\d.]+)\s*(met|MISSED)?$",
        out,
        re.M,
    )
    assert [p[0] for p in piped] == ["1F1B", "DualPipe, pairs apart", "DualPipe, overlapped"]
    assert piped[0][1] == "1.00" and piped[2][2] in ("met", "MISSED"), out
    for wrong, message in (
        ("--tokens 6", "--tokens must divide by 4"),
        ("--microbatches 5", "an even number >= 4"),
    ):
        bad = subprocess.run(
            [sys.executable, str(script), *wrong.split()],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr


def test_classroom_benchmark_measures_a_lesson_and_doctor_reads_it(tmp_path):
    """Lesson 08 run whole (its defaults: 2 ranks): a row with its ranks, its Run All time,
    a peak memory of at least the kernel and two ranks with torch (over 300 MiB), and at
    least one socket a rank pair; the JSON it writes is what `class_sizing` reads."""
    from parcourse.classroom import class_sizing

    out = tmp_path / "peaks.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "classroom.py"), "--lessons", "08", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(out.read_text())
    row = peaks["lessons"]["08_activation_checkpointing"]
    assert row["ranks"] == 2 and row["run_all_s"] > 0 and row["peak_mib"] > 300
    assert row["processes"] >= 3 and row["sockets"] >= 2
    assert re.search(
        rf"^08_activation_checkpointing\s+{row['ranks']}\s+{row['run_all_s']}\s", done.stdout, re.M
    ), done.stdout
    text, _ = class_sizing(2, peaks, {"cpus": 4, "memory_gib": 64, "ports": 28000})
    assert "a class of 2: 4 CPUs" in text and text.endswith("enough")


def test_low_precision_benchmark_prints_loss_and_bytes_for_each_precision(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "low_precision.py"
    done = subprocess.run(
        [sys.executable, str(script), "--steps", "5", "--corpus", str(tmp_path / "corpus")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.split("Wire formats")[0].splitlines():
        for name in ("fp32", "bf16", "fp16 + scaler", "fp16, no scaler", "fp8"):
            if line.startswith(name + " ") or line.startswith(name + "\t"):
                rows[name] = line[len(name) :].split()
    assert set(rows) == {"fp32", "bf16", "fp16 + scaler", "fp16, no scaler", "fp8"}, done.stdout
    for name, (loss, ratio, skipped, sent, formula) in rows.items():
        assert math.isfinite(float(loss)) and float(ratio) > 0 and int(skipped) >= 0
        sent, formula = int(sent.replace(",", "")), int(formula.replace(",", ""))
        # the messages carry padding rows and a used-flag a parameter beyond the formula
        assert formula <= sent <= 1.01 * formula, (name, sent, formula)
    # 16-bit messages: half of fp32's, but for the flags and padding rows
    half = int(rows["bf16"][3].replace(",", "")) / int(rows["fp32"][3].replace(",", ""))
    assert 0.5 <= half <= 0.51, half
    # the wire formats: each hook's bytes, counted message by message, are its formula's
    table = done.stdout.split("Wire formats")[1]
    wires = {}
    for line in table.splitlines():
        for name in ("fp32", "bf16", "e4m3", "PowerSGD r=4", "ZeRO-3 bf16, FP8 gather"):
            if line.startswith(name + " "):
                wires[name] = line[len(name) :].split()
        if line.startswith("ZeRO-3 bf16 "):
            wires["ZeRO-3 bf16"] = line[len("ZeRO-3 bf16") :].split()
    assert len(wires) == 6, table
    for name in ("fp32", "bf16", "e4m3", "PowerSGD r=4"):
        loss, ratio, error, sent, formula = wires[name]
        assert math.isfinite(float(loss)), name
        assert sent == formula, (name, sent, formula)
        if name != "fp32":
            assert 0 < float(error) < 0.5, (name, error)
    e4m3 = int(wires["e4m3"][3].replace(",", "")) / int(wires["fp32"][3].replace(",", ""))
    assert e4m3 < 0.27, e4m3  # (1 + 4/128) / 4 and the flags
    zero3 = [int(wires[k][3].replace(",", "")) for k in ("ZeRO-3 bf16", "ZeRO-3 bf16, FP8 gather")]
    assert zero3[1] < zero3[0], zero3


def test_the_cs336_runner_refuses_a_folder_that_is_not_the_suite(tmp_path):
    """benchmarks/cs336_systems.py needs a checkout of the assignment (not on PyPI, so CI
    has none): anything else is named in one line before anything is installed or run."""
    script = SCRIPT.parent / "cs336_systems.py"
    done = subprocess.run(
        [sys.executable, str(script), "--suite", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "is not a checkout of CS336's assignment 2: no cs336-basics" in done.stderr

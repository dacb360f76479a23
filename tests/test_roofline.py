"""The roofline (lesson 12, part 1): each strategy's threshold against its formula worked by
hand, the peak read from a processor's flags, the measured sweep's rows (bytes counted
against the formula's; no timing is asserted), `python -m parcourse roofline`, and the
planner's bound column."""

import math
import subprocess
import sys

import pytest

from parcourse.cli import main
from parcourse.experiments.roofline import (
    PeakEstimate,
    SweepConfig,
    format_sweep,
    peak_from_cpuinfo,
    roofline_figure,
    sweep,
)
from parcourse.planner import Cluster, bound_of, format_plans, model, plan
from parcourse.theory import (
    Machine,
    cp_threshold,
    data_parallel_seconds,
    dp_threshold,
    ep_min_width,
    ep_threshold,
    published_machines,
    tensor_parallel_seconds,
    thresholds,
    tp_threshold,
    zero3_threshold,
)

# F / W = 100 FLOPs a byte of link: 1 TFLOP/s beside 10 GB/s
BANDWIDTH = Machine("by hand", flops=1e12, memory_Bps=1e11, latency_s=0.0, link_Bps=1e10)
LATENT = Machine("by hand, 10 us", flops=1e12, memory_Bps=1e11, latency_s=1e-5, link_Bps=1e10)


# (N, bytes a number): dp (N-1)/N x b/3 x F/W, ZeRO-3 (N-1)/N x b/2 x F/W
@pytest.mark.parametrize(
    ("n", "b", "dp", "zero3"),
    [
        (2, 2, 1 / 2 * 2 / 3 * 100, 1 / 2 * 1 * 100),
        (4, 4, 100.0, 3 / 4 * 2 * 100),
        (8, 2, 7 / 8 * 2 / 3 * 100, 7 / 8 * 100),
    ],
)
def test_data_parallel_thresholds_worked_by_hand(n, b, dp, zero3):
    assert dp_threshold(BANDWIDTH, n, bytes_per_number=b) == pytest.approx(dp)
    assert zero3_threshold(BANDWIDTH, n, bytes_per_number=b) == pytest.approx(zero3)
    # the model's size cancels without latency
    assert dp_threshold(BANDWIDTH, n, bytes_per_number=b, params=123_456) == pytest.approx(dp)


def test_latency_raises_a_small_models_threshold():
    """1M parameters in bf16 on 2 ranks, 10 us: the all-reduce 2 alpha + S/W = 20 us + 200
    us, a token's compute 6 P / F = 6 us: 36.7 tokens; in four buckets, 4 x 2 alpha: 46.7.
    ZeRO-3: 3 alpha + 3/2 S/W = 330 us, 55 tokens."""
    p = 1_000_000
    assert dp_threshold(LATENT, 2, params=p) == pytest.approx(220e-6 / 6e-6)
    assert dp_threshold(LATENT, 2, params=p, pieces=4) == pytest.approx(280e-6 / 6e-6)
    assert zero3_threshold(LATENT, 2, params=p) == pytest.approx(330e-6 / 6e-6)
    line = data_parallel_seconds(LATENT, 2, p, 1000)
    assert line == pytest.approx({"compute": 6e-3, "communication": 220e-6})


@pytest.mark.parametrize(
    ("n", "b", "block", "d"),
    [(2, 2, "gpt", 2 / 9 * 100), (4, 2, "gpt", 3 * 2 / 9 * 100), (8, 4, "mlp", 7 * 4 / 12 * 100)],
)
def test_tensor_parallel_threshold_worked_by_hand(n, b, block, d):
    """A GPT block: 72 d^2 B / (N F) = 4 x 2 (N-1)/N x B d b / W: d* = (N-1) b F / (9 W);
    an MLP: 48 d^2 B / (N F) = 2 x 2 (N-1)/N x B d b / W: d* = (N-1) b F / (12 W)."""
    assert tp_threshold(BANDWIDTH, n, bytes_per_number=b, block=block) == pytest.approx(d)


def test_tensor_parallel_threshold_with_latency_solves_its_quadratic():
    """2 ranks, 1000 tokens, 10 us, a GPT block in bf16: compute 72 x 1000 / 2e12 d^2 =
    3.6e-8 d^2; four all-reduces, 4 x (2 alpha + 1000 x 2 d / 1e10) = 8e-5 + 8e-7 d;
    3.6e-8 d^2 - 8e-7 d - 8e-5 = 0 at d = 59.5."""
    d = (8e-7 + math.sqrt(8e-7**2 + 4 * 3.6e-8 * 8e-5)) / (2 * 3.6e-8)
    assert tp_threshold(LATENT, 2, tokens=1000) == pytest.approx(d)
    assert 59 < d < 60
    line = tensor_parallel_seconds(LATENT, 2, d, 1000)
    assert line["compute"] == pytest.approx(line["communication"])


@pytest.mark.parametrize(
    ("n", "b", "tokens"),
    [(2, 2, 4 / 2 * 2 / 6 * 100), (4, 2, 10 / 4 * 2 / 6 * 100), (8, 4, 22 / 8 * 4 / 6 * 100)],
)
def test_context_parallel_threshold_worked_by_hand(n, b, tokens):
    """Ring attention: 12 N T^2 d / F = (3N - 2) x 2 d b T / W: T* = (3N-2)/N x b F / (6 W),
    whatever d_model; causal attention halves the compute and doubles it."""
    assert cp_threshold(BANDWIDTH, n, 512, bytes_per_number=b) == pytest.approx(tokens)
    assert cp_threshold(BANDWIDTH, n, 4096, bytes_per_number=b) == pytest.approx(tokens)
    assert cp_threshold(BANDWIDTH, n, 512, bytes_per_number=b, causal=True) == pytest.approx(
        2 * tokens
    )


@pytest.mark.parametrize(
    ("n", "d", "tokens"),
    [
        # compute 48 k d^2 / F a token, rows 4 k d b (N-1)/N / W; 5 alpha and the counts
        # (8 bytes x experts / N to each of N-1) fixed: bf16, top 2 of 8
        (2, 100, (5e-5 + 32 / 1e10) / (96e4 / 1e12 - 4 * 2 * 100 * 2 / 2 / 1e10)),
        (4, 100, (5e-5 + 48 / 1e10) / (96e4 / 1e12 - 4 * 2 * 100 * 2 * 3 / 4 / 1e10)),
        (8, 1000, (5e-5 + 56 / 1e10) / (96e6 / 1e12 - 4 * 2 * 1000 * 2 * 7 / 8 / 1e10)),
    ],
)
def test_expert_parallel_threshold_worked_by_hand(n, d, tokens):
    assert ep_threshold(LATENT, n, d) == pytest.approx(tokens)


def test_expert_parallelism_too_narrow_is_communication_bound_at_any_count():
    """(N-1)/N x b F / (12 W): 2 ranks, bf16, F/W 100: 8.33; at or below it, never."""
    assert ep_min_width(BANDWIDTH, 2) == pytest.approx(100 / 12)
    assert ep_threshold(LATENT, 2, 8) == math.inf
    assert ep_threshold(LATENT, 2, 9) < math.inf


def test_published_hardware_comes_from_the_planners_presets():
    """H100 over NVLink: 989 TFLOP/s beside 450 GB/s, F/W 2198; a node of 8 in bf16, dp's
    7/8 x 2/3 x 2198 = 1282 tokens a rank, 9 times that over InfiniBand's 50 GB/s."""
    machines = {m.name: m for m in published_machines()}
    assert set(machines) == {"H100 NVLink", "H100 InfiniBand", "H200 NVLink", "H200 InfiniBand"}
    h100 = Cluster.preset("h100", 8)
    nvlink = machines["H100 NVLink"]
    assert nvlink.flops == h100.peak_flops and nvlink.link_Bps == h100.inside.bandwidth_Bps
    assert machines["H200 InfiniBand"].memory_Bps == Cluster.preset("h200", 8).memory_bandwidth
    table = {t.strategy: t for t in thresholds(nvlink, 8)}
    assert list(table) == ["dp", "ZeRO-3", "tp", "cp", "ep"]
    assert table["dp"].value == pytest.approx(7 / 8 * 2 / 3 * 989e12 / 450e9)
    assert table["tp"].unit == "d_model" and table["dp"].unit == "tokens per rank"
    ib = {t.strategy: t for t in thresholds(machines["H100 InfiniBand"], 8)}
    assert ib["dp"].value / table["dp"].value == pytest.approx(9.0)


INTEL = """processor	: 0
model name	: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
cpu MHz		: 3500.000
flags		: fpu sse sse2 avx avx2 fma avx512f avx512dq
processor	: 1
model name	: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
cpu MHz		: 1200.000
flags		: fpu sse sse2 avx avx2 fma avx512f avx512dq
"""
AMD = """processor	: 0
model name	: AMD Ryzen 7 5800X 8-Core Processor
cpu MHz		: 3800.000
flags		: fpu sse sse2 avx fma avx2
processor	: 1
cpu MHz		: 4200.000
"""
OLD = "processor\t: 0\ncpu MHz\t\t: 2000.0\nflags\t\t: fpu sse sse2\n"
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm\n"


def test_the_peak_from_a_processors_flags():
    """cores x clock x FLOPs a cycle: the model name's nominal clock where it gives one,
    else the highest cpu MHz; 64 a cycle with AVX-512, 32 with AVX2 and FMA, 8 without
    AVX; no flags or no clock (ARM's cpuinfo): no estimate."""
    intel = peak_from_cpuinfo(INTEL)
    assert intel == PeakEstimate(2, 2.9e9, 64, "avx512f")
    assert intel.flops == pytest.approx(2 * 2.9e9 * 64)
    amd = peak_from_cpuinfo(AMD, cores=8)
    assert amd == PeakEstimate(8, 4.2e9, 32, "avx2+fma")
    assert amd.per_core == pytest.approx(4.2e9 * 32) and "an estimate" in amd.describe()
    assert peak_from_cpuinfo(OLD) == PeakEstimate(1, 2.0e9, 8, "sse2")
    assert peak_from_cpuinfo(ARM) is None
    assert peak_from_cpuinfo("") is None


# tiny sizes: seconds each; every rank's bytes of a step checked, not its times
TINY = {"width": 48, "depth": 2, "rounds": 1, "tp_blocks": 1, "tp_tokens": 12}


@pytest.mark.parametrize(
    ("strategy", "sizes"), [("dp", (4, 16)), ("zero3", (4, 16)), ("tp", (24, 48))]
)
def test_the_sweep_counts_the_formulas_bytes(pool4, strategy, sizes):
    """4 ranks, each size's bytes of rank 0's step counted message by message on the
    course's ring, equal to the formula's (dp: 2 (N-1)/N x each bucket; ZeRO-3:
    `zero_communication_bytes` of each unit, and its flags; tp: two all-reduces a block);
    the roofline's two lines meet at the formula's threshold."""
    done = sweep(SweepConfig(strategy, sizes=sizes, **TINY), 4, pool4)
    assert [r.size for r in done.rows] == list(sizes)
    for r in done.rows:
        assert r.bytes_sent == r.bytes_formula > 0
        assert min(r.compute_s, r.communication_s, r.both_s) > 0
        assert r.exposed_s == max(0.0, r.both_s - r.compute_s)
    if strategy == "tp":  # two all-reduces of (12, d) fp32 a block, 2 x 3/4 of it sent
        assert [r.bytes_sent for r in done.rows] == [2 * 2 * 3 / 4 * 4 * 12 * d for d in sizes]
    else:  # the same bytes at every size: the weights' and flags', whatever the tokens
        assert done.rows[0].bytes_sent == done.rows[1].bytes_sent
        assert done.params == 2 * (48 * 48 + 48)
    x = done.formula_crossover
    assert 0 < x < math.inf
    m, n = done.machine, done.world_size
    if strategy == "tp":
        line = tensor_parallel_seconds(m, n, x, 12, block="mlp", bytes_per_number=4)
    else:
        stage = 0 if strategy == "dp" else 3
        line = data_parallel_seconds(
            m, n, done.params, x, stage=stage, bytes_per_number=4, pieces=done.pieces
        )
    assert line["compute"] == pytest.approx(line["communication"])
    assert f"formula {x:.0f}" in format_sweep(done)
    import matplotlib.pyplot as plt

    fig = roofline_figure(done)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()][:2] == [
        "compute alone",
        "communication alone",
    ]
    plt.close(fig)


def test_a_bad_sweep_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="unknown strategy 'pp'"):
        SweepConfig("pp")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be >= 1"):
        SweepConfig(sizes=(0, 4))
    with pytest.raises(ValueError, match="do not all cut"):
        sweep(SweepConfig("tp", sizes=(4,)), 3)


def test_the_roofline_command_prints_the_machine_and_the_thresholds(capsys):
    assert main(["roofline"]) == 0
    out = capsys.readouterr().out
    assert "GFLOP/s a rank" in out
    assert "an estimate" in out or "cannot be read here" in out
    assert "GB/s a rank (STREAM's triad" in out and "the course's: " in out
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()}
    # the published rows, in tokens: dp, ZeRO-3, tp (d_model), cp, ep
    assert rows["H100 NVLink"][-5:] == ["1.3k", "1.9k", "3.4k", "2.0k", "10"]
    assert rows["H100 InfiniBand"][-5:-3] == ["11.5k", "17.3k"]
    assert "this machine" in rows
    bad = subprocess.run(
        [sys.executable, "-m", "parcourse", "roofline", "--latency-us", "50"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "a simulated link is for the sweep" in bad.stderr


def test_the_planners_table_says_which_bound_each_plan_is_under():
    """compute against what the step waits for of its messages (tp, cp, ep, dp)."""
    assert bound_of({"compute": 1.0, "tp": 0.4, "dp": 0.5}) == "compute"
    assert bound_of({"compute": 1.0, "tp": 0.4, "dp": 0.5, "cp": 0.2}) == "communication"
    plans = plan(model("1.3B", 2048), Cluster.preset("h100", 8), 64, dtype="bf16")
    lines = format_plans(plans, 4).splitlines()
    assert "bound" in lines[0].split()
    for p, line in zip(plans.ranked, lines[1:5]):
        assert ("comm." if bound_of(p.time) == "communication" else "compute") in line.split()

"""Lessons 06-07: the pipeline schedules' bubbles and the microbatches each holds in flight.
With equal stages and free messages: GPipe's, 1F1B's and interleaved 1F1B's bubble fraction
and peaks. From the costs of a forward (F), a backward (B) and its weight-gradient part (W):
each schedule's idle time per rank (1F1B, ZB-H1, DualPipe) and DeepSeek-V3's table of them.
Last, each named schedule's bubble as `parcourse.pipeline.SCHEDULES` holds it.
"""

from __future__ import annotations

# -- equal stages, free messages: the bubble and the microbatches in flight


def gpipe_bubble(stages: int, microbatches: int) -> float:
    """Idle fraction of a GPipe or 1F1B step with equal stages and free messages:
    (p - 1) / (m + p - 1) (Huang et al., arXiv:1811.06965). Each rank works m (F + B)
    of the (m + p - 1)(F + B) the step lasts."""
    return (stages - 1) / (microbatches + stages - 1)


def gpipe_peak_in_flight(stages: int, microbatches: int, stage: int) -> int:
    """Microbatches whose activations `stage` holds at once under GPipe: all m."""
    return microbatches


def one_f_one_b_peak_in_flight(stages: int, microbatches: int, stage: int) -> int:
    """Under 1F1B: the warm-up's p - s - 1 forwards plus one, at most m: min(p - s, m)."""
    return min(stages - stage, microbatches)


def interleaved_bubble(ranks: int, chunks: int, microbatches: int) -> float:
    """Interleaved 1F1B with equal chunks and free messages (Narayanan et al., SC 2021):
    the bubble's time shrinks by the number of chunks per rank, (p - 1)(F + B) / v,
    while the work stays m (F + B): (p - 1) / (v m + p - 1)."""
    return (ranks - 1) / (chunks * microbatches + ranks - 1)


def interleaved_peak_in_flight(ranks: int, chunks: int, microbatches: int, rank: int) -> int:
    """Chunk-microbatches rank r holds at once under interleaved 1F1B: its warm-up,
    (v - 1) rounds of min(p, m) plus 2 (p - 1 - r) (1F1B's p - 1 - r when v = 1), plus
    one, at most v m. Each is a
    v-th of a stage, so rank 0 holds about p (1 + (p - 1) / (p v)) stages' worth (for
    m >= p): more than 1F1B's p."""
    per_round = min(ranks, microbatches)
    warmup = (chunks - 1) * per_round + (2 if chunks > 1 else 1) * (ranks - 1 - rank)
    return min(warmup + 1, chunks * microbatches)


# -- idle time per rank from the costs F, B and W


def one_f_one_b_bubble_time(stages: int, forward: float, backward: float) -> float:
    """Idle time of each rank under GPipe and 1F1B: (p - 1)(F + B)."""
    return (stages - 1) * (forward + backward)


def zero_bubble_h1_bubble_time(
    stages: int, forward: float, backward: float, weight: float
) -> float:
    """Idle time of each rank under ZB-H1 (Qi et al., arXiv:2401.10241, with B the whole
    backward, I + W): (p - 1)(F + B - 2W), against 1F1B's (p - 1)(F + B). Valid while
    W <= F and the Ws held back fit in the bubble at the end."""
    return (stages - 1) * (forward + backward - 2 * weight)


def bubble_fraction(
    bubble_time: float, microbatches: int, forward: float, backward: float
) -> float:
    """Idle fraction from the idle time per rank: bubble / (bubble + m (F + B))."""
    return bubble_time / (bubble_time + microbatches * (forward + backward))


def zero_bubble_h1_peak_in_flight(stages: int, microbatches: int) -> int:
    """ZB-H1 holds min(p, m) microbatches on every stage (a microbatch is held until its
    W): 1F1B's peak, which 1F1B reaches on stage 0 only."""
    return min(stages, microbatches)


def dualpipe_bubble_time(
    ranks: int, forward_backward: float, backward: float, weight: float
) -> float:
    """DualPipe's bubble as DeepSeek-V3's report gives it (arXiv:2412.19437, table 2):
    (PP/2 - 1)(F&B + B - 3W) of idle time per rank, where F&B is a forward and a
    backward of two microbatches run overlapped on one device, F, B and W those of one
    stage. The course's simulator (`Costs.overlap`, F&B a fraction of F + B) gives the
    busiest rank exactly this idle time when the input-gradient part of backward takes
    what a forward takes (F = B - W, as the zero-bubble papers assume) and F&B >= B
    (tests/test_pipeline_schedules.py); elsewhere its own figure. Run one after the
    other, as this course's runtime runs a pair, see `dualpipe_apart_bubble_time`."""
    return (ranks / 2 - 1) * (forward_backward + backward - 3 * weight)


def dualpipe_apart_bubble_time(ranks: int, forward: float, backward: float, weight: float) -> float:
    """DualPipe's idle time per rank when each pair's forward and backward run one after
    the other (this course's runtime): (PP/2 - 1)(F + B - 2W), half ZB-H1's, for F = B - W.
    Not from the report: it is what the simulator gives on those costs, for every even
    PP tried (tests/test_pipeline_schedules.py), the pairs' own overlap aside."""
    return (ranks / 2 - 1) * (forward + backward - 2 * weight)


def deepseek_table(
    ranks: int, forward: float, backward: float, weight: float, forward_backward: float
) -> dict[str, dict[str, float]]:
    """DeepSeek-V3's report, table 2: for 1F1B, ZB1P (zero-bubble, ZB-H1 here) and
    DualPipe, the bubble (idle time per rank), the parameters a rank holds (x one
    stage's) and the activations (microbatches in flight on a rank, x one stage's)."""
    p = ranks
    return {
        "1F1B": {
            "bubble": one_f_one_b_bubble_time(p, forward, backward),
            "parameters": 1,
            "activations": p,
        },
        "ZB1P": {
            "bubble": zero_bubble_h1_bubble_time(p, forward, backward, weight),
            "parameters": 1,
            "activations": p,
        },
        "DualPipe": {
            "bubble": dualpipe_bubble_time(p, forward_backward, backward, weight),
            "parameters": 2,
            "activations": p + 1,
        },
    }


def dualpipe_v_peak_in_flight(ranks: int) -> int:
    """DualPipeV holds 2p + 1 chunk-microbatches on every rank (m >= 2p): p + 1/2 stages'
    worth, near 1F1B's p on stage 0."""
    return 2 * ranks + 1


# -- each named schedule's bubble, as `parcourse.pipeline.SCHEDULES` holds it


def gpipe_formula(p: int, m: int, v: int, f: float, b: float, w: float) -> float:
    """GPipe's and 1F1B's bubble fraction as a schedule's formula (`NamedSchedule.bubble`:
    ranks p, microbatches m, chunks v, costs F, B, W)."""
    return gpipe_bubble(p, m)


def zero_bubble_h1_formula(p: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """ZB-H1's bubble fraction from its idle time (None with no costs: real compute)."""
    if f + b <= 0:  # real compute: no costs to put in the formula
        return None
    return bubble_fraction(zero_bubble_h1_bubble_time(p, f, b, w), m, f, b)


def dualpipe_formula(p: int, m: int, v: int, f: float, b: float, w: float) -> float | None:
    """The idle fraction with each pair run one after the other, as the course's runtime
    runs them; it holds where F = B - W (dualpipe_apart_bubble_time)."""
    if f + b <= 0 or abs(f - (b - w)) > 1e-9 * (f + b):
        return None
    return bubble_fraction(dualpipe_apart_bubble_time(p, f, b, w), m, f, b)

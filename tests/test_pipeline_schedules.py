"""Pipeline schedules checked without processes: every dependency, every microbatch once,
the bubble and the in-flight activations the papers give."""

import pytest

from parcourse.pipeline import (Action, Costs, Deadlock, Op, Schedule, check, gpipe,
                                happens_before, naive, one_f_one_b, simulate)
from parcourse.theory import gpipe_bubble, one_f_one_b_peak_in_flight

SIZES = [(p, m) for p in range(1, 9) for m in range(1, 17)]


@pytest.mark.parametrize("build", [gpipe, one_f_one_b], ids=lambda f: f.__name__)
def test_every_schedule_is_complete_and_can_run(build):
    for p, m in SIZES:
        check(build(p, m))


@pytest.mark.parametrize("build", [gpipe, one_f_one_b], ids=lambda f: f.__name__)
def test_bubble_equals_the_formula_with_equal_costs(build):
    for p, m in SIZES:
        for costs in (Costs(forward=1, backward=1), Costs(forward=1, backward=2)):
            # Exact: the simulated times are sums of small integers.
            assert simulate(build(p, m), costs).bubble == pytest.approx(gpipe_bubble(p, m),
                                                                        abs=1e-12), (p, m)


def test_in_flight_microbatches():
    for p, m in SIZES:
        assert simulate(gpipe(p, m)).peak_in_flight == [m] * p  # GPipe: all of them
        peaks = simulate(one_f_one_b(p, m)).peak_in_flight
        assert peaks == [one_f_one_b_peak_in_flight(p, m, s) for s in range(p)]
    # The syllabus's example: 4 stages, 8 microbatches: 4 in flight instead of 8.
    assert simulate(one_f_one_b(4, 8)).peak_in_flight[0] == 4


def test_prints_as_torch_pipelining_does():
    assert [str(a) for a in one_f_one_b(4, 8)[3][:4]] == ["3F0", "3B0", "3F1", "3B1"]
    text = str(gpipe(2, 2))
    assert text.splitlines()[0].split() == ["step", "rank", "0", "rank", "1"]
    assert "0F1" in text and "1B0" in text


def test_happens_before():
    s = gpipe(4, 8)
    assert happens_before(s, stage=0, first=Op("F", 3), then=Op("B", 0))
    assert not happens_before(one_f_one_b(4, 8), stage=0, first=Op("F", 7), then=Op("B", 0))
    with pytest.raises(ValueError, match="does not run"):
        happens_before(s, stage=1, first=Action(0, "F", 0), then=Op("B", 0))


def test_naive_is_one_microbatch_one_rank_at_a_time():
    t = simulate(naive(4), Costs(forward=1, backward=2))
    assert t.step_time == 4 * 3 and t.bubble == pytest.approx(3 / 4)


def test_broken_schedules_are_named():
    backward_first = Schedule("bad", 1, (0, 1), ((Action(0, "B", 0), Action(0, "F", 0)),
                                                 (Action(1, "F", 0), Action(1, "B", 0))))
    with pytest.raises(Deadlock, match="rank 0 waits at 0B0"):
        check(backward_first)
    missing = Schedule("bad", 2, (0,), ((Action(0, "F", 0), Action(0, "B", 0)),))
    with pytest.raises(ValueError, match="0F1 never runs"):
        check(missing)
    wrong_rank = Schedule("bad", 1, (0, 1), ((Action(1, "F", 0),), ()))
    with pytest.raises(ValueError, match="stage 1 is on rank 1"):
        check(wrong_rank)
    with pytest.raises(ValueError, match="microbatches must be"):
        gpipe(2, 0)


def test_messages_and_link_cost():
    p, m = 4, 8
    free = simulate(gpipe(p, m))
    assert free.messages == 2 * (p - 1) * m  # activations forward, gradients back
    slow = simulate(gpipe(p, m), Costs(latency=0.5))
    assert slow.step_time > free.step_time


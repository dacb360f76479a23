"""Pipeline schedules checked without processes: every dependency, every microbatch once,
the bubble and the in-flight activations the papers give."""

import pytest

from parcourse.pipeline import (
    Action,
    Costs,
    Deadlock,
    Op,
    Schedule,
    check,
    dualpipe_v,
    gpipe,
    happens_before,
    interleaved_1f1b,
    naive,
    one_f_one_b,
    simulate,
    zero_bubble_h1,
)
from parcourse.theory import (
    bubble_fraction,
    gpipe_bubble,
    interleaved_bubble,
    interleaved_peak_in_flight,
    one_f_one_b_bubble_time,
    one_f_one_b_peak_in_flight,
    zero_bubble_h1_bubble_time,
    zero_bubble_h1_peak_in_flight,
)

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
            assert simulate(build(p, m), costs).bubble == pytest.approx(
                gpipe_bubble(p, m), abs=1e-12
            ), (p, m)


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
    # A malformed schedule still prints (each rank's order), for `check` to say what is wrong.
    off_route = Schedule(
        "bad",
        2,
        (0, 1),
        ((Action(0, "F", 0), Action(0, "F", 2)), (Action(1, "F", 0), Action(1, "B", 0))),
    )
    assert "0F2" in str(off_route)
    with pytest.raises(ValueError, match="0F2 is outside 2 stages x 2 microbatches"):
        check(off_route)


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
    backward_first = Schedule(
        "bad",
        1,
        (0, 1),
        ((Action(0, "B", 0), Action(0, "F", 0)), (Action(1, "F", 0), Action(1, "B", 0))),
    )
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


# --------------------------------------------------------------------------- pipelines II


def test_interleaved_zero_bubble_and_dualpipe_are_complete_and_can_run():
    for p, m in SIZES:
        check(zero_bubble_h1(p, m))
        for v in range(1, 5):
            if m % min(p, m) == 0:
                check(interleaved_1f1b(p, v, m))
        if m >= 2 * p:
            check(dualpipe_v(p, m))


def test_interleaved_bubble_shrinks_by_the_number_of_chunks():
    # The formula holds once a round fills the pipeline (m >= p): with fewer microbatches
    # a chunk's result comes back round the ring before the next round can start.
    for p, m in SIZES:
        for v in range(1, 5):
            if m < p or m % p:
                continue
            t = simulate(interleaved_1f1b(p, v, m), Costs(forward=1 / v, backward=2 / v))
            assert t.bubble == pytest.approx(interleaved_bubble(p, v, m), abs=1e-9), (p, v, m)
            assert t.peak_in_flight == [interleaved_peak_in_flight(p, v, m, r) for r in range(p)]
    assert interleaved_1f1b(4, 1, 8).actions == one_f_one_b(4, 8).actions
    with pytest.raises(ValueError, match="not a multiple of 4"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(ValueError, match="chunks_per_rank"):
        interleaved_1f1b(4, 0, 8)


def test_interleaving_costs_messages():
    free = [simulate(interleaved_1f1b(4, v, 8)).messages for v in (1, 2, 4)]
    assert free == [2 * 3 * 8, 2 * 7 * 8, 2 * 15 * 8]  # every stage boundary is a message

    def step(v, latency=0.0):
        costs = Costs(forward=1 / v, backward=2 / v, latency=latency)
        return simulate(interleaved_1f1b(4, v, 8), costs).step_time

    assert step(4) < step(2) < step(1)  # free messages: the more chunks the better
    # A message that costs as much as a stage's forward: 4 chunks lose to 1.
    assert step(4, latency=1.0) > step(1, latency=1.0)


@pytest.mark.parametrize("f,b,w", [(1, 2, 1), (1, 1, 0.5), (1, 2, 0.5), (2, 3, 1)])
def test_zero_bubble_h1_bubble_is_the_papers(f, b, w):
    for p, m in SIZES:
        if m < p:  # too few microbatches for the held-back Ws to fill the bubble
            continue
        t = simulate(zero_bubble_h1(p, m), Costs(forward=f, backward=b, weight=w))
        want = bubble_fraction(zero_bubble_h1_bubble_time(p, f, b, w), m, f, b)
        assert t.bubble == pytest.approx(want, abs=1e-9), (p, m)
        assert t.peak_in_flight == [zero_bubble_h1_peak_in_flight(p, m)] * p
        one = simulate(one_f_one_b(p, m), Costs(forward=f, backward=b))
        assert t.step_time - sum(t.busy) / p < one.step_time - sum(one.busy) / p + 1e-9
        assert one.step_time - sum(one.busy) / p == pytest.approx(one_f_one_b_bubble_time(p, f, b))


def test_zero_bubble_splits_every_backward_and_defers_weights():
    s = zero_bubble_h1(4, 8)
    assert not any(a.kind == "B" for acts in s.actions for a in acts)
    # The last stage holds back 3 weight gradients: its first W comes after its 4th I.
    last = [str(a) for a in s[3]]
    assert last.index("3W0") > last.index("3I3")
    assert happens_before(s, 3, Op("I", 3), Op("W", 0))
    assert happens_before(s, 0, Op("W", 0), Op("F", 4))  # stage 0 holds none back


def test_dualpipe_v_places_stages_as_a_v_and_beats_one_f_one_b():
    s = dualpipe_v(4, 8)
    assert s.stage_rank == (0, 1, 2, 3, 3, 2, 1, 0)  # first and last stage on rank 0
    for p in range(1, 9):
        for m in (2 * p, 2 * p + 1, 4 * p):
            # each chunk is half a stage of the same model: F, B, W halved
            t = simulate(dualpipe_v(p, m), Costs(forward=0.5, backward=1, weight=0.5))
            one = simulate(one_f_one_b(p, m), Costs(forward=1, backward=2))
            assert t.bubble < one.bubble or p == 1, (p, m)
            assert t.peak_in_flight == [2 * p + 1] * p  # chunks: p + 1/2 stages' worth
    with pytest.raises(ValueError, match="at least 2 x ranks = 8 microbatches"):
        dualpipe_v(4, 7)


def test_each_receive_is_posted_once_before_its_action_and_when_its_sender_starts():
    """The runtime (with gloo) posts each receive before the action this rank runs, on the
    simulator's timeline, when the action sending the message starts."""
    from parcourse.pipeline.posting import receives_to_post

    schedules = [
        build(p, m) for p, m in SIZES[::7] for build in (gpipe, one_f_one_b, zero_bubble_h1)
    ]
    schedules += [interleaved_1f1b(4, 2, 8), dualpipe_v(4, 8), dualpipe_v(2, 4)]
    for schedule in schedules:
        timeline = simulate(schedule, Costs())
        start = {str(s.action): s.start for s in timeline.spans}
        for rank in range(schedule.ranks):
            mine = schedule.actions[rank]
            end = [next(s.end for s in timeline.spans if s.action == a) for a in mine]
            sender = {}  # action -> the one whose message it waits for, on another rank
            for a in mine:
                if a.kind == "F" and a.stage > 0:
                    names = [f"{a.stage - 1}F{a.microbatch}"]
                elif a.kind in "BI" and a.stage < schedule.stages - 1:
                    names = [f"{a.stage + 1}{k}{a.microbatch}" for k in "BI"]
                else:
                    continue
                peer_stage = a.stage - 1 if a.kind == "F" else a.stage + 1
                if schedule.stage_rank[peer_stage] != rank:
                    sender[str(a)] = min(start[n] for n in names if n in start)
            posts = receives_to_post(schedule, rank)
            posted = [(k, str(a)) for k, acts in posts.items() for a in acts]
            assert sorted(a for _, a in posted) == sorted(sender), schedule.name
            for k, a in posted:
                j = [str(b) for b in mine].index(a)
                assert k <= j and (k == 0 or end[k - 1] <= sender[a]), (schedule.name, a)
                assert k == j or end[k] > sender[a], (schedule.name, a)

    def named(posts):
        return {k: [str(a) for a in acts] for k, acts in sorted(posts.items())}

    # 1F1B on 2 ranks, m = 4: rank 1 posts F1's receive with F0's (rank 0 starts F1 as
    # rank 1 starts F0), not all four at once and not when F1 comes up.
    assert named(receives_to_post(one_f_one_b(2, 4), 1)) == {
        0: ["1F0", "1F1"],
        3: ["1F2"],
        5: ["1F3"],
    }
    # ZB-H1: the gradient comes from the next stage's I.
    assert named(receives_to_post(zero_bubble_h1(2, 4), 0)) == {
        2: ["0I0"],
        3: ["0I1"],
        6: ["0I2"],
        9: ["0I3"],
    }
    # DualPipeV on 2 ranks: rank 0 holds stages 0 and 3, and receives from rank 1 both the
    # activations of stage 2 and the gradients of stage 1.
    assert named(receives_to_post(dualpipe_v(2, 4), 0)) == {
        2: ["3F0"],
        4: ["3F1"],
        8: ["3F2", "0B0"],
        11: ["3F3"],
        12: ["0B1"],
        14: ["0I2"],
        16: ["0I3"],
    }


def test_the_registry_states_what_each_schedule_accepts():
    """Each entry of SCHEDULES says which sizes its builder takes and how many stages per
    rank it makes: the CLI, lesson 07 and the benchmarks read that instead of a list."""
    from parcourse.pipeline import SCHEDULES, schedule_by_name

    for name, entry in SCHEDULES.items():
        for p in range(1, 7):
            for m in range(1, 17):
                try:
                    schedule = schedule_by_name(name, p, m, chunks=3)
                except ValueError:
                    assert not entry.accepts(p, m), (name, p, m)
                    continue
                assert entry.accepts(p, m), (name, p, m)
                assert schedule.stages == p * (3 if entry.chunks is None else entry.chunks)
                assert schedule.microbatches == (m if entry.microbatched else 1)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'; choose one of naive"):
        schedule_by_name("zigzag", 2, 4)


def test_imports_go_one_way():
    """actions <- schedule, actions <- simulate <- posting <- runtime: no cycle, and the
    builders never need the simulator."""
    import ast
    import pathlib

    import parcourse.pipeline

    folder = pathlib.Path(parcourse.pipeline.__file__).parent
    graph = {}
    for path in folder.glob("*.py"):
        if path.stem == "__init__":
            continue
        tree = ast.parse(path.read_text())
        graph[path.stem] = {
            n.module.rsplit(".", 1)[1]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            and n.module
            and n.module.startswith("parcourse.pipeline.")
        }
    assert graph["actions"] == set()
    assert graph["schedule"] == {"actions"} and graph["simulate"] == {"actions"}
    done: set[str] = set()

    def visit(module, path):
        assert module not in path, f"import cycle: {' -> '.join([*path, module])}"
        if module not in done:
            for other in graph[module]:
                visit(other, [*path, module])
            done.add(module)

    for module in graph:
        visit(module, [])


def test_zbv_is_complete_on_a_v_and_all_but_bubble_free_when_f_i_w_are_equal():
    """ZB-V (Qi et al. sec. 6): runnable for every p and m (cut back from max(2p - 1, m)
    as torch's is); on the V placement; with F = I = W its bubble is below ZB-H1's and
    1F1B's, and every rank holds at most 2p chunk-microbatches (1F1B's first stage)."""
    from parcourse.pipeline import Costs, check, one_f_one_b, simulate, zbv, zero_bubble_h1

    for p in range(1, 9):
        for m in range(1, 2 * p + 3):
            plan = zbv(p, m)
            check(plan)
            assert plan.stage_rank == tuple(range(p)) + tuple(reversed(range(p)))
            assert all(sum(a.kind == "W" for a in acts) == 2 * m for acts in plan.actions)
    costs = Costs(forward=1.0, backward=2.0, weight=1.0)  # F = I = W
    v = simulate(zbv(4, 16), costs.per_chunk(2))
    assert v.bubble < simulate(zero_bubble_h1(4, 16), costs).bubble
    assert v.bubble < simulate(one_f_one_b(4, 16), costs).bubble < 0.2
    assert max(v.peak_in_flight) <= 2 * 4


# --- DualPipe: two directions, two copies of the weights


def test_dualpipe_is_complete_and_runs_for_even_ranks():
    from parcourse.pipeline.schedule import dualpipe

    for p in (2, 4, 6, 8):
        for m in range(2 * p, 4 * p + 1, 2):
            s = dualpipe(p, m)
            check(s)  # every route's F and B (or I and W) once, on its rank, runnable
            assert s.stages == 2 * p and s.model_stages == p
            # Rank r holds stage r of the copy the first half goes down, and stage
            # p-1-r of the copy the second half comes up.
            for r in range(p):
                held = sorted(s.model_stage(t) for t, rank in enumerate(s.stage_rank) if rank == r)
                assert held == sorted({r, p - 1 - r}) and len(held) == 2
            assert [s.route(i)[0] for i in range(m)] == [0] * (m // 2) + [p] * (m // 2)
            for f, b in s.together:  # each pair: a forward, then a backward, on one rank
                acts = s[s.stage_rank[f.stage]]
                assert f.kind == "F" and b.kind == "B"
                assert acts.index(b) == acts.index(f) + 1
    for p, m, message in (
        (3, 6, "even number of ranks"),
        (4, 6, "at least 2 x ranks"),
        (4, 9, "even number of microbatches"),
    ):
        with pytest.raises(ValueError, match=message):
            dualpipe(p, m)


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_the_simulated_dualpipe_bubble_is_deepseeks_where_it_applies(p):
    """DeepSeek-V3's report (table 2): DualPipe idles (PP/2 - 1)(F&B + B - 3W) per rank,
    F&B a forward and a backward run overlapped. The simulator, costing a pair of
    `together` as a fraction of F + B, gives the busiest rank exactly that when F = B - W
    (what the zero-bubble papers assume) and F&B >= B; run apart, as the course's runtime
    runs them, (PP/2 - 1)(F + B - 2W). The report's 1F1B and ZB1P rows are the simulator's
    1F1B and ZB-H1 idle time."""
    from parcourse import theory
    from parcourse.pipeline.schedule import dualpipe, one_f_one_b, zero_bubble_h1

    f, b, w = 1.0, 2.0, 1.0
    for overlap in (0.7, 0.85, 1.0, None):
        for m in (2 * p, 6 * p):
            t = simulate(dualpipe(p, m), Costs(forward=f, backward=b, weight=w, overlap=overlap))
            idle = max(t.step_time - busy for busy in t.busy)
            want = (
                theory.dualpipe_apart_bubble_time(p, f, b, w)
                if overlap is None
                else theory.deepseek_table(p, f, b, w, overlap * (f + b))["DualPipe"]["bubble"]
            )
            assert idle == pytest.approx(want, abs=1e-9), (overlap, m)
    for build, row in ((one_f_one_b, "1F1B"), (zero_bubble_h1, "ZB1P")):
        t = simulate(build(p, 4 * p), Costs(forward=f, backward=b, weight=w))
        idle = max(t.step_time - busy for busy in t.busy)
        assert idle == pytest.approx(theory.deepseek_table(p, f, b, w, f + b)[row]["bubble"])
    # Overlapping pays: the whole step shrinks with the pairs' cost.
    alone = simulate(dualpipe(p, 4 * p), Costs(forward=f, backward=b, weight=w))
    paired = simulate(dualpipe(p, 4 * p), Costs(forward=f, backward=b, weight=w, overlap=0.7))
    assert paired.step_time < alone.step_time
    with pytest.raises(ValueError, match="overlap must be in"):
        Costs(overlap=1.5)

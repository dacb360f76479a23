"""The rank functions lessons use, and the exercise checks (which must be able to fail)."""

import re

import pytest
import torch
import torch.distributed as dist

from parcourse import Pool
from parcourse.experiments import all_reduce, data_parallel, launching, timing


@pytest.fixture(scope="module")
def pool3():
    with Pool(3) as pool:
        yield pool


def stub_step(flat, bounds, step, rank, n, group):
    raise NotImplementedError


def exchange(flat, bounds, step, rank, n, group):
    """Send and receive the right chunks; return (received, where it belongs)."""
    send = bounds[(rank - step - 1) % n]
    recv = bounds[(rank - step - 2) % n]
    incoming = torch.empty(recv[1] - recv[0])
    works = [
        dist.irecv(incoming, (rank - 1) % n, group),
        dist.isend(flat[send[0] : send[1]], (rank + 1) % n, group),
    ]
    for w in works:
        w.wait()
    return incoming, recv


def wrong_step(flat, bounds, step, rank, n, group):
    exchange(flat, bounds, step, rank, n, group)  # forgets to add what it received


def right_step(flat, bounds, step, rank, n, group):
    incoming, (start, end) = exchange(flat, bounds, step, rank, n, group)
    flat[start:end] += incoming


def step_that_raises(flat, bounds, step, rank, n, group):
    raise ValueError("a typo")


def swapped_step(flat, bounds, step, rank, n, group):  # sends left, receives from the right
    send_start, send_end = bounds[(rank - step - 1) % n]
    recv_start, recv_end = bounds[(rank - step - 2) % n]
    incoming = torch.empty(recv_end - recv_start)
    works = [
        dist.irecv(incoming, (rank + 1) % n, group),
        dist.isend(flat[send_start:send_end], (rank - 1) % n, group),
    ]
    for work in works:
        work.wait()
    flat[recv_start:recv_end] += incoming


def step_that_never_sends(flat, bounds, step, rank, n, group):
    dist.recv(torch.empty(1), (rank - 1) % n, group)  # waits for a message nobody sends


def test_ring_step_check_tells_stub_wrong_and_right(pool3, capsys):
    assert all_reduce.check_ring_step(stub_step, pool3) is False
    assert "Not written yet" in capsys.readouterr().out
    # A wrong answer gets one short message (expected, got, hint), not a traceback.
    assert all_reduce.check_ring_step(wrong_step, pool3) is False
    out = capsys.readouterr().out
    assert out.startswith("Not quite: rank 0 ended with chunk") and "expected" in out
    assert "Hint:" in out and "Traceback" not in out and out.count("\n") == 1
    assert all_reduce.check_ring_step(step_that_raises, pool3) is False
    assert re.fullmatch(r"Not yet: rank \d raised ValueError: a typo\n", capsys.readouterr().out)
    assert all_reduce.check_ring_step(right_step, pool3, numel=11)  # uneven chunks
    assert "Correct" in capsys.readouterr().out


def test_ring_step_check_stops_a_step_that_waits_forever(pool2, capsys):
    assert all_reduce.check_ring_step(step_that_never_sends, pool2, timeout=3) is False
    out = capsys.readouterr().out
    assert out.startswith("Not yet: ranks 0, 1 were still waiting after 3 s. Hint:")
    assert all_reduce.check_ring_step(right_step, pool2)  # the pool starts fresh ranks


def test_ring_step_check_hints_at_the_direction_when_gloo_aborts(capsys):
    """Left and right swapped: chunks of other sizes meet, and gloo aborts the ranks with
    C++'s text on their stderr; the check still answers in one line, with a hint."""
    with Pool(4, timeout=60) as pool:
        assert all_reduce.check_ring_step(swapped_step, pool, numel=10, timeout=20) is False
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank") and out.count("\n") == 1, out
    assert "send to the right and receive from the left" in out and "GLHF" not in out


def test_ring_step_check_needs_two_ranks(capsys):
    with Pool(1) as pool:
        assert all_reduce.check_ring_step(right_step, pool) is False
    assert "One rank has no ring" in capsys.readouterr().out


def test_average_check_tells_stub_wrong_and_right(pool3, capsys):
    def stub(ctx):
        raise NotImplementedError

    def wrong(ctx):
        t = torch.tensor([ctx.rank + 1.0])
        dist.all_reduce(t, group=ctx.group)
        return t.item()  # forgot to divide

    def right(ctx):
        t = torch.tensor([ctx.rank + 1.0])
        dist.all_reduce(t, group=ctx.group)
        return t.item() / ctx.world_size

    assert launching.check_average(stub, pool3) is False
    assert "Not written yet" in capsys.readouterr().out
    assert launching.check_average(wrong, pool3) is False
    assert capsys.readouterr().out == (
        "Not quite: expected 2 on every rank, got [6.0, 6.0, 6.0]. Hint: all_reduce sums in "
        "place; divide by ctx.world_size afterwards, and return a number.\n"
    )
    assert launching.check_average(lambda ctx: None, pool3) is False
    assert "got [None, None, None]" in capsys.readouterr().out
    assert launching.check_average(right, pool3)


def test_time_all_reduce_alternates_and_times_every_algorithm(pool3):
    per_rank = pool3.run(all_reduce.time_all_reduce, ["ring", "naive", "torch"], [4096, 65536], 3)
    for result in per_rank.results:
        assert set(result) == {(a, s) for a in ("ring", "naive", "torch") for s in (4096, 65536)}
        assert all(len(ts) == 3 and all(t > 0 for t in ts) for ts in result.values())
    slowest = timing.slowest_rank(per_rank.results, ("ring", 4096))
    assert slowest == [max(r[("ring", 4096)][i] for r in per_rank.results) for i in range(3)]


def test_time_over_links_alternates_every_algorithm_and_link(pool3):
    from parcourse.comm import SimulatedLink
    from parcourse.theory import CostModel

    links = {"free": SimulatedLink(), "slow": SimulatedLink(0.01)}
    per_rank = pool3.run(all_reduce.time_over_links, ["ring", "naive"], 4096, links, 2).results
    assert set(per_rank[0]) == {(a, n) for a in ("ring", "naive") for n in links}
    model = CostModel(0.01, float("inf"))
    for algo in ("ring", "naive"):
        slow = timing.slowest_rank(per_rank, (algo, "slow"))
        assert len(slow) == 2 and min(slow) >= 0.95 * model.all_reduce_s(algo, 4096, 3)


def _time_with_a_broken_ring(ctx, batch=1, broken_call=1):
    """time_all_reduce with a ring whose call number `broken_call` adds one too many on rank 1."""
    real, calls = all_reduce.ring_all_reduce, []

    def broken(t, group=None, **kw):
        real(t, group, **kw)
        calls.append(1)
        if ctx.rank == 1 and len(calls) == broken_call:
            t.add_(1)

    all_reduce.ring_all_reduce = broken
    try:
        return all_reduce.time_all_reduce(ctx, ["ring"], [4096], 1, batch=batch)
    finally:
        all_reduce.ring_all_reduce = real


def test_time_all_reduce_starts_from_ones_and_checks_every_result(pool3):
    # 3 ranks, 90 rounds: summing the same tensor over and over would pass
    # 3**81 (float32's limit) and reach inf; every round starts from ones instead.
    per_rank = pool3.run(all_reduce.time_all_reduce, ["ring", "torch"], [4096], 45)
    assert all(len(ts) == 45 for r in per_rank.results for ts in r.values())
    with pytest.raises(Exception, match=r"rank 1: ring all-reduce of 4096 bytes gave \[4.0"):
        pool3.run(_time_with_a_broken_ring)


def test_traced_all_reduce_counts_bytes_and_checks_its_result(pool3):
    run = pool3.run(all_reduce.traced_all_reduce, "ring", 300)
    assert run.results == [2 * 2 / 3 * 1200] * 3
    assert {s.meta["chunk"] for s in run.trace.spans_of(rank=0)} == {0, 1, 2}
    with pytest.raises(Exception, match="unknown algorithm 'tree'"):
        pool3.run(all_reduce.traced_all_reduce, "tree", 300)


def test_time_all_reduce_runs_a_batch_back_to_back_and_checks_its_result(pool3):
    # A sample of 5 sums ones 5 times over: 3**5 = 243 everywhere, checked after each sample.
    per_rank = pool3.run(all_reduce.time_all_reduce, ["ring", "torch"], [4096], 4, batch=5)
    assert all(
        len(ts) == 4 and all(t > 0 for t in ts) for r in per_rank.results for ts in r.values()
    )
    # One wrong sum in the middle of a sample (call 3: the warm-up, then the sample's
    # second) carries through the rest of it: 9 + 10 + 9 = 28 where 27 was due.
    with pytest.raises(Exception, match=r"ring all-reduce of 4096 bytes gave \[28.0.*expected 27"):
        pool3.run(_time_with_a_broken_ring, 3, 3)


def test_time_all_reduce_refuses_a_batch_its_dtype_cannot_sum_exactly(pool3):
    # float16 holds every integer up to 2048 exactly; 3**7 = 2187 is past it.
    with pytest.raises(Exception, match=r"batch=7 with 3 ranks .* more than float16 holds exactly"):
        pool3.run(all_reduce.time_all_reduce, ["ring"], [4096], 1, "float16", batch=7)
    per_rank = pool3.run(all_reduce.time_all_reduce, ["ring"], [4096], 1, "float16", batch=6)
    assert len(per_rank.results[0]["ring", 4096]) == 1


def test_max_batch_keeps_sums_of_ones_exact():
    assert all_reduce.max_batch(2) == 24 and all_reduce.max_batch(4) == 12  # float32: up to 2**24
    assert all_reduce.max_batch(3, "float16") == 6  # 3**6 = 729 <= 2048 < 3**7
    assert all_reduce.max_batch(2, "bfloat16") == 8
    assert all_reduce.max_batch(1) > 1000  # one rank sums nothing


# Lesson 02's exercises: the rule that starts buckets during backward, and bucket assignment.


def rule_stub(ready, buckets, next_bucket, launch):
    raise NotImplementedError


def rule_after_backward(ready, buckets, next_bucket, launch):
    return next_bucket  # starts nothing: the wrapper starts every bucket after backward


def rule_one_at_a_time(ready, buckets, next_bucket, launch):
    if next_bucket < len(buckets) and all(i in ready for i in buckets[next_bucket]):
        launch(next_bucket)
        return next_bucket + 1
    return next_bucket


def rule_out_of_order(ready, buckets, next_bucket, launch):
    for k, bucket in enumerate(buckets):
        if k >= next_bucket and all(i in ready for i in bucket):
            launch(k)
            next_bucket = k + 1
    return next_bucket


def rule_too_early(ready, buckets, next_bucket, launch):
    while next_bucket < len(buckets) and any(i in ready for i in buckets[next_bucket]):
        launch(next_bucket)
        next_bucket += 1
    return next_bucket


def test_launch_rule_check_tells_stub_wrong_and_right(capsys):
    assert data_parallel.check_launch_rule(rule_stub) is False
    assert "Not written yet" in capsys.readouterr().out
    for wrong in (rule_after_backward, rule_one_at_a_time, rule_out_of_order, rule_too_early):
        assert data_parallel.check_launch_rule(wrong) is False, wrong.__name__
        out = capsys.readouterr().out
        assert out.startswith("Not quite (") and "expected bucket 0 after" in out
        assert "; got " in out and "Hint:" in out and out.count("\n") == 1
    assert data_parallel.check_launch_rule(lambda *a: 1 / 0) is False
    assert (
        capsys.readouterr().out == "Not yet: your function raised ZeroDivisionError: "
        "division by zero\n"
    )
    assert data_parallel.check_launch_rule(data_parallel.launch_ready_buckets)


def test_bucket_check_tells_stub_wrong_and_right(capsys):
    def stub(sizes, limit):
        raise NotImplementedError

    def forward_order(sizes, limit):  # forgets that backward produces the last layer first
        buckets, filled = [], 0
        for i, size in enumerate(sizes):
            if not buckets or filled + size > limit:
                buckets.append([])
                filled = 0
            buckets[-1].append(i)
            filled += size
        return buckets

    def right(sizes, limit):
        return [[len(sizes) - 1 - i for i in b] for b in forward_order(sizes[::-1], limit)]

    assert data_parallel.check_buckets(stub) is False
    assert "Not written yet" in capsys.readouterr().out
    assert data_parallel.check_buckets(forward_order) is False
    assert capsys.readouterr().out == (
        "Not quite (sizes [400, 40, 4000, 40], limit 1000): expected [[3], [2], [1, 0]], "
        "got [[0, 1], [2], [3]]. Hint: walk the parameters from the last to the first, and "
        "start a new bucket when the next one would not fit.\n"
    )
    assert data_parallel.check_buckets(right)
    capsys.readouterr()
    # every reasonable spelling of a right answer: tuples, numpy's or torch's integers
    import numpy as np

    assert data_parallel.check_buckets(lambda s, lim: tuple(tuple(b) for b in right(s, lim)))
    assert data_parallel.check_buckets(lambda s, lim: [np.array(b) for b in right(s, lim)])
    assert data_parallel.check_buckets(lambda s, lim: [torch.tensor(b) for b in right(s, lim)])
    capsys.readouterr()
    for wrong in (lambda s, lim: None, lambda s, lim: [[0.5]], lambda s, lim: 3):
        assert data_parallel.check_buckets(wrong) is False
        assert capsys.readouterr().out.startswith("expected a list of buckets")


def test_the_mesh_exercise_answers_every_wrong_answer_in_a_line(capsys):
    """Lesson 09's check_coordinates: the right answer passes; the first axis changing
    fastest, no dict, a missing axis and a raise are each one line, never a traceback."""
    from parcourse.experiments.hybrid import check_coordinates
    from parcourse.mesh import Layout

    def right(rank, sizes):
        return Layout(tuple(sizes), tuple(sizes.values())).coordinates(rank)

    def first_fastest(rank, sizes):
        out = {}
        for axis, size in sizes.items():
            rank, out[axis] = divmod(rank, size)
        return out

    assert check_coordinates(right)
    assert capsys.readouterr().out.startswith("Correct: every rank of 5 meshes")
    assert not check_coordinates(first_fastest)
    assert "Hint: the last axis changes fastest" in capsys.readouterr().out
    assert not check_coordinates(lambda r, s: list(right(r, s).values()))
    assert "the right numbers; return a dict {axis: coordinate}" in capsys.readouterr().out
    for wrong in (lambda r, s: None, lambda r, s: {"dp": 0}, lambda r, s: 1 / 0):
        assert not check_coordinates(wrong)
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and out.startswith("Not "), out


def test_the_planning_exercise_answers_every_wrong_answer_in_a_line(capsys):
    """Lesson 09's check_plan: the planner's best passes; the wrong GPU count, a plan
    turned down, a slow plan, a wrong type and a raise are each one line."""
    from parcourse.experiments.planning import check_plan, exercise_plans

    _, cluster, plans = exercise_plans()
    best = plans.ranked[0].choice
    assert check_plan(lambda: (best.dp, best.tp, best.pp, best.microbatches))
    assert capsys.readouterr().out.startswith("Correct: ")
    slow = next(
        p.choice for p in plans.ranked if p.time["step"] > 1.2 * plans.ranked[0].time["step"]
    )
    turned_down = next(p.choice for p in plans.rejected if p.why_not.startswith("out of memory"))
    cases = {
        (1, 1, 1, 1): f"the cluster has {cluster.gpus} GPUs",
        (slow.dp, slow.tp, slow.pp, slow.microbatches): "the best's",
        (
            turned_down.dp,
            turned_down.tp,
            turned_down.pp,
            turned_down.microbatches,
        ): "is turned down: out of memory",
        "dp2": "return four whole numbers",
        None: "return four whole numbers",
    }
    for answer, said in cases.items():
        assert not check_plan(lambda answer=answer: answer)
        out = capsys.readouterr().out
        assert said in out and out.count("\n") == 1 and out.startswith("Not quite"), out
    assert not check_plan(lambda: (2, 16, 1, 8))  # two mistakes: both said
    out = capsys.readouterr().out
    assert "does not divide the 40 heads" in out and "tp 16 spans nodes of 8 GPUs" in out
    assert not check_plan(lambda: 1 / 0)
    assert capsys.readouterr().out.startswith("Not yet: your function raised ZeroDivisionError")


def test_data_parallel_steps_times_every_configuration_over_every_link(pool2):
    from parcourse.comm import SimulatedLink

    configs = {
        "alone": {"impl": "none"},
        "naive": {"impl": "naive"},
        "buckets": {"impl": "bucketed", "bucket_mb": 0.01, "overlap": False},
    }
    links = {"slow": SimulatedLink(0.002), "free": SimulatedLink()}
    # the quickest of 4 steps: a preempted step only reads slower
    per_rank = pool2.run(
        data_parallel.data_parallel_steps, configs, links, 4, width=32, depth=3, batch=16
    ).results
    med = {k: min(timing.slowest_rank(per_rank, k)) for k in per_rank[0]}
    assert set(med) == {(c, n) for c in configs for n in links}
    # Two ranks: 2 ring steps per all-reduce, 2 ms each. naive: 6 parameters; buckets of
    # 10 KB: 2 (layers of 4.2 KB, two to a bucket).
    assert med["naive", "slow"] >= 6 * 2 * 0.002 > med["alone", "slow"]
    assert med["buckets", "slow"] >= 2 * 2 * 0.002


def test_a_launch_rule_drives_real_buckets(pool2):
    # The rule decides when buckets start: during backward (the library's rule) or,
    # with no rule, only after it. A slow link makes every all-reduce last 4 ms or more.
    for rule in (data_parallel.launch_ready_buckets, None):
        run = pool2.run(
            data_parallel.train_with_rule,
            rule,
            1,
            width=64,
            depth=6,
            batch=64,
            bucket_mb=0.02,
            latency_us=2000.0,
        )
        assert len(run.results[0]) == 1
        for rank in range(2):
            backward = run.trace.spans_of(rank=rank, name="backward")[-1]
            comm = [
                s
                for s in run.trace.spans_of(rank=rank, kind="comm")
                if s.start_ns >= run.trace.spans_of(rank=rank, name="forward")[-1].start_ns
            ]
            # launched during backward (a bucket's span is drawn from when the one before
            # it finished: on this slow link they queue)
            early = [s for s in comm if s.meta["launched_ns"] < backward.end_ns]
            assert len(comm) == 6  # 64 x 64 + 64 floats: one bucket per layer
            assert (len(early) >= len(comm) - 1) if rule else not early

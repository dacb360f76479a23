"""The pipeline runtime on real ranks: same weights as one process, the bubble and the
in-flight activations the theory predicts, failures that end the run with their action.

Tolerance for weights: fp32; a pipeline adds the microbatches' gradients one by one,
one process computes the whole batch's at once, so sums are ordered differently
(rtol=1e-5, atol=1e-6 after two steps; the differences seen are below 2e-8).
"""

import pytest
import torch
from pipeline_reference import one_process
from torch import nn

from parcourse import RankError
from parcourse.experiments.pipeline import make_schedule, train
from parcourse.pipeline import gpipe
from parcourse.pipeline.partition import partition
from parcourse.pipeline.runtime import SimulatedCompute
from parcourse.pipeline.simulate import in_flight

TOL = {"rtol": 1e-5, "atol": 1e-6}


def gathered(run):
    """Every rank's weights by name; a weight two ranks hold (tied) must be equal."""
    weights = {}
    for r in run.results:
        for name, w in r["weights"].items():
            if name in weights:
                assert torch.equal(weights[name], w), f"the copies of {name} differ"
            weights[name] = w
    return weights


SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipe-v", "dualpipe"]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_trains_like_one_process(pools, world_size, model, schedule):
    """The MLP's 8 layers, or the GPT's embedding, 6 blocks and head (its embedding and
    head tied, on different ranks except under DualPipeV), over 2 steps. DualPipe holds
    two copies of every stage: `gathered` checks they are bitwise equal after training."""
    run = pools[world_size].run(train, make_schedule(schedule, world_size, 8), 2, model=model)
    expected = one_process(2, model=model)
    got = gathered(run)
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **TOL, msg=name)


@pytest.mark.parametrize("schedule,model", [("1f1b", "gpt"), ("zb-h1", "gpt"), ("dualpipe", "mlp")])
def test_gradients_accumulate_over_steps_as_in_one_process(pools, schedule, model):
    """Two runtime steps (the batch's halves) before each optimizer step: a weight held
    on two ranks (the GPT's tied embedding and head, DualPipe's two copies of every
    stage) gets this step's gradients summed over them, added to what it held (each
    step had summed the whole gradient again, counting the first half's twice)."""
    run = pools[2].run(train, make_schedule(schedule, 2, 4), 2, model=model, accumulate=2)
    expected = one_process(2, model=model, accumulate=2)
    got = gathered(run)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **TOL, msg=name)


def test_a_frozen_tied_weight_stays_as_it_was(pools):
    """The GPT's embedding, tied to its head on the other rank, frozen: it gets no
    gradient and SGD leaves it, as in one process (the sum over its ranks had given it
    zeros, and an optimizer with weight decay or momentum moved it)."""
    run = pools[2].run(
        train,
        make_schedule("1f1b", 2, 4),
        2,
        model="gpt",
        frozen=("tok_emb.weight",),
        weight_decay=0.1,
    )
    expected = one_process(2, model="gpt", frozen=("tok_emb.weight",), weight_decay=0.1)
    got = gathered(run)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **TOL, msg=name)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-h1", "zbv", "dualpipe-v", "dualpipe"])
def test_uneven_stages_train_like_one_process(pools, schedule):
    """11 layers over 8 stages (4 ranks x 2 chunks, or 4 ranks): stages of 1 and 2 layers."""
    run = pools[4].run(train, make_schedule(schedule, 4, 8), 2, depth=11, batch=24)
    expected = one_process(2, depth=11, batch=24)
    got = gathered(run)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **TOL, msg=name)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "schedule,microbatches",
    [("naive", 1), ("gpipe", 1), ("gpipe", 2), ("gpipe", 8), ("1f1b", 2), ("1f1b", 8)],
)
def test_same_weights_as_one_process(pools, world_size, schedule, microbatches):
    run = pools[world_size].run(train, make_schedule(schedule, world_size, microbatches), 2)
    expected = one_process(2)
    got = gathered(run)
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], **TOL, msg=name)
    assert run.results[-1]["losses"][1] < run.results[-1]["losses"][0]


def check_runs_the_schedule(run, seconds):
    """What a step under simulated compute shows whatever else loads the machine (how
    close its bubble comes to the formula is `benchmarks/pipeline.py`'s to measure): each
    rank ran its schedule's actions in their order, each at least its simulated
    `seconds` ({kind: s}, the stage's share), and none before what it needs (a
    forward after the previous stage's forward of that microbatch ended, a backward after
    the next stage's backward), on the one clock every local rank shares."""
    plan = run.results[0]["schedule"]
    spans = {}
    for rank, result in enumerate(run.results):
        mine = sorted(
            (s for s in result["spans"] if s.kind == "compute" and "action" in s.meta),
            key=lambda s: s.start_ns,
        )
        assert [(s.meta["action"], s.meta["stage"], s.meta["microbatch"]) for s in mine] == [
            (a.kind, a.stage, a.microbatch) for a in plan.actions[rank]
        ], rank
        for s in mine:
            assert s.duration_s >= seconds[s.meta["action"]] - 1e-3, (rank, s.name)
            spans[s.meta["action"], s.meta["stage"], s.meta["microbatch"]] = s
    for (kind, stage, m), span in spans.items():
        if kind == "W":  # needs only its own I, on this rank
            continue
        other = plan.previous_stage(stage, m) if kind == "F" else plan.next_stage(stage, m)
        if other is None:
            continue
        needed = (
            spans.get(("F", other, m))
            if kind == "F"
            else (spans.get(("B", other, m)) or spans.get(("I", other, m)))
        )
        assert needed is not None and span.start_ns >= needed.end_ns, (kind, stage, m)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("microbatches", [1, 4, 8])
def test_a_step_with_simulated_compute_runs_the_schedule_in_order(pools, world_size, microbatches):
    """GPipe, F 30 ms and B 60 ms a stage: the real math (a tiny MLP) takes far less, so
    every rank behaves like a device of its own; checked by what cannot be noise (the
    measured bubble against (p-1)/(m+p-1) is benchmarks/pipeline.py's)."""
    compute = SimulatedCompute(forward=0.03, backward=0.06)
    run = pools[world_size].run(train, gpipe(world_size, microbatches), 1, compute=compute)
    check_runs_the_schedule(run, {"F": 0.03, "B": 0.06})


@pytest.mark.parametrize("schedule,expected", [("gpipe", 8), ("1f1b", 4)])
def test_in_flight_activations_on_the_first_stage(pools, schedule, expected):
    """GPipe holds all m microbatches' activations on stage 0; 1F1B at most p."""
    run = pools[4].run(train, make_schedule(schedule, 4, 8), 1)
    counters = [c for c in run.trace.counters if c.rank == 0 and c.name == "in_flight_bytes"]
    one = counters[0].value  # bytes one microbatch holds on stage 0
    assert max(c.meta["now"] for c in counters) == expected * one


def test_recomputing_keeps_each_microbatchs_own_bytes_on_every_stage(pool2):
    """With recompute a stage keeps its input; the last stage also what its loss saved
    (the output and the targets): three microbatch-sized tensors there, one elsewhere.
    A microbatch's targets are its own storage: a view into the whole batch's would
    count the whole batch once per microbatch in flight."""
    width, batch, m = 16, 16, 4
    one = batch // m * width * 4  # bytes of one microbatch's activations between layers
    run = pool2.run(train, gpipe(2, m), 1, width=width, batch=batch, recompute=True)
    held = {r["held_per_stage"][s]: s for r in run.results for s in r["held_per_stage"]}
    assert held == {one: 0, 3 * one: 1}


# Simulated compute for one rank's share of the model: F 80 ms, B 160 ms (W half of B);
# a chunk of an interleaved or V schedule takes its fraction.
SIMULATED = {"forward_ms": 80, "backward_ms": 160, "batch": 32}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_schedule_runs_in_order_and_holds_what_the_simulator_counts(pools, schedule):
    """p = 4, m = 8: each rank runs its actions in order, none before what it needs
    (`check_runs_the_schedule`; the bubble against the simulator's is
    benchmarks/pipeline.py's), and rank 0's peak in-flight activation bytes are within
    10% of the simulator's count of microbatches on each of its stages times the bytes
    one microbatch holds there (measured)."""
    first = pools[4].run(train, make_schedule(schedule, 4, 8), 1, **SIMULATED)
    plan = first.results[0]["schedule"]
    per_rank = plan.model_stages // plan.ranks
    split = plan.splits_backward
    forward, backward = 0.08 / per_rank, 0.16 / per_rank
    check_runs_the_schedule(
        first,
        {"F": forward, "B": backward, "I": backward / 2, "W": backward / 2}
        if split
        else {"F": forward, "B": backward},
    )
    counters = [c for c in first.trace.counters if c.rank == 0 and c.name == "in_flight_bytes"]
    held = {}  # bytes one microbatch holds on each of rank 0's stages: its first forward
    for c in counters:
        held.setdefault(c.meta["stage"], c.value)
    per_stage = [held.get(s, 0) for s in range(plan.stages)]
    expected = max(in_flight(plan[0], per_stage))
    assert max(c.meta["now"] for c in counters) == pytest.approx(expected, rel=0.10)


def _fails_at_microbatch_2(ctx):
    from parcourse.pipeline.runtime import PipelineRuntime
    from parcourse.pipeline.schedule import gpipe

    class Flaky(nn.Linear):
        calls = 0

        def forward(self, x):
            Flaky.calls += 1
            if ctx.rank == 1 and Flaky.calls == 3:
                raise ValueError("a bad microbatch")
            return super().forward(x)

    runtime = PipelineRuntime(
        gpipe(2, 4), {ctx.rank: Flaky(4, 4)}, ctx.group, nn.functional.mse_loss
    )
    x = torch.randn(8, 4)
    runtime.step(x if ctx.rank == 0 else None, x if ctx.rank == 1 else None)


def test_a_failing_rank_ends_the_run_naming_its_action(pool2):
    with pytest.raises(RankError, match="rank 1 failed at 1F2: ValueError: a bad microbatch"):
        pool2.run(_fails_at_microbatch_2)
    assert pool2.run(lambda ctx: ctx.rank).results == [0, 1]  # fresh ranks afterwards


def _steps_again_after_a_failure(ctx):
    from parcourse.pipeline.runtime import PipelineRuntime
    from parcourse.pipeline.schedule import gpipe

    groups = [torch.distributed.new_group([r]) for r in range(ctx.world_size)]

    class Once(nn.Linear):
        failed = False

        def forward(self, x):
            if not Once.failed:
                Once.failed = True
                raise ValueError("a bad microbatch")
            return super().forward(x)

    runtime = PipelineRuntime(
        gpipe(1, 2), {0: Once(4, 4)}, groups[ctx.rank], nn.functional.mse_loss
    )
    x = torch.randn(8, 4)
    messages = []
    for again in (
        lambda: runtime.step(x, x),
        lambda: runtime.step(x, x),
        lambda: runtime.prepare(x),
    ):
        try:
            again()
        except RuntimeError as e:
            messages.append(str(e))
    return messages


def test_a_runtime_that_failed_refuses_to_step_again(pool2):
    """Messages of the failed step may still be in flight (receives posted ahead): a
    second step could take them for its own, so it raises instead."""
    for messages in pool2.run(_steps_again_after_a_failure).results:
        assert "failed at 0F0: ValueError: a bad microbatch" in messages[0]
        assert "an earlier step failed" in messages[1]
        assert "an earlier step failed" in messages[2]  # prepare refuses too


def _prepares_before_the_first_step(ctx):
    from parcourse.pipeline.runtime import PipelineRuntime
    from parcourse.pipeline.schedule import gpipe

    torch.manual_seed(0)
    runtime = PipelineRuntime(
        gpipe(2, 4), {ctx.rank: nn.Linear(4, 4)}, ctx.group, nn.functional.mse_loss
    )
    x, first = torch.randn(8, 4), ctx.rank == 0
    refused = []
    for wrong in (None, torch.randn(6, 4)) if first else ():
        try:
            runtime.prepare(wrong)
        except ValueError as e:
            refused.append(str(e))
    runtime.prepare(x if first else None)
    agreed = dict(runtime._shapes)  # rank 1's can only have come in a message from rank 0
    runtime.prepare(x if first else None)  # again: nothing left to agree on, no message
    for _ in range(2):
        runtime.step(x if first else None, None if first else x)
    if first:
        try:
            runtime.step(torch.randn(16, 4))
        except ValueError as e:
            refused.append(str(e))
    return refused, agreed


def test_prepare_agrees_on_shapes_before_the_first_step(pool2):
    """`prepare` does what a first step does before its first action (the stages agree
    on their messages' shapes), so that a step timed after it is the schedule's alone;
    it refuses what `step` refuses, and the shapes it agreed on hold for every step."""
    first, last = pool2.run(_prepares_before_the_first_step).results
    assert "pass the batch's inputs" in first[0][0]
    assert "4 microbatches do not divide the batch of 6 inputs" in first[0][1]
    assert "microbatches of shape (4, 4), but this pipeline agreed on (2, 4)" in first[0][2]
    assert last[0] == []
    assert first[1] == {0: (torch.Size([2, 4]), torch.float32)}
    assert last[1] == {1: (torch.Size([2, 4]), torch.float32)}


def test_partition():
    layers = [nn.Linear(4, 4) for _ in range(5)] + [nn.Linear(4, 64)]
    assert [len(s) for s in partition(layers, 3)] == [2, 2, 2]
    by_params = partition(layers, 2, by="params")  # the last layer weighs 320 of 420
    assert [len(s) for s in by_params] == [5, 1]
    with pytest.raises(ValueError, match="7 stages need at least 7 layers"):
        partition(layers, 7)
    with pytest.raises(ValueError, match="by must be"):
        partition(layers, 2, by="flops")


def test_bad_batches_and_schedules_are_refused():
    from parcourse.experiments.pipeline import make_schedule
    from parcourse.pipeline.runtime import PipelineRuntime

    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("zigzag", 2, 4)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        make_schedule("interleaved-1f1b", 4, 6)
    with pytest.raises(ValueError, match="at least 2 x ranks"):
        make_schedule("dualpipe-v", 4, 4)
    with pytest.raises(ValueError, match="cannot recompute"):
        PipelineRuntime(
            make_schedule("zb-h1", 1, 2),
            {0: nn.Linear(2, 2)},
            None,
            nn.functional.mse_loss,
            recompute=True,
        )


def test_cli_prints_grid_bubbles_and_in_flight(capsys):
    from parcourse.cli import main

    assert (
        main(
            [
                "pipeline",
                "--schedule",
                "gpipe",
                "--stages",
                "2",
                "--microbatches",
                "4",
                "--forward-ms",
                "5",
                "--backward-ms",
                "10",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "formula (p-1)/(m+p-1) 0.200   simulated 0.200   measured" in out
    assert "of a rank's layers): [4, 4]" in out and "0F3" in out
    with pytest.raises(SystemExit):
        main(["pipeline", "--stages", "4", "--microbatches", "3", "--batch", "32"])


def test_cli_runs_every_schedule_name(capsys):
    from parcourse.cli import main

    assert (
        main(
            [
                "pipeline",
                "--schedule",
                "zb-h1",
                "--stages",
                "2",
                "--microbatches",
                "4",
                "--forward-ms",
                "0",
                "--backward-ms",
                "0",
                "--model",
                "gpt",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "zb-h1, 2 ranks, 2 stages" in out and "1I3" in out and "1W3" in out
    assert (
        main(
            [
                "pipeline",
                "--schedule",
                "interleaved-1f1b",
                "--stages",
                "2",
                "--microbatches",
                "4",
                "--forward-ms",
                "0",
                "--backward-ms",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "formula (p-1)/(v m+p-1) 0.111" in out and "3F3" in out
    with pytest.raises(SystemExit, match="16 stages; --layers 8 cannot fill them"):
        main(["pipeline", "--schedule", "interleaved-1f1b", "--chunks", "4"])
    with pytest.raises(SystemExit, match="at least 2 x ranks"):
        main(["pipeline", "--schedule", "dualpipe-v", "--microbatches", "4"])


def test_gpipe_exercise_check(capsys):
    from parcourse.experiments.pipeline import check_schedule_exercise
    from parcourse.pipeline.schedule import B, F

    def right(p, m):
        return [
            [F(s, i) for i in range(m)] + [B(s, i) for i in reversed(range(m))] for s in range(p)
        ]

    def backward_first(p, m):  # can never run
        return [[B(s, i) for i in range(m)] + [F(s, i) for i in range(m)] for s in range(p)]

    def backwards_in_order(p, m):  # runs, but is not GPipe
        return [[F(s, i) for i in range(m)] + [B(s, i) for i in range(m)] for s in range(p)]

    assert check_schedule_exercise(right)
    assert not check_schedule_exercise(backward_first)
    assert "can never finish" in capsys.readouterr().out
    assert not check_schedule_exercise(backwards_in_order)
    out = capsys.readouterr().out
    assert "with 1 stage and 2 microbatches" in out and "not GPipe's" in out
    assert "rank 0 runs 0F0 0F1 0B0 0B1, GPipe runs 0F0 0F1 0B1 0B0" in out  # what was expected
    flat = lambda p, m: [a for acts in right(p, m) for a in acts]  # noqa: E731 - one list
    assert not check_schedule_exercise(flat)
    assert "returned a list of Action; expected one list per rank" in capsys.readouterr().out


def test_one_f_one_b_exercise_check(capsys):
    from parcourse.experiments.pipeline import check_one_f_one_b_exercise
    from parcourse.pipeline.schedule import B, F, one_f_one_b

    def gpipe_like(s, p, m):  # runs, but holds all m
        return [F(s, i) for i in range(m)] + [B(s, i) for i in range(m)]

    def no_warmup(s, p, m):  # holds 1, but stalls the stages after it
        return [a for i in range(m) for a in (F(s, i), B(s, i))]

    assert check_one_f_one_b_exercise(lambda s, p, m: one_f_one_b(p, m)[s])
    assert not check_one_f_one_b_exercise(gpipe_like)
    assert "holds 2 microbatches at once" in capsys.readouterr().out
    assert not check_one_f_one_b_exercise(no_warmup)
    assert "not GPipe's" in capsys.readouterr().out

    def uncapped_warmup(s, p, m):  # p - s - 1 forwards even when m is smaller
        warm = [F(s, i) for i in range(p - s - 1)]
        rest = [a for a in one_f_one_b(p, m)[s] if a not in warm]
        return warm + rest

    assert not check_one_f_one_b_exercise(uncapped_warmup)
    assert "never more than m" in capsys.readouterr().out


def test_a_receive_is_idle_until_its_message_left_and_communication_after(pool2):
    """Over a simulated link of 20 ms, GPipe on 2 ranks with F 30 ms: rank 1 waits for
    each microbatch's activations. Its wait is idle until the message left rank 0 (which
    the messenger stamps on it: after rank 0's forward of that microbatch ended) and
    communication from then (or from when it began waiting, if later), ending at least
    the link's latency after the forward. The schedule is given as a value, built here,
    as every caller passes it."""
    run = pool2.run(train, gpipe(2, 2), 1, forward_ms=30, backward_ms=60, latency_us=20_000)
    rank0, rank1 = (r["spans"] for r in run.results)
    forward_end = {s.name: s.end_ns for s in rank0 if s.kind == "compute"}
    for m in range(2):
        received = next(s for s in rank1 if s.name == f"receive 0F{m}")
        assert received.kind == "comm", received
        assert received.start_ns >= forward_end[f"0F{m}"], (received, forward_end)
        assert received.end_ns >= forward_end[f"0F{m}"] + 20e6, (received, forward_end)
        waited = [s for s in rank1 if s.name == f"wait for 0F{m}"]
        assert all(w.kind == "idle" and w.end_ns == received.start_ns for w in waited)
        assert waited or m, "rank 1 waited 30 ms for the first forward, idle"


def test_ranks_take_a_schedule_built_for_them_never_a_name(pool2):
    """The schedule is built once, before the ranks start (its rules checked there), and
    every rank runs that value: a name, or a schedule for other ranks, is refused."""
    with pytest.raises(RankError, match="built for 4 ranks; this run has 2"):
        pool2.run(train, gpipe(4, 4), 1)
    with pytest.raises(RankError, match=r"pass the schedule itself.*make_schedule\('gpipe'"):
        pool2.run(train, "gpipe", 1)


def _fails_in_a_pair(ctx):
    from parcourse.comm import Turns
    from parcourse.pipeline.runtime import PipelineRuntime
    from parcourse.pipeline.schedule import dualpipe

    schedule = dualpipe(2, 4)
    mine = {s for s, r in enumerate(schedule.stage_rank) if r == ctx.rank}

    class Flaky(nn.Linear):
        calls = 0

        def forward(self, x):
            Flaky.calls += 1
            if ctx.rank == 0 and Flaky.calls == 2:  # 3F3: the forward of a pair
                raise ValueError("a bad microbatch")
            return super().forward(x)

    stages = {s: (Flaky(4, 4) if s == 3 else nn.Linear(4, 4)) for s in mine}
    runtime = PipelineRuntime(schedule, stages, ctx.group, nn.functional.mse_loss, turns=Turns())
    assert (schedule.actions[0][4], schedule.actions[0][5]) in schedule.together
    x = torch.randn(8, 4)
    runtime.step(x, x)


def test_overlapped_pairs_refuse_what_the_whole_rank_shares(pool2):
    """With turns, DualPipe's pairs run in two threads: what would run the whole rank's
    collectives from one of them (ZeRO-3's `around`, ZeRO-2's `on_weight_gradients`) is
    refused, and so is the pacer (the turns pace simulated compute themselves), stages
    off the CPU (a GPU's backward runs on autograd's own thread), and torch's all-to-all
    from a Comm with turns (two threads' calls in any order). A
    forward failing in its pair's thread fails the step at once, naming its action."""
    with pytest.raises(RankError, match="rank 0 failed at 3F3: ValueError: a bad microbatch"):
        pool2.run(_fails_in_a_pair)
    refused = pool2.run(_refusals).results[0]
    assert len(refused) == 5
    assert "cannot share around" in refused[0]
    assert "cannot share on_weight_gradients" in refused[1]
    assert "give one or the other" in refused[2]
    assert "on CPU stages; these are on meta" in refused[3]
    assert "algorithm='ring'" in refused[4]  # torch's all-to-all, in whichever order


def _refusals(ctx):
    import torch.distributed as dist

    from parcourse.comm import Comm, Turns, all_to_all
    from parcourse.pipeline.runtime import PipelineRuntime
    from parcourse.pipeline.schedule import dualpipe
    from parcourse.pipeline.simulate import SimulatedCompute

    schedule = dualpipe(2, 4)
    mine = {s for s, r in enumerate(schedule.stage_rank) if r == ctx.rank}
    refused = []
    for wrong in (
        {"around": lambda a: None},
        {"on_weight_gradients": lambda s, m: None},
        {"paced": Comm(ctx.group), "compute": SimulatedCompute()},
    ):
        try:
            PipelineRuntime(
                schedule,
                {s: nn.Linear(4, 4) for s in mine},
                ctx.group,
                nn.functional.mse_loss,
                turns=Turns(),
                **wrong,
            )
        except ValueError as e:
            refused.append(str(e))
    off_cpu = PipelineRuntime(
        schedule,
        {s: nn.Linear(4, 4, device="meta") for s in mine},
        ctx.group,
        nn.functional.mse_loss,
        turns=Turns(),
    )
    try:  # a GPU's backward runs on autograd's own thread: the meta device stands for it
        off_cpu.prepare(torch.zeros(8, 4))
    except ValueError as e:
        refused.append(str(e))
    torch_a2a = Comm(ctx.group, algorithm="torch")
    torch_a2a.turns = Turns()
    try:
        all_to_all(torch_a2a, torch.zeros(2, 3), [1, 1], [1, 1])
    except ValueError as e:
        refused.append(str(e))
    dist.barrier()
    return refused


def test_turns_count_what_no_thread_computed_beside_as_exposed():
    """`Turns.exposed`: the waits' time in which no thread held the turn, overlapping
    waits once; a wait outside `held` hands nothing on; the turn is not taken twice."""
    from parcourse.comm.turns import Interval, Turns

    turns = Turns()
    turns.held_intervals += [Interval("B", 1.0, 3.0), Interval("F", 3.5, 4.0)]
    turns.waits += [
        Interval("F", 0.5, 2.0, "all-to-all"),
        Interval("F", 2.5, 5.0, "all-to-all"),
        Interval("B", 4.5, 6.0, "all-to-all"),
        Interval("B", 0.0, 9.0, "receive"),
    ]
    # [0.5, 2] and [2.5, 6] less [1, 3] and [3.5, 4]: 0.5 + 0.5 + 2
    assert turns.exposed() == pytest.approx(3.0)
    assert turns.waited() == pytest.approx(1.5 + 3.5)
    assert turns.exposed("receive") == pytest.approx(9.0 - 2.5)
    assert turns.busy() == pytest.approx(2.5)
    fresh = Turns()
    with fresh.handed_on("all-to-all"):  # not holding: nothing to hand on, nothing kept
        pass
    assert fresh.waits == []
    with fresh.held("F"):
        with pytest.raises(RuntimeError, match="holds the turn already"):
            with fresh.held("F"):
                pass
    with pytest.raises(RuntimeError, match="inside held"):
        with fresh.paced(("F", 0), 0.1):
            pass

"""One plan record (`parcourse.plan.ParallelPlan`): each validity rule once, against
`problems()`, and the CLI, `train`, the planner and `Hybrid` answering with that sentence;
its label read back; `crosses_nodes` judged per rank."""

import dataclasses

import plan_fns as F
import pytest
from mesh_fns import nodes_crossed

from parcourse.launch import launch
from parcourse.mesh import Layout
from parcourse.models import GPTConfig
from parcourse.plan import ParallelPlan

CONFIG = GPTConfig(vocab=64, block_size=16, n_layers=4, n_heads=4, d_model=32)  # train3d's

# (plan, batch, world, step, the sentence problems() gives). One per rule.
RULES = [
    (ParallelPlan(dp=0), None, None, True, "dp must be a whole number >= 1, got 0"),
    (
        ParallelPlan(microbatches=-2),
        None,
        None,
        True,
        "microbatches must be a whole number >= 1, got -2",
    ),
    (ParallelPlan(dp=2, tp=2), None, 8, True, "dp 2 x tp 2 x pp 1 is 4 ranks, not the 8 there are"),
    (
        ParallelPlan(dp=6, ranks_per_node=4),
        None,
        None,
        True,
        "4 ranks per node do not divide the 6 ranks",
    ),
    (
        ParallelPlan(order="zigzag"),
        None,
        None,
        True,  # type: ignore[arg-type]
        "unknown order 'zigzag'; choose megatron, llama3 or give the axes outermost first "
        "(e.g. tp,dp)",
    ),
    (
        ParallelPlan(dp=2, tp=2, order="tp,pp"),
        None,
        None,
        False,
        "the order 'tp,pp' has no place for dp",
    ),
    (ParallelPlan(order="tp,tp,dp"), None, None, False, "the order 'tp,tp,dp' names an axis twice"),
    (ParallelPlan(tp=8), None, None, True, "tp 8 does not divide the 4 heads"),
    (ParallelPlan(tp=4, sequence_parallel=True), None, None, True, None),  # 16 tokens: fine
    (
        ParallelPlan(dp=3),
        8,
        None,
        True,
        "the global batch of 8 does not cut into dp 3 x 1 microbatches equal parts",
    ),
    (ParallelPlan(zero=4), None, None, True, "ZeRO stage 4 does not exist: 0, 1, 2 or 3"),
    (
        ParallelPlan(recompute="some"),
        None,
        None,
        True,  # type: ignore[arg-type]
        "recompute 'some' is none of none, selective, full",
    ),
    (
        ParallelPlan(recompute="selective"),
        None,
        None,
        True,
        "the course's 3D step recomputes whole stages (recompute full), not attention's core "
        "alone (selective)",
    ),
    (
        ParallelPlan(split="rows"),
        None,
        None,
        True,  # type: ignore[arg-type]
        "split 'rows' is neither layers nor blocks",
    ),
    (
        ParallelPlan(split="blocks"),
        None,
        None,
        True,
        "the course's 3D step cuts stages by layer count (split layers), not Megatron-LM's blocks",
    ),
    (
        ParallelPlan(pp=3, split="blocks", microbatches=3),
        None,
        None,
        False,
        "3 stages do not split 4 blocks evenly",
    ),
    (
        ParallelPlan(schedule="zigzag"),
        None,
        None,
        True,
        "unknown schedule 'zigzag'; choose one of naive, gpipe, 1f1b, interleaved-1f1b, zb-h1, "
        "zbv, dualpipe, dualpipe-v",
    ),
    (
        ParallelPlan(pp=2, schedule="naive", microbatches=2),
        None,
        None,
        True,
        "naive runs the batch whole: one microbatch, not 2",
    ),
    (
        ParallelPlan(pp=2, schedule="interleaved-1f1b", microbatches=3),
        None,
        None,
        True,
        "interleaved 1F1B runs microbatches in rounds of 2 (the number of ranks): 3 "
        "microbatches is not a multiple of 2",
    ),
    (
        ParallelPlan(pp=2, schedule="dualpipe", microbatches=4),
        None,
        None,
        True,
        "dualpipe holds two copies of every stage, one for each direction: the 3D step and the "
        "planner run the other schedules (dualpipe-v holds one copy)",
    ),
    (
        ParallelPlan(pp=8, microbatches=8),
        None,
        None,
        True,
        "1f1b on pp 8 has 8 stages; the GPT's 6 layers (embedding, 4 blocks, head) cannot fill "
        "them",
    ),
    (
        ParallelPlan(pp=2, schedule="zb-h1", microbatches=2, recompute="full"),
        None,
        None,
        True,
        "zb-h1 splits backward into I and W: no full recompute",
    ),
    (ParallelPlan(cp=0), None, None, True, "cp must be a whole number >= 1, got 0"),
    (
        ParallelPlan(dp=2, cp=2),
        None,
        8,
        True,
        "dp 2 x tp 1 x pp 1 x cp 2 is 4 ranks, not the 8 there are",
    ),
    (
        ParallelPlan(cp=2, cp_method="rings"),
        None,
        None,
        True,  # type: ignore[arg-type]
        "unknown context-parallel method 'rings'; choose one of ring, all-gather, ulysses",
    ),
    (
        ParallelPlan(cp=16),
        None,
        None,
        True,
        "cp 16 cuts a sequence into 32 chunks (two a rank, balanced for the causal mask): a "
        "block of 16 tokens cannot fill them",
    ),
    (
        ParallelPlan(tp=2, cp=4, cp_method="ulysses"),
        None,
        None,
        True,
        "Ulysses gives each of the cp 4 ranks whole heads: the 2 heads a tp rank holds (4 / "
        "tp 2) do not divide by 4",
    ),
    (
        ParallelPlan(tp=2, cp=2, sequence_parallel=True),
        None,
        None,
        True,
        "the course's 3D step cuts the sequence over tp (SP) or over cp (cp 2), not both",
    ),
    (ParallelPlan(tp=2, cp=2, sequence_parallel=True), None, None, False, None),
]


@pytest.mark.parametrize(
    "plan,batch,world,step,said", RULES, ids=[r[-1][:40] if r[-1] else "fine" for r in RULES]
)
def test_each_rule_is_one_sentence_naming_the_numbers(plan, batch, world, step, said):
    got = plan.problems(CONFIG, batch, world=world, step=step)
    assert got == ([said] if said else []), got
    if said:
        with pytest.raises(ValueError, match="^" + _escaped(said) + "$"):
            plan.check(CONFIG, batch, world=world, step=step)


def _escaped(text):
    import re

    return re.escape(text)


@pytest.mark.parametrize(
    "plan,batch,world,step,said",
    [r for r in RULES if r[-1] and r[3] and r[2] is None],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_train3d_refuses_each_plan_with_the_same_sentence(capsys, plan, batch, world, step, said):
    """`train3d`, before any rank starts: the plan given field by field, and as a label
    (`--plan`) where the label can carry it (a negative size or an unknown schedule cannot
    be read from one: the label's own refusal names the word)."""
    from parcourse.cli import main

    given = [_flags(plan)]
    try:
        given.append(["--plan", ParallelPlan.parse(plan.label()).label()])
    except ValueError as e:
        assert plan.microbatches < 0 or "zigzag" in (plan.schedule,) or plan.cp_method == "rings", e
    for flags in given:
        with pytest.raises(SystemExit) as exit_:
            main(["train3d", *flags, "--batch", str(batch or max(1, plan.dp * plan.microbatches))])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == f"python -m parcourse: error: {said}", (flags, err)


def _flags(plan):
    """Every field as a flag (none left to the command's defaults)."""
    out = []
    for f in dataclasses.fields(plan):
        value = getattr(plan, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif value is not None:
            out += [flag, str(value)]
    return out


# The rules `Hybrid`'s keywords can break on 2 ranks (one rank's plans on a dp 2 mesh),
# as (the rule's plan in RULES, the mesh, Hybrid's keywords).
HYBRID_KEYWORDS = [
    (ParallelPlan(zero=4), {"dp": 2}, {"zero": 4}),
    (ParallelPlan(schedule="zigzag"), {"dp": 2}, {"schedule": "zigzag"}),
    (
        ParallelPlan(pp=2, schedule="naive", microbatches=2),
        {"pp": 2},
        {"schedule": "naive", "microbatches": 2},
    ),
    (
        ParallelPlan(pp=2, schedule="interleaved-1f1b", microbatches=3),
        {"pp": 2},
        {"schedule": "interleaved-1f1b", "microbatches": 3},
    ),
    (
        ParallelPlan(pp=2, schedule="dualpipe", microbatches=4),
        {"pp": 2},
        {"schedule": "dualpipe", "microbatches": 4},
    ),
    (
        ParallelPlan(pp=2, schedule="zb-h1", microbatches=2, recompute="full"),
        {"pp": 2},
        {"schedule": "zb-h1", "microbatches": 2, "recompute": True},
    ),
]


def test_hybrid_and_train_refuse_each_rule_in_the_same_sentence(pool2):
    """Every rule of RULES a run's settings can break: `TrainSettings.problems()` (what
    `train` checks before any rank starts) gives the sentence `problems()` gives; and
    each one `Hybrid`'s keywords can break, built on real ranks, raises it."""
    from parcourse.train import TrainSettings

    model = {"block_size": 16, "layers": 4, "width": 32, "heads": 4}
    for plan, batch, world, step, said in RULES:
        if (
            world is not None
            or not step
            or plan.order == "zigzag"
            or plan.dp < 1
            or plan.microbatches < 1
        ):
            continue  # the world is the plan's own, and sizes below 1 fail Layout first
        settings = TrainSettings(plan=plan, batch=batch or plan.dp * plan.microbatches, **model)
        assert settings.problems() == ([said] if said else []), (plan, settings.problems())
    rules = {plan: said for plan, _, _, _, said in RULES}
    cases = [(shape, kwargs) for _, shape, kwargs in HYBRID_KEYWORDS]
    for said in pool2.run(F.hybrid_keyword_refusals, cases).results:
        assert said == [rules[plan] for plan, _, _ in HYBRID_KEYWORDS], said


def test_the_planner_train_and_the_cli_say_the_same():
    from parcourse.cli import main
    from parcourse.planner import Cluster, plan
    from parcourse.train import TrainSettings

    said = "tp 8 does not divide the 4 heads"
    cluster = Cluster.this_machine(8, flops=1e9, cores=2)
    rejected = plan(CONFIG, cluster, 8, candidates=[ParallelPlan(tp=8)]).rejected
    assert rejected[0].why_not == said
    settings = TrainSettings(plan=ParallelPlan(tp=8), heads=4, width=32)
    assert settings.problems() == [said]
    with pytest.raises(SystemExit):
        main(["train", "--dp", "1", "--tp", "8", "--pp", "1", "--heads", "4"])


def test_the_planner_ranks_only_what_the_step_runs_here():
    """On this machine the search refuses, in the plan's words, what the course's step
    cannot start (a published cluster keeps selective recompute, which Megatron-LM runs);
    every plan it ranks can be given to `train3d --plan`."""
    import argparse

    from parcourse.cli.options import plan_from, plan_options
    from parcourse.planner import Cluster, plan

    cluster = Cluster.this_machine(8, flops=1e9, cores=2)
    selective = ParallelPlan(dp=8, recompute="selective")
    plans = plan(CONFIG, cluster, 16, candidates=[selective, ParallelPlan(dp=8)])
    assert [p.choice for p in plans.ranked] == [ParallelPlan(dp=8)]
    assert "recomputes whole stages" in plans.rejected[0].why_not
    for p in plan(CONFIG, cluster, 16).ranked:
        parser = argparse.ArgumentParser()
        plan_options(parser, ParallelPlan())
        args = parser.parse_args(["--plan", p.choice.label()])
        assert plan_from(args) == p.choice
        assert p.choice.problems(CONFIG, 16, world=8) == []
    published = Cluster.preset("h100", gpus=8)
    assert not selective.problems(CONFIG, 16, world=8, step=False)
    assert plan(CONFIG, published, 16, candidates=[selective], dtype="bf16").ranked


def test_a_plan_of_other_ranks_than_the_cluster_has_is_refused():
    from parcourse.planner import Cluster, plan

    plans = plan(CONFIG, Cluster.preset("h100", gpus=8), 16, candidates=[ParallelPlan(dp=2, tp=2)])
    assert plans.rejected[0].why_not == "dp 2 x tp 2 x pp 1 is 4 ranks, not the 8 there are"


@pytest.mark.parametrize(
    "plan",
    [
        ParallelPlan(),
        ParallelPlan(dp=2, tp=2, pp=2, schedule="1f1b", microbatches=4, zero=1),
        ParallelPlan(
            dp=1,
            tp=4,
            pp=2,
            schedule="interleaved-1f1b",
            microbatches=8,
            chunks=3,
            sequence_parallel=True,
            recompute="full",
            order="llama3",
            ranks_per_node=4,
        ),
        ParallelPlan(
            pp=4, schedule="zb-h1", microbatches=4, zero=2, split="blocks", recompute="selective"
        ),
        ParallelPlan(dp=2, tp=2, order="tp,dp", ranks_per_node=2),
    ],
)
def test_a_label_reads_back_as_its_plan(plan):
    assert ParallelPlan.parse(plan.label()) == plan
    assert ParallelPlan.parse(plan.label().upper().replace("ZERO", "ZeRO")) == plan


def test_a_label_that_cannot_be_read_names_the_word():
    with pytest.raises(ValueError, match="cannot read 'xp2' in the plan 'dp2 xp2'"):
        ParallelPlan.parse("dp2 xp2")
    assert ParallelPlan.parse("dp2 tp2 pp2 1f1b m4 ZeRO-1").label() == "dp2 tp2 pp2 1f1b m4 ZeRO-1"


def test_the_cli_takes_the_plan_or_its_flags_not_both(capsys):
    from parcourse.cli import main

    with pytest.raises(SystemExit):
        main(["train3d", "--plan", "dp2 tp2 pp2 1f1b m2", "--zero", "1"])
    assert "--plan gives the whole layout: leave out --zero or --plan" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--plan", "dp2 pp2 1f1b m2 recompute full"])
    assert "this command does not set recompute" in capsys.readouterr().err


def test_train3d_runs_a_plan_given_as_a_label(capsys):
    from parcourse.cli import main

    label = "dp2 tp1 pp2 interleaved-1f1b m2 ZeRO-1"
    assert main(["train3d", "--plan", label, "--steps", "2", "--layers", "6"]) == 0
    out = capsys.readouterr().out
    assert f"plan        {label}" in out
    lines = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    for _, ours, one in lines[:2]:
        assert float(ours) == pytest.approx(float(one), rel=1e-4)


def test_train3d_with_an_order_of_its_own_puts_tp_across_the_nodes(capsys):
    """--order tp,dp (tp outermost): tp's groups are [0 2] [1 3], across nodes of 2, and
    dp's [0 1] [2 3] inside; the run still equals one process (rtol 1e-4: fp32's order
    of sums)."""
    from parcourse.cli import main

    argv = ["train3d", "--dp", "2", "--tp", "2", "--pp", "1", "--order", "tp,dp"]
    assert main([*argv, "--ranks-per-node", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "plan        dp2 tp2 pp1 1f1b m2 order tp,dp 2/node" in out
    assert "inside a node: dp; across nodes: tp" in out
    lines = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    for _, ours, one in lines[:2]:
        assert float(ours) == pytest.approx(float(one), rel=1e-4)


# -- ranks per node, judged per rank


def test_crosses_nodes_is_judged_by_this_ranks_group():
    """6 ranks, 3 a node, dp 3 x tp 2: tp's groups are [0 1] [2 3] [4 5], and only [2 3]
    spans the two nodes {0 1 2} {3 4 5}: an axis is judged by the rank's own group, not by
    its first."""
    layout = Layout.of({"dp": 3, "tp": 2})
    assert [layout.crosses_nodes(r, ("tp",), 3) for r in range(6)] == [
        False,
        False,
        True,
        True,
        False,
        False,
    ]
    assert all(layout.crosses_nodes(r, ("dp",), 3) for r in range(6))
    assert not any(layout.crosses_nodes(r, ("dp", "tp"), None) for r in range(6))
    run = launch(nodes_crossed, 6, {"dp": 3, "tp": 2}, 3, timeout=120)
    assert [r["tp"] for r in run.results] == [False, False, True, True, False, False]
    assert all(r["dp"] for r in run.results)


# -- the planner refuses what it cannot price


@pytest.mark.parametrize(
    "plan",
    [
        ParallelPlan(dp=0),
        ParallelPlan(dp=-2, tp=4),
        ParallelPlan(tp=-1, dp=8),
        ParallelPlan(microbatches=0),
    ],
)
def test_the_planner_turns_down_sizes_below_one_in_words(plan):
    """Once a ZeroDivisionError (dp 0, microbatches 0), a plan accepted (dp -2) or a
    negative cost (tp -1): now a rejection naming the size."""
    from parcourse.planner import Cluster, predict_memory
    from parcourse.planner import plan as search

    plans = search(CONFIG, Cluster.preset("h100", gpus=8), 16, candidates=[plan])
    assert not plans.ranked
    assert "must be a whole number >= 1" in plans.rejected[0].why_not
    with pytest.raises(ValueError, match="must be a whole number >= 1"):
        predict_memory(CONFIG, plan, 16)


def test_a_dtype_the_planner_does_not_know_is_refused():
    """fp16 (or a misspelling) once counted memory in 16 bits and time in 4-byte numbers."""
    from parcourse.planner import Cluster, predict_memory, predict_time
    from parcourse.planner import plan as search

    cluster = Cluster.preset("h100", gpus=8)
    for call in (
        lambda: search(CONFIG, cluster, 16, dtype="fp16"),
        lambda: predict_memory(CONFIG, ParallelPlan(dp=8), 16, dtype="fp16"),
        lambda: predict_time(CONFIG, ParallelPlan(dp=8), 16, cluster, dtype="bf61"),
    ):
        with pytest.raises(ValueError, match="dtype must be one of fp32, bf16"):
            call()


@pytest.mark.parametrize("seq", ["-3", "0"])
def test_plan_refuses_a_sequence_below_one(capsys, seq):
    """`--seq -3` ended in a traceback and `--seq 0` became 2048 without a word."""
    from parcourse.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "1.3B", "--seq", seq])
    assert exit_.value.code == 2
    assert f"--seq must be at least 1, got {seq}" in capsys.readouterr().err


def test_zero_takes_fp16_as_fsdp2_does_and_refuses_other_dtypes():
    """fp16 compute is taken (with loss scaling beside it: tests/test_zero.py); a dtype
    that is not a 16-bit float or fp32 is refused in one line before any rank starts."""
    import torch
    from torch import nn

    from parcourse.zero import ZeroModel
    from parcourse.zero.mixed_precision import check_compute_dtype

    assert check_compute_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="compute_dtype must be torch.bfloat16, torch.float16"):
        ZeroModel(nn.Linear(4, 4), stage=2, compute_dtype=torch.float64)


def test_hybrid_from_a_plan_refuses_what_the_plan_already_says():
    """`Hybrid.from_plan` takes the layout from the plan: a keyword that repeats one of
    its fields, or a plan for another number of ranks, is refused in one line."""
    from plan_fns import from_plan_refusals

    said = launch(from_plan_refusals, 1, timeout=60).results[0]
    assert said == [
        "zero: given by the plan (dp1 tp1 pp1 1f1b m1), not beside it",
        "dp 2 x tp 1 x pp 1 is 2 ranks, not the 1 there are",
    ]


@pytest.mark.parametrize(
    "plan,batch,world,step,said",
    [r for r in RULES if r[-1] and r[3] and r[2] is None],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_the_planner_turns_down_each_plan_with_the_same_sentence(plan, batch, world, step, said):
    """The search here (this machine: what the course's step runs) rejects each plan in
    the words `problems()` uses, and ranks none of them."""
    from parcourse.planner import Cluster
    from parcourse.planner import plan as search

    sizes_ok = all(
        isinstance(getattr(plan, f), int) and getattr(plan, f) >= 1
        for f in ("dp", "tp", "pp", "cp", "microbatches", "chunks")
    )
    gpus = plan.gpus if sizes_ok else 1
    batch = batch or (plan.dp * plan.microbatches if sizes_ok else 8)
    plans = search(CONFIG, Cluster.this_machine(gpus, flops=1e9, cores=2), batch, candidates=[plan])
    assert not plans.ranked and plans.rejected[0].why_not == said


def test_the_planner_refuses_the_context_parallelism_it_does_not_price():
    """The ring in fp32 is priced (its memory, checked to the byte in tests/test_planner.py,
    and its messages in the step); Ulysses, all-gather and 16 bits are not: the search
    turns them down and `predict_time` and `predict_memory` refuse them, in the same one
    sentence, rather than price them as if they were the ring."""
    from parcourse.comm import SimulatedLink
    from parcourse.planner import Cluster, plan, predict_memory, predict_time

    cluster = dataclasses.replace(
        Cluster.this_machine(4, flops=1e9, cores=2), inside=SimulatedLink(1e-4, 1e9)
    )  # a message costs
    cp = ParallelPlan(dp=2, cp=2, microbatches=2)
    assert cp.problems(CONFIG, 8, world=4) == []
    assert plan(CONFIG, cluster, 8, candidates=[cp]).ranked[0].choice == cp
    assert predict_time(CONFIG, cp, 8, cluster)["cp"] > 0
    ulysses = dataclasses.replace(cp, cp_method="ulysses")
    for choice, dtype in ((ulysses, "fp32"), (cp, "bf16")):
        said = (
            f"cp 2: the planner prices the ring in fp32 only (its memory and its "
            f"messages), not {choice.cp_method} in {dtype}"
        )
        plans = plan(CONFIG, cluster, 8, dtype=dtype, candidates=[choice])
        assert not plans.ranked and plans.rejected[0].why_not == said
        for predict in (predict_memory, predict_time):
            with pytest.raises(ValueError, match=_escaped(said)):
                predict(
                    CONFIG, choice, 8, *((cluster,) if predict is predict_time else ()), dtype=dtype
                )

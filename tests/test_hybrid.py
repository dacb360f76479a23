"""3D parallelism (dp x tp x pp on a mesh) trains the GPT to one process's weights.

Tolerance (rtol=1e-4, atol=1e-5): fp32 on gloo; only the order of reductions differs
(split matrix multiplies summed over tp, microbatches over pp, replicas over dp), about
1e-7 relative per step; Adam divides each gradient by its own running size, so an element
whose gradient is near zero can move by a larger fraction of its tiny change: two steps
stay below 1e-5.
"""

import dataclasses
import math

import pytest
import torch
from hybrid_fns import (
    EXPERTS,
    bad_sizes,
    dropout_masks,
    fp16_refusals,
    one_process,
    one_process_by_microbatch,
    thawed_after_hybrid,
    train,
    train_fp64,
)

from parcourse import Pool, RankError
from parcourse.models import GPTConfig

TOL = {"rtol": 1e-4, "atol": 1e-5}
EIGHT_BLOCKS = GPTConfig(vocab=30, block_size=12, n_layers=8, n_heads=12, d_model=24)
THIRTEEN_TOKENS = GPTConfig(vocab=30, block_size=13, n_layers=4, n_heads=12, d_model=24)
CLIP = 0.5  # below the GPT's gradient norm at both steps (about 1.16 and 0.84): it clips
EXPECTED = {}


def expected(max_norm=None, config=None):
    key = (max_norm, config)
    if key not in EXPECTED:
        EXPECTED[key] = one_process(max_norm=max_norm, **({"config": config} if config else {}))
    return EXPECTED[key]


def check(results, max_norm=None, config=None):
    before, after, losses, norms = expected(max_norm, config)
    for got_before, got_after, got_losses, got_norms in results:
        if max_norm is not None:  # every rank knows the global norm
            assert got_norms == pytest.approx(norms, rel=1e-5)
        for name in after:
            assert torch.equal(got_before[name], before[name]), name  # the split is exact
            torch.testing.assert_close(got_after[name], after[name], **TOL, msg=name)
        if got_losses[0] is not None:
            assert got_losses == pytest.approx(losses, rel=1e-5)


@pytest.fixture(scope="module")
def pool8():
    with Pool(8, timeout=300) as pool:
        yield pool


@pytest.mark.parametrize(
    "shape",
    [
        {"dp": 2, "tp": 2, "pp": 2},
        {"dp": 1, "tp": 2, "pp": 4},
        {"dp": 2, "tp": 1, "pp": 4},
        {"dp": 4, "tp": 2, "pp": 1},
        {"dp": 1, "tp": 4, "pp": 2},
    ],
)
def test_3d_on_eight_ranks_equals_one_process(pool8, shape):
    check(pool8.run(train, shape).results)


def test_3d_with_interleaving_and_sequence_parallelism(pool8):
    check(
        pool8.run(
            train, {"dp": 2, "tp": 2, "pp": 2}, "interleaved-1f1b", sequence_parallel=True
        ).results
    )


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_sequence_parallelism_with_a_split_backward_equals_one_process(pools, schedule):
    """Zero-bubble schedules compute the weights' gradients (W) apart from the input's:
    the replicated weights' (LayerNorms') parts are summed over tp there too (W had added
    them with autograd.grad after the sum, 4e-2 off one process)."""
    check(pools[4].run(train, {"tp": 2, "pp": 2}, schedule, sequence_parallel=True).results)


def test_3d_with_dualpipe_v_and_clipping_equals_one_process(pool8):
    """DualPipeV's V: rank 0 holds the first and the last stage, so the tied embedding and
    head sit on one rank (one Parameter, counted once in the norm)."""
    check(
        pool8.run(
            train, {"dp": 2, "tp": 2, "pp": 2}, "dualpipe-v", microbatches=4, max_norm=CLIP
        ).results,
        CLIP,
    )


@pytest.mark.parametrize("shape", [{"dp": 3, "tp": 1, "pp": 2}, {"dp": 1, "tp": 3, "pp": 2}])
def test_3d_on_six_ranks_equals_one_process(shape):
    with Pool(6, timeout=300) as pool:
        check(pool.run(train, shape, "gpipe", recompute=True).results)


def test_3d_on_a_two_level_network_equals_one_process(pool8):
    """Every axis on the simulated links (the course's ring for tp too), pp crossing the
    nodes: the pipeline's shape-finding pass on the meta device goes through tp's ring."""
    from parcourse.comm import SimulatedLink, Topology

    topology = Topology.of(4, between=SimulatedLink.of(latency_us=200, bandwidth_GBps=1.0))
    check(pool8.run(train, {"dp": 2, "tp": 2, "pp": 2}, link=topology, zero=1).results)


def test_llama3_order_and_zero_bubble_equal_one_process(pool8):
    check(pool8.run(train, {"dp": 2, "tp": 2, "pp": 2}, "zb-h1", order="llama3").results)


def test_bad_sizes_name_the_numbers(pool8):
    for said in pool8.run(bad_sizes).results:
        tp, pp, batch = said
        assert tp == "tp 8 does not divide the 12 heads", tp
        assert "has 8 stages; the GPT's 6 layers" in pp, pp
        assert batch == (
            "the global batch of 24 does not cut into dp 4 x 4 microbatches equal parts"
        ), batch


def test_cli_trains_beside_one_process(capsys):
    from parcourse.cli import main

    assert main(["train3d", "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp 2 x tp 2 x pp 2 = 8 ranks (megatron order), 1f1b" in out
    lines = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    for _, ours, one in lines[:2]:
        assert float(ours) == pytest.approx(float(one), rel=1e-4)
    with pytest.raises(SystemExit):
        main(["train3d", "--tp", "3"])
    assert "tp 3 does not divide the 4 heads" in capsys.readouterr().err


@pytest.mark.parametrize("shape", [{"dp": 2, "tp": 2, "pp": 2}, {"dp": 4, "tp": 1, "pp": 2}])
def test_3d_with_zero_1_over_dp_equals_one_process(pool8, shape):
    """ZeRO-1 over dp: each replica steps 1/dp of the flat parameters (padded to a multiple
    of dp); Adam is elementwise, so the result is one process's."""
    check(pool8.run(train, shape, zero=1).results)


@pytest.mark.parametrize(
    "shape,schedule,microbatches",
    [
        ({"dp": 2, "tp": 2, "pp": 2}, "1f1b", 4),
        ({"dp": 4, "tp": 1, "pp": 2}, "interleaved-1f1b", 2),
        ({"dp": 2, "tp": 1, "pp": 4}, "zb-h1", 4),
    ],
)
def test_3d_with_zero_2_over_dp_equals_one_process(pool8, shape, schedule, microbatches):
    """ZeRO-2 over dp: each microbatch's gradients of a stage reduce-scattered into the
    slices as soon as its backward (B, or W under zero bubble) is done, summed over the
    microbatches there; the tied weights' after the schedule."""
    check(pool8.run(train, shape, schedule, zero=2, microbatches=microbatches).results)


@pytest.mark.parametrize(
    "shape,schedule,microbatches,kwargs",
    [
        ({"dp": 2, "tp": 2, "pp": 2}, "1f1b", 4, {}),
        ({"dp": 4, "tp": 1, "pp": 2}, "1f1b", 2, {"max_norm": CLIP}),
        ({"dp": 2, "tp": 1, "pp": 4}, "interleaved-1f1b", 4, {"config": EIGHT_BLOCKS}),
        ({"dp": 2, "tp": 2, "pp": 2}, "zb-h1", 2, {"sequence_parallel": True}),
        ({"dp": 2, "tp": 1, "pp": 2}, "gpipe", 2, {"recompute": True}),
    ],
)
def test_3d_with_zero_3_over_dp_equals_one_process(request, shape, schedule, microbatches, kwargs):
    """ZeRO-3 over dp: a stage's weights gathered from the replicas' slices before each of
    its actions (F, B, I, W of one microbatch) and freed after, the gradients reduced as
    ZeRO-2's. Each gathered value is the one a whole copy would hold, so the result is one
    process's (TOL: fp32, only the order of the sums differs); with clipping, the norm
    over the slices; with recompute, backward's second forward gathers again; interleaved
    on pp 4, eight stages of a GPT of eight blocks (of six, one weight of one block moves
    1.3e-5 under ZeRO-0 as under ZeRO-3: Adam divides a gradient near zero by its own
    size, and the order of the sums shows)."""
    world = shape["dp"] * shape["tp"] * shape["pp"]
    pool = request.getfixturevalue(f"pool{world}")
    check(
        pool.run(train, shape, schedule, zero=3, microbatches=microbatches, **kwargs).results,
        kwargs.get("max_norm"),
        kwargs.get("config"),
    )


def test_zero_3_holds_a_slice_of_the_weights_between_actions(pool4):
    """Between two actions a ZeRO-3 rank holds none of its stage's weights whole: only its
    rows of each (dp 2, and every weight of the GPT has an even number of rows: exactly
    half, no padding), counted as its parameters; Adam's state is ZeRO-1's, and ZeRO-1's
    optimizer holds nothing else (it steps views into the whole weights)."""
    from hybrid_fns import memory_by_zero

    for zero1, zero3 in zip(
        pool4.run(memory_by_zero, 1).results, pool4.run(memory_by_zero, 3).results
    ):
        assert 2 * zero3["params"] == zero1["params"]
        assert zero3["optimizer"] == zero3["adam"] == zero1["adam"] == zero1["optimizer"]


def test_zero_2_reduce_scatters_each_microbatch(pool4):
    """The price of ZeRO-2 under a pipeline: a reduce-scatter of each stage's gradients per
    microbatch (the ring sends (N-1)/N of the buffer), against ZeRO-1's one per step; the
    all-gather of the updated slices is the same."""
    from hybrid_fns import dp_bytes_by_zero

    shape, m = {"dp": 2, "tp": 1, "pp": 2}, 4
    one = pool4.run(dp_bytes_by_zero, shape, 1, m).results
    two = pool4.run(dp_bytes_by_zero, shape, 2, m).results
    for (sent1, units, tied), (sent2, units2, _) in zip(one, two):
        assert units == units2
        stages = 4 * (sum(units) - tied)  # fp32 bytes of the stages' buffers
        assert sent1 == 4 * sum(units)  # (N-1)/N x S twice, N = 2
        assert sent2 - sent1 == (m - 1) * stages / 2


@pytest.mark.parametrize(
    "shape,kwargs",
    [
        ({"dp": 2, "tp": 2, "pp": 2}, {"sequence_parallel": True}),
        ({"dp": 2, "tp": 2, "pp": 2}, {"zero": 1}),
        ({"dp": 1, "tp": 2, "pp": 4}, {}),
    ],
)
def test_clipping_by_the_global_norm_equals_one_process(pool8, shape, kwargs):
    """The norm over every axis, each element counted once (LayerNorms held whole on every
    tp rank, the tied embedding on the first and last stage, ZeRO's slices), equals
    clip_grad_norm_'s in one process; so do the clipped weights."""
    assert min(expected(CLIP)[3]) > CLIP
    check(pool8.run(train, shape, max_norm=CLIP, **kwargs).results, CLIP)


def test_simulated_compute_pads_each_action_leaving_tps_collectives_on_top(pool4):
    """Hybrid(compute=...): the same weights as one process, and each stage's forward
    and backward last at least their simulated seconds with tp's collectives inside
    them on top (a slow simulated link makes those milliseconds long: padded over, the
    action would last its simulated seconds alone). On top by tp's own clock of the
    seconds its collectives blocked, which their spans enclose and the link bounds from
    below: exact, however busy the machine (the spans also hold the tracer's own work,
    so a bound on their sum needs a margin that a preempted rank can overrun). Paced:
    once an action of the same stage and kind has run (microbatch 1 here), the first
    collective waits for its share of the seconds, cut evenly at the n collectives:
    S / (n + 1)."""
    from hybrid_fns import padded_spans

    from parcourse.comm import SimulatedLink
    from parcourse.pipeline.simulate import SimulatedCompute

    shape = {"dp": 1, "tp": 2, "pp": 2}
    compute = SimulatedCompute(forward=[0.02, 0.03], backward=[0.04, 0.06])
    check(pool4.run(train, shape, compute=compute).results)
    seconds = compute.of(2)
    runs = pool4.run(padded_spans, shape, compute, SimulatedLink.of(latency_us=2000)).results
    for spans in runs:
        assert len(spans) == 2 * 2  # a forward and a backward of each microbatch
        for stage, kind, microbatch, lasted, tp, n, first, blocked, least in spans:
            assert least >= 4e-3  # at least an all-reduce: a ring of 2 hops of 2 ms
            assert least <= blocked <= tp, (stage, kind, least, blocked, tp)
            assert lasted >= seconds[kind][stage] + blocked, (stage, kind, lasted, blocked)
            if microbatch == 1:
                assert first >= seconds[kind][stage] / (n + 1), (stage, kind, first, n)


def test_a_traced_step_says_each_messages_axis(pool8):
    from hybrid_fns import traced_step

    for sent, param_bytes, axes, weights in pool8.run(
        traced_step, {"dp": 2, "tp": 2, "pp": 2}
    ).results:
        assert {"tp", "pp", "dp"} <= axes
        # dp: the ring all-reduce of every gradient, 2(N-1)/N x S = S for N = 2, in lesson
        # 02's buckets, each with a used-flag (fp32) per weight
        assert sent["dp"] == param_bytes + 4 * weights
        assert sent["pp"] > 0  # activations and their gradients, between stages


@pytest.mark.parametrize("axis", ["tp", "pp"])
def test_placement_runs_both_ways_beside_the_model(pool4, axis):
    """benchmarks/hybrid.py's run, tiny: both placements time a step; the model puts
    the axis across nodes above it inside a node for tp (the timing itself is the
    benchmark's to judge)."""
    from parcourse.comm import Topology
    from parcourse.experiments.hybrid import PLACEMENTS, placement_predictions, placement_step_times

    topology = Topology.of(2)
    results = pool4.run(placement_step_times, topology, 1, axis=axis).results
    for r in results:
        assert set(r["times"]) == set(PLACEMENTS[axis])
        assert all(len(t) == 1 for t in r["times"].values())
    model = placement_predictions(topology, max(r["param_bytes"] for r in results), axis=axis)
    inside, across = PLACEMENTS[axis]
    assert model[inside] > 0 and model[across] > 0
    if axis == "tp":
        assert model[across] > model[inside]


@pytest.mark.parametrize(
    "shape,zero,experts",
    [
        ({"dp": 2, "tp": 2, "pp": 1}, 1, False),
        ({"dp": 1, "tp": 2, "pp": 2}, 0, False),
        ({"dp": 2, "tp": 1, "pp": 2}, 1, False),
        ({"ep": 2, "tp": 2}, 0, True),
        ({"dp": 2, "ep": 2}, 1, True),
        ({"ep": 2, "pp": 2}, 1, True),
    ],
)
def test_memory_per_rank_beside_the_formula(pool4, shape, zero, experts):
    """Parameters and gradients: the mean over ranks is theory.mesh_bytes' balanced figure
    exactly (stages are uneven; the formula is their mean). Adam's state: the formula
    plus Adam's step counter (4 bytes a tensor). With experts cut over ep: each rank's
    share of them, its router whole, ZeRO sharding them over their copies only."""
    from hybrid_fns import CONFIG, memory_after_a_step

    from parcourse.theory import mesh_bytes

    config = EXPERTS if experts else CONFIG
    results = pool4.run(memory_after_a_step, shape, zero, config).results
    theory = mesh_bytes(config, shape, zero)
    for category in ("params", "grads"):
        mean = sum(m[category] for m, _ in results) / len(results)
        assert mean == theory[category], category
    for memory, _ in results:
        assert memory["grads"] == memory["params"]  # fp32, one gradient per weight
    # Above the formula: Adam's step counter, 4 bytes per tensor it steps (under ZeRO each
    # weight's rows here, with no padding: the replicas' rows add up to the weight's).
    mean_opt = sum(m["optimizer"] for m, _ in results) / len(results)
    tensors = sum(t for _, t in results) / len(results)
    assert mean_opt == theory["optimizer"] + 4 * tensors


def test_what_each_group_reduces_follows_the_model(pool4):
    """Lesson 09's table: the rows follow the model's own choices and groups."""
    from hybrid_fns import reductions

    rows = pool4.run(
        reductions, {"dp": 2, "tp": 2, "pp": 1}, zero=1, max_norm=1.0, sequence_parallel=True
    ).results
    ops = {(r["axis"], r["op"]) for r in rows[3]}
    assert ("dp", "reduce-scatter (mean): a slice each") in ops
    assert ("dp", "all-gather") in ops and ("dp-tp-pp", "all-reduce (sum)") in ops
    assert ("tp", "all-gather") in ops  # sequence parallelism's
    assert not any(axis in ("pp", "embedding") for axis, _ in ops)  # no pipeline
    assert {tuple(r["ranks"]) for r in rows[3] if r["axis"] == "tp"} == {(2, 3)}
    rows = pool4.run(reductions, {"dp": 2, "tp": 1, "pp": 2}).results
    for rank, mine in enumerate(rows):  # megatron order: pp outermost; ranks 0-1, 2-3 a stage
        axes = {r["axis"]: r["ranks"] for r in mine}
        assert axes["pp"] == [rank % 2, rank % 2 + 2] and axes["embedding"] == axes["pp"]
        assert axes["dp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert "tp" not in axes and ("dp", "all-reduce (mean)") in {
            (r["axis"], r["op"]) for r in mine if r["when"] == "finalize 1"
        }


@pytest.mark.parametrize("shape", [{"dp": 2}, {"pp": 2}, {"tp": 2}], ids=["dp", "pp", "tp"])
def test_dropout_masks_differ_across_replicas_and_stages(pools, shape):
    """Each data-parallel replica and each pipeline stage draws its own dropout masks (all
    had been seeded alike: replicas dropped the same positions, stage 1 redrew stage 0's);
    the two ranks of a tp group drop the same elements of a whole activation."""
    (_, first), (_, second) = pools[2].run(dropout_masks, shape).results
    assert first and second
    same = [
        (a, b)
        for a, ma in first
        for b, mb in second
        if ma.shape == mb.shape and torch.equal(ma, mb)
    ]
    if "tp" in shape:  # the residual stream's dropouts are whole on both ranks
        assert any(a == b and "attn_drop" not in a for a, b in same), same
        assert not any("attn_drop" in a for a, _ in same)  # each rank's own heads
    else:
        assert not same, same


def test_a_replicated_weight_unfrozen_after_building_is_refused(pools):
    """The refusal sits on the module that holds the weight, so a pipeline's stages (which
    never run the whole model) meet it: unfrozen after the split, ln_f's gradient would
    be each tp rank's own tokens' part."""
    with pytest.raises(RankError, match="ln_f.weight, ln_f.bias did not require a gradient"):
        pools[2].run(thawed_after_hybrid)
    # over dp: the buckets hold what was trainable when Hybrid was made (each replica
    # would train its own ln_f)
    with pytest.raises(RankError, match="weights were unfrozen after Hybrid was made"):
        pools[2].run(thawed_after_hybrid, {"dp": 2})


@pytest.mark.parametrize("shape", [{"dp": 2, "pp": 2}, {"tp": 2, "pp": 2}], ids=str)
def test_each_axis_keeps_its_colour_in_lesson_09s_figure(pools, shape):
    """The timeline coloured by axis and the bytes each axis sent: one colour per axis
    (plots.AXIS_COLORS), whichever axes the run has; the legend lists only the axes that
    communicated. (pp was blue beside tp and orange beside dp.)"""
    import matplotlib
    from matplotlib.colors import to_rgba

    matplotlib.use("Agg")
    from parcourse.experiments import hybrid as H
    from parcourse.plots import AXIS_COLORS

    run = pools[4].run(H.train_on_mesh, shape, 2, microbatches=2, batch=8, traced=True)
    fig = H.mesh_step_figure(run, "colours")
    seen = {}
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        for handle, text in zip(legend.legend_handles, legend.get_texts()):
            name = text.get_text().removeprefix("axis ")
            if name in AXIS_COLORS:
                seen.setdefault(name, set()).add(tuple(handle.get_facecolor()))
    assert set(seen) == set(shape)
    for axis, colours in seen.items():
        assert colours == {to_rgba(AXIS_COLORS[axis])}, axis


@pytest.mark.parametrize(
    "shape,schedule,microbatches,kwargs",
    [
        ({"cp": 2}, "1f1b", 2, {"config": THIRTEEN_TOKENS}),
        ({"pp": 2, "cp": 2}, "gpipe", 2, {"cp_method": "all-gather", "max_norm": CLIP}),
        ({"dp": 2, "cp": 2}, "1f1b", 2, {"cp_method": "ulysses", "zero": 3}),
        ({"dp": 1, "tp": 2, "pp": 2, "cp": 2}, "1f1b", 2, {}),
        ({"dp": 2, "cp": 4}, "1f1b", 2, {"zero": 1, "config": THIRTEEN_TOKENS}),
    ],
)
def test_3d_with_the_sequence_cut_over_cp_equals_one_process(
    request, shape, schedule, microbatches, kwargs
):
    """Context parallelism as the mesh's cp axis: each rank runs every layer on its tokens
    (zigzag, two chunks a rank), attention over the whole sequence by ring, all-gather or
    Ulysses, the loss weighed by the rank's share, gradients averaged over dp x cp (ZeRO
    sharded over them). One process's weights, losses and clipped norm (TOL: fp32; the
    attention's blocks merge by their log-sum-exp, so its sums run in another order). With
    sequences of 13 tokens the ranks hold 7 and 6 (cp 2), 3, 3, 3 and 4 (cp 4): uneven,
    the loss's weights not 1."""
    world = math.prod(shape.values())
    pool = request.getfixturevalue(f"pool{world}")
    check(
        pool.run(train, shape, schedule, microbatches=microbatches, **kwargs).results,
        kwargs.get("max_norm"),
        kwargs.get("config"),
    )


def test_cli_trains_with_the_sequence_cut_over_cp(capsys):
    """`train3d --cp 2`: the plan's flag, made from its field; the loss is one process's,
    and each rank's keys and values travel on cp (Ulysses' all-to-alls here)."""
    from parcourse.cli import main

    assert (
        main(
            [
                "train3d",
                "--dp",
                "1",
                "--tp",
                "1",
                "--pp",
                "2",
                "--cp",
                "2",
                "--cp-method",
                "ulysses",
                "--steps",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "dp 1 x tp 1 x pp 2 x cp 2 = 4 ranks" in out and "cut over cp (ulysses)" in out
    assert "plan        dp1 tp1 pp2 1f1b m2 cp2 ulysses" in out
    lines = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    for _, ours, one in lines[:2]:
        assert float(ours) == pytest.approx(float(one), rel=1e-4)


def test_cp_over_a_simulated_link_with_stages_equals_one_process(pool4):
    """pp 2 x cp 2 over a simulated link: the pipeline finds its stages' output shapes on
    the meta device, where attention sends nothing (a shape only), and then trains as one
    process does; every message over the link."""
    from parcourse.comm import SimulatedLink

    check(
        pool4.run(train, {"pp": 2, "cp": 2}, "1f1b", link=SimulatedLink.of(latency_us=50)).results
    )


def test_reductions_with_cp_name_the_replicas_and_attentions_traffic(pool4):
    """What each group does, on a dp 2 x cp 2 mesh with ZeRO-1 and clipping: the gradients'
    mean and the slices over dp x cp (the replicas), attention's keys and values over cp,
    and the norm over every axis that splits the gradients."""
    from hybrid_fns import reductions

    rows = pool4.run(
        reductions, {"dp": 2, "cp": 2}, zero=1, max_norm=1.0, cp_method="ulysses"
    ).results[0]
    by = {(r["when"], r["axis"]): r for r in rows}
    assert by["forward", "cp"]["op"] == "all-to-all, to a head cut and back"
    assert by["finalize 1", "dp-cp"]["ranks"] == [0, 1, 2, 3]
    assert by["finalize 2", "dp-cp-tp-pp"]["ranks"] == [0, 1, 2, 3]
    assert by["report", "dp-cp"]["ranks"] == [0, 1, 2, 3]


def test_simulated_compute_with_cp_is_refused(pool2):
    from hybrid_fns import reductions

    from parcourse.pipeline.simulate import SimulatedCompute

    with pytest.raises(RankError, match="cp's messages inside attention would be padded"):
        pool2.run(reductions, {"cp": 2}, compute=SimulatedCompute(forward=0.01, backward=0.02))


# fp32 with experts: Adam divides each gradient by its own root mean square, so an element
# whose gradient is nearly 0 (an expert few tokens chose, qkv's bias) moves by about lr
# whatever its size, and the rounding of that tiny gradient, summed in another order (rows
# dispatched to another rank, two replicas' halves averaged), shows at ~1e-5 after two
# steps. In fp64 the same runs equal one process to ~1e-14 (the test after this one).
EXPERT_TOL = {"rtol": 1e-4, "atol": 5e-5}


@pytest.mark.parametrize(
    "shape,schedule,kwargs,changes",
    [
        ({"ep": 2}, "1f1b", {}, {}),
        ({"dp": 2, "ep": 2}, "1f1b", {"zero": 1}, {"router": "sigmoid", "capacity_factor": 1.0}),
        ({"ep": 2, "pp": 2}, "gpipe", {"max_norm": CLIP}, {}),
        ({"ep": 2, "tp": 2}, "1f1b", {"max_norm": CLIP}, {"bias_rate": 0.01}),
        ({"dp": 2, "ep": 2}, "1f1b", {"zero": 3, "max_norm": CLIP}, {}),
        ({"ep": 4}, "1f1b", {"zero": 2}, {"capacity_factor": 1.25}),
        ({"ep": 2, "pp": 2}, "1f1b", {"recompute": True}, {"bias_rate": 0.01}),
    ],
)
def test_3d_with_experts_cut_over_ep_equals_one_process(request, shape, schedule, kwargs, changes):
    """A GPT with 4 experts of top 2 in every block, the experts cut over ep (tokens
    dispatched to them and combined back by all-to-alls), ep's ranks each with their own
    rows: one process running the same microbatches in turn (the routing, capacity and
    balancing losses are a microbatch's), its weights, losses and clipped norm (TOL), with
    tp (experts whole on each tp rank), pp, ZeRO-1, 2 and 3 (experts sharded over their own
    copies), clipping (each expert's squares counted on the rank holding it) and the
    balancing bias moved from every replica's counts."""
    config = dataclasses.replace(EXPERTS, **changes)
    world = math.prod(shape.values())
    replicas = shape.get("dp", 1) * shape.get("ep", 1)
    pool = request.getfixturevalue(f"pool{world}")
    before, after, losses, norms = one_process_by_microbatch(
        replicas, 2, config, max_norm=kwargs.get("max_norm")
    )
    for got_before, got_after, got_losses, got_norms in pool.run(
        train, shape, schedule, microbatches=2, config=config, **kwargs
    ).results:
        if "max_norm" in kwargs:
            assert got_norms == pytest.approx(norms, rel=1e-5)
        assert got_after.keys() == after.keys()
        for name in after:
            assert torch.equal(got_before[name], before[name]), name
            torch.testing.assert_close(got_after[name], after[name], **EXPERT_TOL, msg=name)
        if got_losses[0] is not None:
            assert got_losses == pytest.approx(losses, rel=1e-5)


@pytest.mark.parametrize(
    "shape,kwargs", [({"ep": 2}, {}), ({"dp": 2, "ep": 2}, {"zero": 2, "max_norm": CLIP})]
)
def test_3d_with_experts_in_fp64_equals_one_process_to_its_rounding(request, shape, kwargs):
    world = math.prod(shape.values())
    pool = request.getfixturevalue(f"pool{world}")
    replicas = shape.get("dp", 1) * shape.get("ep", 1)
    before_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _, after, losses, _ = one_process_by_microbatch(
            replicas, 2, EXPERTS, max_norm=kwargs.get("max_norm")
        )
    finally:
        torch.set_default_dtype(before_dtype)
    for _, got_after, got_losses, _ in pool.run(
        train_fp64, shape, "1f1b", microbatches=2, config=EXPERTS, **kwargs
    ).results:
        if got_losses[0] is not None:
            assert got_losses == pytest.approx(losses, rel=1e-12)
        for name in after:
            assert got_after[name].dtype == torch.float64
            torch.testing.assert_close(
                got_after[name], after[name], rtol=1e-12, atol=1e-12, msg=name
            )


def test_experts_on_eight_ranks_with_every_axis(pool8):
    """dp 2 x ep 2 x pp 2, ZeRO-1, clipped: the experts' copies over dp, the stages over pp."""
    config = EXPERTS
    before, after, losses, norms = one_process_by_microbatch(4, 2, config, max_norm=CLIP)
    for _, got_after, got_losses, got_norms in pool8.run(
        train,
        {"dp": 2, "ep": 2, "pp": 2},
        "1f1b",
        microbatches=2,
        config=config,
        zero=1,
        max_norm=CLIP,
    ).results:
        assert got_norms == pytest.approx(norms, rel=1e-5)
        for name in after:
            torch.testing.assert_close(got_after[name], after[name], **EXPERT_TOL, msg=name)
        if got_losses[0] is not None:
            assert got_losses == pytest.approx(losses, rel=1e-5)


def test_cp_with_experts_equals_one_process(pool4):
    """cp 2 x ep 2: each rank's tokens of a sequence go to their experts; without drops or
    balancing losses a token's MoE output is its own whatever the others (exact
    semantics), so the whole-sequence one process is the reference."""
    config = dataclasses.replace(EXPERTS, aux_loss=0.0, z_loss=0.0)
    before, after, losses, _ = one_process_by_microbatch(2, 2, config)
    for _, got_after, got_losses, _ in pool4.run(
        train, {"ep": 2, "cp": 2}, "1f1b", microbatches=2, config=config
    ).results:
        for name in after:
            torch.testing.assert_close(got_after[name], after[name], **EXPERT_TOL, msg=name)
        if got_losses[0] is not None:
            assert got_losses == pytest.approx(losses, rel=1e-5)


def test_cli_trains_with_experts_cut_over_ep(capsys):
    """`train3d --experts 4 --ep 2`: the loss is one process's (its replicas'
    microbatches in turn), each rank's tokens travel on ep, and what a rank holds is the
    formula's."""
    from parcourse.cli import main

    assert (
        main(
            [
                "train3d",
                "--dp",
                "1",
                "--tp",
                "1",
                "--pp",
                "2",
                "--ep",
                "2",
                "--experts",
                "4",
                "--steps",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "dp 1 x tp 1 x pp 2 x ep 2 = 4 ranks" in out and "4 experts cut over ep" in out
    assert "plan        dp1 tp1 pp2 1f1b m2 ep2" in out
    lines = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    for _, ours, one in lines[:2]:
        assert float(ours) == pytest.approx(float(one), rel=1e-4)
    assert "on ep" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ep", "2"], "ep 2 cuts the experts of MoE layers, and this GPT has none"),
        (["--ep", "4", "--experts", "6", "--dp", "1"], "6 experts do not divide by ep 4"),
        (["--experts", "4", "--top-k", "5"], "top_k must be between 1 and the 4 experts"),
        (["--experts", "4", "--sequence-parallel"], "keeps each expert whole on every tp rank"),
    ],
)
def test_cli_refuses_bad_expert_settings_in_one_line(capsys, argv, message):
    from parcourse.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["train3d", *argv])
    assert stopped.value.code == 2
    said = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(said) == 1 and message in said[0], said


def test_reductions_with_experts_name_ep_and_the_experts_copies(pool4):
    """dp 2 x ep 2: the tokens' all-to-alls over ep, the dense gradients' mean over dp x ep,
    each expert's over dp (the ranks holding the same experts), the norm over tp, pp, ep."""
    from hybrid_fns import reductions

    rows = pool4.run(reductions, {"dp": 2, "ep": 2}, EXPERTS, max_norm=1.0).results[0]
    by = {(r["when"], r["axis"]): r for r in rows}
    assert by["forward", "ep"]["ranks"] == by["backward", "ep"]["ranks"] == [0, 1]
    assert by["finalize 1", "dp-ep"]["ranks"] == [0, 1, 2, 3]
    assert by["finalize 1", "dp"]["ranks"] == [0, 2]
    assert by["finalize 2", "tp-pp-ep"]["ranks"] == [0, 1]


# --- fp16 with loss scaling: torch's ShardedGradScaler over every rank of the mesh

FP16_STEPS = 8


@pytest.mark.parametrize(
    "shape,zero,kwargs",
    [
        ({"dp": 2}, 2, {}),
        ({"dp": 2, "pp": 2}, 1, {}),
        ({"dp": 2, "tp": 2}, 3, {}),
        ({"dp": 2, "tp": 2, "pp": 2}, 2, {"max_norm": CLIP}),
    ],
    ids=["dp2-zero2", "dp2xpp2-zero1", "dp2xtp2-zero3", "dp2xtp2xpp2-zero2-clip"],
)
def test_fp16_in_3d_with_a_sharded_grad_scaler_equals_one_process_with_grad_scaler(
    request, pools, shape, zero, kwargs
):
    """fp16 compute with fp32 masters in ZeRO's slices, stepped through torch's
    ShardedGradScaler over every rank, against one process's loop with a plain
    torch.amp.GradScaler (hybrid_fns.one_process_fp16): the same scale before every step
    (the first steps overflow and are skipped, two good steps grow it), the same steps
    skipped, and an inf planted in one rank's gradient (the last rank's: a tp or pp rank
    whose slices the others never see) skips the step on every rank.

    Where the gradients are added matters in fp16, and the reference adds them where
    the 3D step does: ZeRO-1 adds a replica's microbatches in fp16 (.grad) and reduces
    once; ZeRO-2 and 3 reduce each microbatch and add the slices in fp32 (as FSDP2 adds
    its sharded gradients in the weights' dtype), except the tied embedding across
    stages, which the pipeline adds up in fp16 after the schedule. (Measured: a reference
    adding in the other place overflows at another step, and the scale sequences part.)

    Tolerance: what is left is the order of the sums (tp's split products, the tied
    weight's two stages): each gradient off by at most fp16's eps x |gradient|, an update
    by lr x that; over the steps at most steps x lr x eps x the largest gradient, doubled
    (measured: 2e-5 against a bound of 2e-4). A wrong slice or a step taken on one rank
    only is off by the weights' own size."""
    from hybrid_fns import FP16_LR, one_process_fp16, train_fp16

    world = math.prod(shape.values())
    pool = pools[world] if world in pools else request.getfixturevalue(f"pool{world}")
    reference = {
        "replicas": shape["dp"],
        "add_in": "fp16" if zero == 1 else "fp32",
        "tied": "tok_emb.weight" if shape.get("pp", 1) > 1 and zero > 1 else None,
        "max_norm": kwargs.get("max_norm"),
    }
    plain, scales, largest, losses = one_process_fp16(FP16_STEPS, **reference)
    k = next(i for i in range(1, FP16_STEPS - 1) if scales[i + 1] >= scales[i])  # it steps
    planted = one_process_fp16(FP16_STEPS, plant_step=k, **reference)
    assert planted[1][k + 1] == scales[k + 1] / 2 and scales[0] > scales[-1]
    bound = 2 * FP16_STEPS * FP16_LR * 2**-10 * largest
    for plant, (want, want_scales, _, want_losses) in (
        (None, (plain, scales, largest, losses)),
        ((k, world - 1), planted),
    ):
        run = pool.run(train_fp16, shape, FP16_STEPS, plant, zero=zero, **kwargs)
        skipped = sum(1 for a, b in zip(want_scales, want_scales[1:]) if b < a)
        for weights, got_scales, got_skipped, got_losses in run.results:
            assert got_scales == want_scales, (plant, got_scales, want_scales)
            assert got_skipped == skipped, (plant, got_skipped, skipped)
            for name, value in want.items():
                assert weights[name].dtype == torch.float32, name  # the masters
                off = float((weights[name] - value).abs().max())
                assert off <= bound, (plant, name, off, bound)
            if got_losses[0] is not None:
                assert got_losses == pytest.approx(want_losses, rel=1e-3)  # fp16 logits
        # the masters, not their fp16 copy: most of them fall between fp16's numbers
        w = run.results[0][0]["blocks.0.mlp.up.weight"]
        assert (w.half().float() != w).float().mean() > 0.5


def test_mixed_precision_the_3d_step_cannot_keep_is_refused_in_one_line(pools):
    said = pools[2].run(fp16_refusals).results[0]
    assert len(said) == 3, said
    assert "keeps fp32 masters in ZeRO's slices: add zero=1" in said[0]
    assert "in torch.bfloat16 nothing underflows" in said[1]
    assert "GradScaler finds an inf in this rank's gradients only" in said[2]
    assert "ShardedGradScaler(process_group=" in said[2]


def test_fp16_holds_two_bytes_a_weight_and_sends_half(pool4):
    """ZeRO's 2 + 2 + 12 under fp16 in a pipeline: the weights a stage computes with are
    half fp32's bytes (whole under ZeRO-1, a slice under ZeRO-3); the fp32 masters, this
    rank's slice (half the stage's weights at dp 2), join Adam's state as the
    optimizer's; dp's messages (reduce-scatters and all-gathers) are half fp32's bytes."""
    from hybrid_fns import dp_bytes_by_zero, memory_by_zero

    half = {"compute_dtype": torch.float16}
    for zero in (1, 3):
        fp32, fp16 = (pool4.run(memory_by_zero, zero, **kw).results for kw in ({}, half))
        for full, mixed in zip(fp32, fp16):
            assert 2 * mixed["params"] == full["params"]
            assert mixed["adam"] == full["adam"]
            masters = full["params"] // (2 if zero == 1 else 1)  # this rank's fp32 rows
            assert mixed["optimizer"] == mixed["adam"] + masters
        shape = {"dp": 2, "pp": 2}
        sent32 = pool4.run(dp_bytes_by_zero, shape, zero, 2).results
        sent16 = pool4.run(dp_bytes_by_zero, shape, zero, 2, **half).results
        for (a, *_), (b, *_) in zip(sent32, sent16):
            assert 2 * b == a


def test_fp16_with_a_frozen_weight_trains_the_others(pools):
    """A weight frozen before building stays out of ZeRO's units, in fp32; under fp16
    each forward runs on a 16-bit copy of it (without one the fp32 weight meets fp16
    activations and the step fails): it stays as it was, and the others train."""
    from hybrid_fns import fp16_frozen

    for losses, ((frozen0, frozen1), (up0, up1)) in pools[2].run(fp16_frozen).results:
        assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
        assert frozen1.dtype == torch.float32 and torch.equal(frozen0, frozen1)
        assert not torch.equal(up0, up1)

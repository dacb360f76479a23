"""Hierarchical sharding (HSDP, the mesh's dp_shard axis, `parcourse.zero.part`): ZeRO's slices
cut over dp_shard's ranks and summed across dp's trains the GPT to one process's weights,
in 3D and under ZeRO-1, 2 and 3; its traffic per axis is its formula's.

Tolerance (rtol=1e-4, atol=1e-5, as tests/test_hybrid.py): fp32 on gloo; the slices' sums
run in another order (a reduce-scatter over dp_shard, then an all-reduce over dp) than one
process's, about 1e-7 relative per step, and Adam magnifies a change where a gradient is
near zero: two steps stay below 1e-5.
"""

import pytest
import torch
from hybrid_fns import BATCH, CONFIG, one_process, train

from parcourse import Pool
from parcourse.plan import ParallelPlan

TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module")
def pool8():
    with Pool(8, timeout=300) as pool:
        yield pool


@pytest.fixture(scope="module")
def pool4():
    with Pool(4, timeout=300) as pool:
        yield pool


@pytest.fixture(scope="module")
def reference():
    return one_process()


def check(results, reference):
    before, after, losses, _ = reference
    for got_before, got_after, got_losses, _ in results:
        for name in after:
            assert torch.equal(got_before[name], before[name]), name
            torch.testing.assert_close(got_after[name], after[name], **TOL, msg=name)
        if got_losses[0] is not None:
            assert got_losses == pytest.approx(losses, rel=1e-5)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize(
    "shape",
    [{"dp": 2, "dp_shard": 2, "tp": 2}, {"dp": 2, "dp_shard": 2, "pp": 2}],
    ids=["x tp 2", "x pp 2"],
)
def test_hsdp_in_3d_equals_one_process(pool8, reference, shape, zero):
    """(dp 2 x dp_shard 2) x tp 2 and x pp 2, ZeRO 1-3: every rank's weights after two
    Adam steps are one process's."""
    check(pool8.run(train, shape, zero=zero, microbatches=2).results, reference)


def test_hsdp_with_odd_sizes_and_clipping_equals_one_process(pool8):
    """dp 2 x dp_shard 4 (every weight's rows cut in 4, padded where they do not divide)
    under ZeRO-3 with clipping: the norm sums each slice once (over dp_shard, tp, pp,
    not dp, where the slices are copies)."""
    _, after, _, norms = one_process(max_norm=0.5)
    for _, got_after, _, got_norms in pool8.run(
        train, {"dp": 2, "dp_shard": 4}, zero=3, max_norm=0.5, microbatches=1
    ).results:
        assert got_norms == pytest.approx(norms, rel=1e-5)
        for name in after:
            torch.testing.assert_close(got_after[name], after[name], **TOL, msg=name)


def traffic(ctx, shape, zero):
    """One traced step under HSDP: bytes sent per axis, and the units' padded sizes."""
    from parcourse.data import progressions
    from parcourse.hybrid import Hybrid
    from parcourse.mesh import Mesh
    from parcourse.models import gpt
    from parcourse.trace import bytes_by_axis

    model = Hybrid(
        gpt(CONFIG), Mesh(shape, ctx.group), microbatches=1, zero=zero, tracer=ctx.tracer
    )
    model.step(*progressions(BATCH, CONFIG.block_size, CONFIG.vocab))
    return bytes_by_axis(ctx.tracer.data().counters), [u.padded for u in model.sharded.units]


def test_hsdp_bytes_per_axis_equal_the_formula(pool4):
    """ZeRO-1 on dp 2 x dp_shard 2, one microbatch: each unit of P padded elements (fp32)
    is reduce-scattered over dp_shard's 2 ranks ((S - 1)/S x 4P bytes, the course's ring),
    its slice of P/S all-reduced across dp's 2 (2(R - 1)/R x 4P/S), and the stepped slices
    all-gathered over dp_shard again ((S - 1)/S x 4P): ZeRO-1 over all four ranks would send
    (N - 1)/N x 4P twice, every byte over the slow link between nodes where dp crosses it."""
    S = R = 2
    for sent, units in pool4.run(traffic, {"dp": R, "dp_shard": S}, 1).results:
        P = sum(units)
        assert sent["dp_shard"] == 2 * (S - 1) / S * 4 * P
        assert sent["dp"] == 2 * (R - 1) / R * 4 * P / S


def test_hsdps_rule_in_one_sentence():
    problems = ParallelPlan(dp=2, dp_shard=2).problems(world=4)
    assert problems == [
        "dp_shard 2 cuts ZeRO's slices over its ranks, and this plan has no ZeRO: give a "
        "ZeRO stage (1, 2 or 3), or count its ranks in dp"
    ]
    plan = ParallelPlan(dp=2, dp_shard=2, zero=3)
    assert plan.problems(world=4) == [] and ParallelPlan.parse(plan.label()) == plan
    assert plan.label() == "dp2 tp1 pp1 1f1b m1 dp_shard2 ZeRO-3" and plan.replicas == 4


def test_hsdp_memory_per_rank_beside_the_formula(pool4):
    """Under ZeRO-1 on dp 2 x dp_shard 2 a rank keeps Adam's moments for 1/dp_shard of the
    weights, not 1/4: `theory.mesh_bytes` with the shard's size (`Roles.shard`), plus
    Adam's step counter (4 bytes a tensor it steps)."""
    from hybrid_fns import memory_after_a_step

    from parcourse.theory import mesh_bytes

    shape = {"dp": 2, "dp_shard": 2}
    results = pool4.run(memory_after_a_step, shape, 1).results
    theory = mesh_bytes(CONFIG, shape, 1)
    assert theory["optimizer"] == mesh_bytes(CONFIG, {"dp": 2}, 1)["optimizer"]
    for memory, tensors in results:
        assert memory["params"] == theory["params"]
        assert memory["optimizer"] == theory["optimizer"] + 4 * tensors


def test_the_planner_prices_and_searches_hsdp():
    """On two nodes of H100s the search offers dp_shard (on one node it does not: there is
    no slow link to keep the gathers off); HSDP's data-parallel seconds are ZeRO-3 over
    every rank's less the gathers that cross nodes, bought with memory: each rank keeps
    1/dp_shard of the weights, not 1/dp."""
    from parcourse.planner import Cluster, model, predict_memory, predict_time
    from parcourse.planner.search import plan

    config, two_nodes = model("1.3B", 2048), Cluster.preset("h100", 16)
    assert any(p.choice.dp_shard > 1 for p in plan(config, two_nodes, 64, dtype="bf16").ranked)
    one_node = Cluster.preset("h100", 8)
    assert all(p.choice.dp_shard == 1 for p in plan(config, one_node, 64, dtype="bf16").ranked)
    zero3 = ParallelPlan(dp=16, zero=3, recompute="full")
    hsdp = ParallelPlan(dp=2, dp_shard=8, zero=3, recompute="full")
    t0, t1 = (predict_time(config, c, 64, two_nodes, "bf16") for c in (zero3, hsdp))
    assert t1["dp"] < t0["dp"] and t1["step"] < t0["step"]
    m0, m1 = (predict_memory(config, c, 64, "bf16")[0] for c in (zero3, hsdp))
    assert m1["params"] == 2 * m0["params"] and m1["optimizer"] == 2 * m0["optimizer"]

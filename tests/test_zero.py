"""ZeRO stages 1-3 train to the same weights as one process; state is 1/N per rank.

Tolerance: fp32 on gloo; the sum over ranks' shard gradients is added in another
order than autograd's in one process (rtol=1e-5, atol=1e-6 after five steps).
"""

import pytest
import torch

from parcourse import RankError
import dp_fns as F
import zero_fns as Z

TOL = {"rtol": 1e-5, "atol": 1e-6}
N_PARAMS = 7 * 13 + 13 + 13 * 13 + 13 + 13 * 5 + 5 + 13 * 5 + 5  # Net: 426, odd on purpose


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_same_weights_as_one_process(pools, world_size, stage, opt_name):
    results = pools[world_size].run(Z.train, stage, opt_name, 5, 18).results
    expected = F.reference("plain", opt_name, 5, 18, world_size)
    for rank, (weights, _) in enumerate(results):
        for name in expected:
            torch.testing.assert_close(weights[name], expected[name], **TOL,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_state_is_one_nth_per_rank(pools, world_size, stage):
    results = pools[world_size].run(Z.train, stage, "adam", 1, 8).results
    per_rank = [numel for _, numel in results]
    # Adam: two states per parameter. Each unit is padded to a multiple of N, so
    # a rank holds at most (units x (N-1)) / N extra elements per state.
    assert all(n == per_rank[0] for n in per_rank)
    padded_total = per_rank[0] * world_size
    assert 2 * N_PARAMS <= padded_total <= 2 * (N_PARAMS + 8 * (world_size - 1))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_saved_and_reloaded_optimizer_resumes_identically(pools, stage):
    for uninterrupted, resumed in pools[2].run(Z.resume, stage, 2, 3, 16).results:
        for name in uninterrupted:
            assert torch.equal(uninterrupted[name], resumed[name]), name


def test_bad_arguments(pools):
    def make(ctx, **kwargs):
        from parcourse import zero

        zero.shard(F.Net(**kwargs.pop("net", {})), Z.factory("sgd"), group=ctx.group, **kwargs)

    with pytest.raises(RankError, match="stage must be 1, 2 or 3"):
        pools[2].run(make, stage=4)
    with pytest.raises(RankError, match="tied weights"):
        pools[2].run(make, stage=3, net={"kind": "tied"})
    with pytest.raises(RankError, match="bucket_mb must be > 0"):
        pools[2].run(make, stage=2, bucket_mb=0)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_drop_in_zero_optimizer_matches_one_process(pools, world_size, opt_name):
    results = pools[world_size].run(Z.drop_in, opt_name, 5, 18).results
    expected = F.reference("plain", opt_name, 5, 18, world_size)
    for weights, _ in results:
        for name in expected:
            torch.testing.assert_close(weights[name], expected[name], **TOL)
    if opt_name == "adam":
        # Together the ranks hold Adam's two fp32 states once (not N times): for every
        # parameter but the unused branch's 70, plus a 4-byte step per tensor with state.
        held = [b for _, b in results]
        assert sum(held) == 2 * 4 * (N_PARAMS - 70) + 6 * 4
        assert max(held) < sum(held), "spread over ranks"


def test_owner_assignment_balances_sizes():
    from parcourse.zero.optimizer import assign_owners

    # 100 -> rank 0; 90 -> rank 1; 10 -> rank 1 (90 < 100); 10 -> rank 0 (tie: lower rank)
    assert assign_owners([100, 10, 90, 10], 2) == [0, 1, 1, 0]
    assert assign_owners([5], 3) == [0]


def test_zero_bytes_formula():
    from parcourse.memory import zero_bytes

    n, p = 4, 1000
    assert zero_bytes(p, n, 0) == {"params": 4000, "grads": 4000, "optimizer": 8000}
    assert zero_bytes(p, n, 1) == {"params": 4000, "grads": 4000, "optimizer": 2000}
    assert zero_bytes(p, n, 2) == {"params": 4000, "grads": 1000, "optimizer": 2000}
    assert zero_bytes(p, n, 3) == {"params": 1000, "grads": 1000, "optimizer": 2000}
    mixed = zero_bytes(p, 1, 0, torch.bfloat16)  # the paper's 2 + 2 + 12 = 16 bytes
    assert mixed == {"params": 2000, "grads": 2000, "optimizer": 12000}
    with pytest.raises(ValueError, match="stage must be"):
        zero_bytes(p, n, 4)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_measured_bytes_per_rank_equal_the_formula(pools, stage):
    from parcourse.zero.measure import memory_by_stage

    run = pools[4].run(memory_by_stage, stage, 20_000, bucket_mb=0.01)
    theory = run.results[0]["theory"]
    for rank, sample in run.trace.memory_at("after step").items():
        for category in ("params", "grads", "optimizer"):
            # 1%: units are padded to a multiple of N (a few elements), Adam keeps a
            # 4-byte step per tensor.
            assert sample.bytes[category] == pytest.approx(theory[category], rel=0.01), \
                (rank, category)
    assert set(run.trace.memory_at("peak in backward")) == {0, 1, 2, 3}


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_computes_in_16_bits_with_fp32_masters(pools, stage, dtype):
    results = pools[2].run(Z.mixed, stage, 5, 16, dtype).results
    expected = F.reference("plain", "sgd", 5, 16, 2)
    for weights, losses, seen, masters in results:
        assert seen == [f"torch.{dtype}"], "forward ran on 16-bit weights"
        assert masters == {"torch.float32"}
        assert losses[-1] < losses[0]
        for name in expected:
            assert weights[name].dtype == torch.float32
            # 16-bit forward and backward: bf16 keeps 8 bits of mantissa (fp16 11), so
            # five steps land within about a percent of fp32 training.
            torch.testing.assert_close(weights[name], expected[name], rtol=0.05, atol=0.02)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_bytes_follow_2_2_12(pools, stage):
    from parcourse.zero.measure import memory_by_stage

    run = pools[4].run(memory_by_stage, stage, 20_000, bucket_mb=0.01, mixed_precision="bfloat16")
    theory = run.results[0]["theory"]
    for sample in run.trace.memory_at("after step").values():
        for category in ("params", "grads", "optimizer"):
            assert sample.bytes[category] == pytest.approx(theory[category], rel=0.01), category


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_with_no_sync_equals_one_big_batch(pools, stage):
    four = pools[2].run(Z.accumulate, stage, 4, 32).results
    one = pools[2].run(Z.accumulate, stage, 1, 32).results
    for a, b in zip(four, one):
        for ga, gb in zip(a, b):
            torch.testing.assert_close(ga, gb, **TOL)

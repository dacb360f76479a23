"""Data parallelism trains to the same weights as one process.

Tolerance: fp32 on gloo, where only the order of additions differs (the sum over
ranks' shards vs autograd's sum in one process): a few ulps per step, which
Adam's normalisation can amplify for parameters with tiny gradients, hence
rtol=1e-5, atol=1e-6 after five steps.
"""

import dp_fns as F
import pytest
import torch

from parcourse import RankError
from parcourse.data_parallel import make_buckets

IMPLS = ["naive", "bucketed", "bucketed-no-overlap", "bucketed-ring"]
TOL = {"rtol": 1e-5, "atol": 1e-6}


def assert_same_weights(results, expected):
    for rank, weights in enumerate(results):
        assert weights.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(
                weights[name], expected[name], **TOL, msg=lambda m: f"rank {rank}, {name}: {m}"
            )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_same_weights_as_one_process(pools, world_size, impl, opt_name):
    # batch 18: 9 rows per rank on 2 ranks; 5, 5, 4, 4 on 4 (uneven shards)
    results = pools[world_size].run(F.train, impl, "plain", opt_name, 5, 18).results
    assert_same_weights(results, F.reference("plain", opt_name, 5, 18, world_size))


def test_equal_shards_equal_the_full_batch(pools):
    # With equal shards, the average of shard means is the full-batch mean.
    import torch.nn as nn

    results = pools[4].run(F.train, "bucketed", "plain", "sgd", 3, 16).results
    model = F.Net()
    opt = F.make_optimizer("sgd", model.parameters())
    x, y = F.data(16)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert_same_weights(results, model.state_dict())


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("impl", ["naive", "bucketed"])
@pytest.mark.parametrize("kind", ["frozen", "unused", "partly", "tied"])
def test_frozen_unused_and_tied_parameters(pools, world_size, impl, kind):
    results = pools[world_size].run(F.train, impl, kind, "adam", 4, 16).results
    expected = F.reference(kind, "adam", 4, 16, world_size)
    assert_same_weights(results, expected)
    if kind == "unused":  # never used anywhere: Adam never touched it
        start = F.Net().state_dict()
        assert torch.equal(results[0]["branch.weight"], start["branch.weight"])


@pytest.mark.parametrize("impl", ["naive", "bucketed"])
def test_accumulation_over_four_microsteps_equals_one_big_batch(pools, impl):
    from parcourse.experiments.data_parallel import accumulated_gradients

    accumulated = pools[2].run(accumulated_gradients, impl, 4, batch=32).results
    big = pools[2].run(accumulated_gradients, impl, 1, batch=32).results
    assert len(accumulated) == len(big) == 2
    for a, b in zip(accumulated, big, strict=True):
        assert len(a) == len(b) > 0  # every parameter's gradient, on both sides
        for ga, gb in zip(a, b, strict=True):
            torch.testing.assert_close(ga, gb, **TOL)


@pytest.mark.parametrize("impl", ["naive", "bucketed"])
def test_gradients_equal_torch_ddp(pools, impl):
    for pairs in pools[4].run(F.grads_vs_torch_ddp, impl, 12).results:
        assert sum(ours is None for ours, _ in pairs) == 2, "the unused branch, as in DDP"
        for ours, theirs in pairs:
            if ours is None or theirs is None:
                assert ours is None and theirs is None
            else:
                torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_communication_overlaps_backward_only_when_asked(pools):
    for overlap in (True, False):
        run = pools[2].run(F.traced_step, overlap)
        assert run.results[0] >= 3, "several buckets"
        for rank in range(2):
            backward = run.trace.spans_of(rank=rank, name="backward")[-1]
            comm = [
                s
                for s in run.trace.spans_of(rank=rank, kind="comm")
                if s.start_ns >= backward.start_ns
            ]
            assert len(comm) == run.results[0]
            # launched (a bucket's span is drawn from when the one before it finished)
            started_inside = [s for s in comm if s.meta["launched_ns"] < backward.end_ns]
            # one after another on the link, never stacked
            assert all(a.end_ns <= b.start_ns for a, b in zip(comm, comm[1:]))
            if overlap:
                assert len(started_inside) >= len(comm) - 1, "buckets start during backward"
            else:
                assert not started_inside, "no bucket starts before backward ends"


def test_buckets_follow_reverse_registration_order():
    lin = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    params = list(lin.parameters())  # w0 (40 KB), b0, w1 (4 KB), b1
    buckets = make_buckets(params, bucket_mb=0.01)  # 10.24 KB
    assert [[p.shape for p in b.params] for b in buckets] == [
        [torch.Size([10]), torch.Size([10, 100]), torch.Size([100])],
        [torch.Size([100, 100])],
    ]
    assert buckets[0].buffer.numel() == 10 + 1000 + 100 + 3  # + one used-flag per parameter


def test_bad_arguments_are_refused(pools):
    def make(ctx, **kwargs):
        from parcourse.data_parallel import BucketedDataParallel

        BucketedDataParallel(torch.nn.Linear(2, 2), ctx.group, **kwargs)

    from parcourse.comm import SimulatedLink

    with pytest.raises(RankError, match="bucket_mb must be > 0"):
        pools[2].run(make, bucket_mb=0)
    with pytest.raises(RankError, match="unknown algorithm 'tree'"):
        pools[2].run(make, algorithm="tree")
    with pytest.raises(RankError, match="simulated link needs algorithm='ring'"):
        pools[2].run(make, link=SimulatedLink(0.001))


@pytest.mark.parametrize("impl", ["naive", "bucketed"])
def test_buffers_follow_the_first_rank_as_with_ddp(pools, impl):
    """broadcast_buffers, as DDP's default: each forward after a training forward starts
    from the first rank's BatchNorm statistics, so every rank ends with torch's DDP's
    buffers and evaluates alike (each rank had kept its own)."""
    want = pools[2].run(F.buffers_after_training, "torch").results
    got = pools[2].run(F.buffers_after_training, impl).results
    for (state, out), (want_state, want_out) in zip(got, want):
        for name in want_state:
            torch.testing.assert_close(
                state[name], want_state[name], rtol=1e-5, atol=1e-6, msg=name
            )
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0][1], got[1][1])

"""ZeRO beyond stage 3: ZeRO-Offload, ZeRO-Infinity and ZeRO++.

Offload and Infinity move where the optimizer's side lives, not what it computes: they
train to the same weights as ZeRO without them, bitwise, and so to one process's within
the ZeRO tests' tolerance (fp32 on gloo, rtol=1e-5, atol=1e-6 after five steps: the
ranks' gradients are summed in another order than autograd's). ZeRO++'s hpZ only moves
where backward gathers from: exact too. qwZ and qgZ quantize: their bounds are stated
where they are tested.
"""

import os

import dp_fns as F
import pytest
import torch
import zero_beyond_fns as B

from parcourse import Pool, RankDied, RankError, theory
from parcourse.zero import zeropp

TOL = {"rtol": 1e-5, "atol": 1e-6}
WIDE = 64 * 256 + 256 + 256 * 64 + 64 + 64 * 8 + 8  # B.Wide's parameters


def _same(results, expected, exact=None):
    for rank, weights in enumerate(results):
        for name in expected:
            torch.testing.assert_close(
                weights[name], expected[name], **TOL, msg=lambda m: f"rank {rank}, {name}: {m}"
            )
            if exact is not None:
                assert torch.equal(weights[name], exact[rank][name]), (rank, name)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize(
    "stage,options",
    [
        (1, {"offload_optimizer": "cpu"}),
        (2, {"offload_optimizer": "cpu"}),
        (3, {"offload_optimizer": "cpu"}),
        (3, {"offload_optimizer": "cpu", "offload_params": True}),
    ],
)
def test_offload_trains_as_zero_without_it_and_as_one_process(pools, world_size, stage, options):
    pool = pools[world_size]
    plain = pool.run(B.train, stage, 5, 18).results
    offloaded = pool.run(B.train, stage, 5, 18, **options).results
    _same(offloaded, F.reference("plain", "adam", 5, 18, world_size), exact=plain)


@pytest.mark.parametrize(
    "stage,options", [(1, {}), (2, {}), (3, {}), (2, {"offload_optimizer": "cpu"})]
)
def test_a_fused_optimizer_trains_as_one_process(pools, stage, options):
    """torch's fused optimizers write the parameters without bumping their version
    counters, by which a unit used to notice a step; every optimizer step now marks its
    units. Before that, the weights forward used were never refreshed (off by 0.03)."""
    results = pools[2].run(B.fused, stage, 5, 18, **options).results
    model = F.Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    x, y = F.data(18)
    for _ in range(5):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    _same(results, model.state_dict())


@pytest.mark.parametrize(
    "stage,options",
    [
        (2, {"offload_optimizer": "cpu"}),
        (3, {"offload_optimizer": "cpu", "offload_params": True}),
        (3, {"offload_optimizer": "cpu", "nvme_path": True}),
        (3, {"hpz_partition_size": 2}),
    ],
)
def test_a_real_loop_offloaded_trains_as_one_process(pools, tmp_path, stage, options):
    """The GPT-shaped model with its embedding tied to the head, AdamW with two param
    groups and an LR scheduler, two micro-batches accumulated under no_sync, clipping by
    the global norm and a LayerNorm kept whole: as one process, at 4 ranks."""
    import zero_fns as Z

    if options.get("nvme_path"):
        options = {**options, "nvme_path": str(tmp_path)}
    results = (
        pools[4].run(Z.fsdp2_loop, "gpt", stage, 3, 24, 2, True, True, clip=0.05, **options).results
    )
    expected = Z.one_process("gpt", 3, 24, 4, microsteps=2, clip=0.05)
    for rank, (weights, _) in enumerate(results):
        for name, value in expected.items():
            torch.testing.assert_close(
                weights[name], value, **TOL, msg=lambda m: f"rank {rank}, {name}: {m}"
            )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 3])
def test_infinity_trains_as_zero_without_it(pools, tmp_path, world_size, stage):
    pool = pools[world_size]
    plain = pool.run(B.train, stage, 5, 18).results
    on_disk = pool.run(B.train, stage, 5, 18, path=str(tmp_path)).results
    _same(on_disk, F.reference("plain", "adam", 5, 18, world_size), exact=plain)


@pytest.mark.parametrize(
    "stage,options",
    [
        (1, {"offload_optimizer": "cpu"}),
        (2, {"offload_optimizer": "cpu"}),
        (3, {"offload_optimizer": "cpu"}),
        (3, {"offload_optimizer": "cpu", "offload_params": True}),
        (2, {"offload_optimizer": "nvme"}),
    ],
)
def test_bytes_by_placement_follow_the_formula(pools, tmp_path, stage, options):
    """bf16 compute, Adam, world size 4, right after a step. Every figure is exact but
    Adam's step counters (a 4-byte scalar per parameter tensor, which the formula leaves
    out) and, on disk, the file format's own bytes (under 512 a tensor: torch.save's zip
    record for each of the 6 x 3 tensors, exp_avg, exp_avg_sq and step)."""
    nvme = options.get("offload_optimizer") == "nvme"
    if nvme:
        options = {**options, "nvme_path": str(tmp_path)}
    expected = theory.offload_bytes(
        WIDE, 4, stage, nvme=nvme, offload_params=options.get("offload_params", False)
    )
    for got in pools[4].run(B.placement, stage, "bfloat16", **options).results:
        for where in ("device", "host"):
            for category, value in expected[where].items():
                measured = got[where].get(category, 0)
                counters = (
                    4 * 6 if (category == "optimizer" and where == "host" and not nvme) else 0
                )
                assert measured - counters == value, (where, category, measured, value)
        if nvme:
            assert (
                0 <= got["disk"]["optimizer"] - expected["disk"]["optimizer"] - 4 * 6 < 512 * 6 * 3
            ), got["disk"]
        else:
            assert not got["disk"].get("optimizer")
        device_per_param = sum(got["device"].values()) / WIDE
        assert device_per_param <= 2.0


def test_a_killed_infinity_step_leaves_the_last_state_whole(tmp_path):
    """Two ranks step twice, then die in the third step once its first unit's new state
    is written: the state on disk is still the second step's, every tensor equal."""
    path = str(tmp_path)
    with Pool(2, timeout=60) as pool, pytest.raises(RankDied, match="exited with code 3"):
        pool.run(B.infinity_killed, path, 2)
    from parcourse.zero.infinity import read_state

    for rank in range(2):
        before = torch.load(os.path.join(path, f"before{rank}"), weights_only=True)
        after = read_state(path, rank)
        assert before and before.keys() == after.keys()
        for unit, state in before.items():
            for i, tensors in state.items():
                for key, value in tensors.items():
                    assert torch.equal(value, after[unit][i][key]), (rank, unit, i, key)
        stats = torch.load(os.path.join(path, f"stats{rank}"), weights_only=True)
        assert stats["steps"] == 2 and stats["bytes_written"] > stats["bytes_read"] > 0


def test_infinity_counts_its_disk_traffic_and_saves_its_state(pools, tmp_path):
    """Adam at stage 3, world size 2, three steps: every step after the first reads each
    unit's state once and every step writes it once; state_dict reads it all back."""
    for stats, on_disk, state in pools[2].run(B.infinity_stats, str(tmp_path), 3).results:
        assert stats["steps"] == 3
        assert stats["bytes_written"] == 3 * on_disk
        assert stats["bytes_read"] == 2 * on_disk
        moments = [
            t
            for s in state["optimizer"]["state"].values()
            for k, t in s.items()
            if k in ("exp_avg", "exp_avg_sq")
        ]
        assert moments and on_disk >= sum(t.nbytes for t in moments)


def test_infinity_saves_and_resumes_bitwise(pools, tmp_path):
    for uninterrupted, resumed in pools[2].run(B.infinity_resume, str(tmp_path), 2, 3).results:
        for name in uninterrupted:
            assert torch.equal(uninterrupted[name], resumed[name]), name


@pytest.mark.parametrize("options", [{}, {"hpz_partition_size": 2}])
def test_gathers_started_around_backward_never_leak_old_weights(pools, options):
    """Activation checkpointing runs forward hooks again during backward, and a forward of
    one layer may run between backward and the step: either starts a prefetch of a layer
    whose gradients are already reduced. Before any optimizer step such a gather is
    settled and dropped, so the next forward gathers the new weights: the same losses and
    weights as without them. (Before, the step after used the old weights.)"""
    plain = pools[4].run(B.hazards, "plain", **options).results
    for case in ("recompute", "peek", "zero_false"):
        got = pools[4].run(B.hazards, case, **options).results
        for (losses, weights), (want_losses, want) in zip(got, plain):
            assert losses == want_losses, case
            for name in want:
                torch.testing.assert_close(weights[name], want[name], **TOL, msg=name)


def test_infinity_steps_on_after_a_step_that_raised(pools, tmp_path):
    """A step that raised leaves no half-written step behind to trip the next one."""
    results = pools[2].run(B.infinity_after_a_failed_step, str(tmp_path)).results
    expected = pools[2].run(B.train, 2, 3, 16).results
    for (message, weights), want in zip(results, expected):
        assert "a transient failure" in message
        for name in want:
            assert torch.equal(weights[name], want[name]), name


def test_offload_and_zero_pp_refuse_what_does_not_fit(pools):
    def make(ctx, stage, **options):
        from parcourse import zero

        zero.shard(F.Net(), lambda ps: torch.optim.SGD(ps, lr=0.1), stage, ctx.group, **options)

    cases = [
        ((3,), {"offload_params": True}, "give offload_optimizer='cpu' too"),
        ((2,), {"quantized_weights": True}, "stage 3 only"),
        ((3,), {"hpz_partition_size": 3}, "must divide the group's 4 ranks"),
        ((3,), {"offload_optimizer": "nvme"}, "needs nvme_path"),
        ((3,), {"offload_optimizer": "disk"}, "must be None, 'cpu' or 'nvme'"),
        ((3,), {"nvme_path": "/tmp/x"}, "offload_optimizer is None"),
        ((3,), {"ranks_per_node": 2}, "neither is on"),
    ]
    for args, options, message in cases:
        with pytest.raises(RankError, match=message):
            pools[4].run(make, *args, **options)


# --- ZeRO++


def half_steps(x, block=256):
    """Half a quantization step of each element's block, from the raw values: int8's 127
    levels a side over max|block|, so max|block| / 254 (and fp32's rounding of the
    product, a few parts in 2**24 of it)."""
    rows = torch.nn.functional.pad(x, (0, -x.numel() % block)).view(-1, block)
    most = rows.abs().amax(dim=1, keepdim=True).expand_as(rows).reshape(-1)[: x.numel()]
    return most / 254 * (1 + 2**-20)


def test_quantize_stays_within_its_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-3, 2, 1000)
    q, scales = zeropp.quantize(x)
    back = zeropp.dequantize(q, scales, x.numel())
    assert q.dtype == torch.int8 and scales.numel() == 4  # ceil(1000 / 256) blocks
    bound = half_steps(x)
    assert ((back - x).abs() <= bound).all()
    # The bound is tight: some element comes within a tenth of it.
    assert ((back - x).abs() / bound).max() > 0.9
    torch.testing.assert_close(zeropp.error_bound(x), bound, rtol=1e-4, atol=0)  # the same
    message = zeropp.encode(x)
    assert message.numel() == zeropp.encoded_nbytes(1000) == 4 * 256 + 4 * 4
    torch.testing.assert_close(zeropp.decode(message, 1000)[0], back, rtol=0, atol=0)


@pytest.mark.parametrize("ranks_per_node", [1, 2, 4])
def test_quantized_reduce_scatter_is_the_sum_within_its_bound(pools, ranks_per_node):
    """Four ranks, parts of 1000 values and two flags. Each contribution is quantized
    once where it crosses: the k-1 other ranks of the node send theirs (each element off by
    at most half a step, max|block| / 254, at most m / 254 with m the largest value any
    rank holds), then the N/k - 1 other nodes send their node's sum (at most k m / 254
    each). The flags arrive exact."""
    n, width = 4, 1000
    k = ranks_per_node
    for got, flags, exact, most in pools[4].run(B.quantized_sum, k, width).results:
        bound = ((k - 1) + (n // k - 1) * k) * most / 254 * (1 + 1e-5) + 1e-5
        assert (got - exact).abs().max() <= bound
        if k == n:  # one node: a single all-to-all
            assert (got - exact).abs().max() <= (n - 1) * most / 254 * (1 + 1e-5) + 1e-5
        assert torch.equal(flags, torch.full((2,), 4.0))


ALL = {"quantized_weights": True, "hpz_partition_size": 2, "quantized_gradients": True}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"quantized_weights": True},
        {"hpz_partition_size": 2},
        {"quantized_gradients": True},
        ALL,
    ],
)
def test_bytes_across_nodes_are_the_formulas(pools, options):
    """World size 4 in two nodes of 2, three SGD steps of Wide: the bytes every message
    carried between nodes equal `theory.zero_pp_bytes_across`, to the byte."""
    results = pools[4].run(B.zeropp_step, 3, options).results
    across = sum(r[2] for r in results)
    units = results[0][3]
    expected = theory.zero_pp_bytes_across(
        units,
        4,
        2,
        quantized_weights=options.get("quantized_weights", False),
        hpz="hpz_partition_size" in options,
        quantized_gradients=options.get("quantized_gradients", False),
    )
    assert across == 3 * expected["total"], (across, expected)
    if options == ALL:
        zero3 = theory.zero_pp_bytes_across(units, 4, 2)["total"]
        assert expected["total"] / zero3 < 0.3


def test_hpz_makes_each_node_group_once(pools):
    """A second model with hpZ on the same ranks takes the node group the first made: a
    panel builds one each run on ranks that live on, and each gloo group keeps its
    threads and sockets."""
    assert pools[4].run(B.node_groups_twice).results == [True] * 4


def test_zero_pp_trains_within_its_bounds(pools):
    """hpZ moves where backward gathers from, not what: its weights equal ZeRO-3's.
    qwZ: the weights forward computes with are within half a quantization step of the
    masters (at most max|master| / 254 an element). Together, over five SGD steps of
    Wide, the loss stays within 0.5% of ZeRO-3's at every step (the quantization noise,
    about 0.4% of a block's largest value, does not build up)."""
    base = pools[4].run(B.zeropp_step, 5, {}).results
    hpz = pools[4].run(B.zeropp_step, 5, {"hpz_partition_size": 2}).results
    for b, h in zip(base, hpz):
        assert b[0] == h[0]
        for name in b[1]:
            assert torch.equal(b[1][name], h[1][name]), name
    every = pools[4].run(B.zeropp_step, 5, ALL).results
    plain = plain_sgd_shard_losses(5, 4)
    for rank, (losses, _, _, _, seen, masters) in enumerate(every):
        assert ((seen - masters).abs().reshape(-1) <= half_steps(masters.reshape(-1))).all()
        assert not torch.equal(seen, masters)  # it did quantize
        assert len(losses) == 5
        for got, want in zip(losses, plain[rank], strict=True):
            assert abs(got - want) <= 0.005 * want
    for rank, (base_losses, *_) in enumerate(base):  # ZeRO-3 itself: fp32 rounding apart
        assert base_losses == pytest.approx(plain[rank], rel=1e-5)


def plain_sgd_shard_losses(steps, ranks, lr=0.05, batch=32):
    """Wide trained by plain SGD in one process on the whole batch (the mean of equal
    shards' losses): each rank's shard loss before each step, as the ranks record it."""
    model = B.Wide()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = B.wide_data(batch)
    xs, ys = x.chunk(ranks), y.chunk(ranks)
    out = [[] for _ in range(ranks)]
    for _ in range(steps):
        losses = [torch.nn.functional.mse_loss(model(a), b) for a, b in zip(xs, ys)]
        for r, loss in enumerate(losses):
            out[r].append(loss.item())
        opt.zero_grad()
        (sum(losses) / ranks).backward()
        opt.step()
    return out


def test_quantize_exercise_check(capsys):
    """Lesson 04's exercise: the library's quantizer passes; truncating instead of rounding
    gets one line saying which element is off, by how much, and what was expected."""
    from parcourse.experiments.zero_beyond import check_quantize

    def right(x, block):
        return zeropp.quantize(x, block)

    def truncates(x, block):
        q, scales = zeropp.quantize(x, block)
        rows = torch.zeros(q.numel())
        rows[: x.numel()] = x
        return torch.trunc(rows.view(-1, block) / scales[:, None]).to(torch.int8).view(-1), scales

    assert check_quantize(right)
    assert "correct" in capsys.readouterr().out
    assert not check_quantize(truncates)
    out = capsys.readouterr().out
    assert "more than half a step" in out and "round (not truncate)" in out
    assert not check_quantize(lambda x, block: x)
    assert "expected a pair (q, scales)" in capsys.readouterr().out
    # a right answer spelt otherwise: a list, scales as a column
    assert check_quantize(lambda x, block: list(zeropp.quantize(x, block)))
    assert check_quantize(
        lambda x, block: (zeropp.quantize(x, block)[0], zeropp.quantize(x, block)[1][:, None])
    )
    assert capsys.readouterr().out.count("correct: ") == 2


def test_a_configuration_is_checked_before_any_rank_starts():
    """`zero.check_config`: every rule `from_config` applies, for a world size, without a
    model or a process group, so a lesson or a script refuses a bad key in one line."""
    from parcourse.zero import check_config

    good = {
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 8,
    }
    assert check_config(good, 4).stage == 2
    with pytest.raises(ValueError, match="train_batch_size 8 != .* x 3 ranks = 6"):
        check_config(good, 3)
    with pytest.raises(ValueError, match="unknown key 'zero_optimisation'"):
        check_config({"zero_optimisation": {"stage": 2}}, 4)


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp8_all_gather_halves_bf16_to_the_byte(pools, world_size):
    """One all-gather of each unit of Wide, message by message through the ring: bf16
    sends 2 bytes a value to each of the N - 1 others, FP8 one, plus a 4-byte scale a
    parameter."""
    fp8 = pools[world_size].run(B.fp8_gather, 1, True, torch.bfloat16).results
    bf16 = pools[world_size].run(B.fp8_gather, 1, False, torch.bfloat16).results
    n = world_size
    for (got, sizes, *_), (half, *_) in zip(fp8, bf16):
        for sent, bf16_sent, (part, params) in zip(got, half, sizes):
            assert bf16_sent == (n - 1) * 2 * part
            assert sent == (n - 1) * (part + 4 * params)
            assert sent - (n - 1) * 4 * params == bf16_sent // 2


def test_fp8_all_gather_trains_within_its_bound(pools):
    """Forward computes with the weights as e4m3 holds them: each within 2**-4 of its
    master (half of e4m3's eps of 2**-3), or, below e4m3's smallest normal after the
    shard's scale, half its subnormal spacing (2**-10 / the scale, the scale at least
    448 / max|master|). Five SGD steps of Wide then stay within 2% of plain SGD's loss
    at every step: 2**-4 noise on each weight, not a bias, does not build up."""
    plain = plain_sgd_shard_losses(5, 4)
    for rank, (_, _, seen, masters, losses) in enumerate(
        pools[4].run(B.fp8_gather, 5, True).results
    ):
        floor = 2**-10 * masters.abs().max() / 448
        bound = torch.clamp(masters.abs() * 2**-4, min=floor) * (1 + 1e-6)
        assert ((seen - masters).abs() <= bound).all()
        assert not torch.equal(seen, masters)  # it did round
        for got, want in zip(losses, plain[rank], strict=True):
            assert abs(got - want) <= 0.02 * want, (rank, got, want)


def test_fp8_all_gather_and_int8_weights_are_refused_together(pools):
    with pytest.raises(RankError, match="choose one"):
        pools[2].run(B.fp8_gather_with_int8)

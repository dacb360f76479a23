"""Gradients in fewer bits: communication hooks on the course's bucketed data parallelism.

Tolerances: a hook that changes nothing (torch's plain all-reduce hook, PowerSGD at full
rank) trains to one process's weights as data parallelism does (rtol 1e-5, atol 1e-6, the
order of additions; PowerSGD at full rank adds a QR's rounding, a few ulps of each matrix,
hence atol 1e-5). A hook that does lose bits is held to its format's error: bf16's
average within 2**-8 of the largest gradient a hop (N - 1 hops of the ring, each rounding
the partial sum), FP8 e4m3's within two quantizations of 2**-4 of each block's largest.
"""

import compress_fns as F
import dp_fns
import pytest
import torch
from test_data_parallel import assert_same_weights

from parcourse import RankError
from parcourse.data_parallel import compress as C


@pytest.mark.parametrize("world_size", [2, 4])
def test_torch_allreduce_hook_trains_as_one_process(pools, world_size):
    results = pools[world_size].run(F.hooked, "torch-allreduce", 5, 18).results
    assert_same_weights(results, dp_fns.reference("plain", "adam", 5, 18, world_size))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("algorithm", ["torch", "ring"])
def test_powersgd_at_full_rank_is_the_all_reduce(pools, world_size, algorithm):
    # rank 13 >= every matrix's smaller side, every tensor compressed (rate 0): P's columns
    # span the average's, so P Pᵀ M is M; the error fed back is nothing
    results = (
        pools[world_size]
        .run(
            F.hooked,
            "powersgd",
            5,
            18,
            algorithm=algorithm,
            matrix_approximation_rank=13,
            start_powerSGD_iter=0,
            min_compression_rate=0,
        )
        .results
    )
    expected = dp_fns.reference("plain", "adam", 5, 18, world_size)
    for weights in results:
        for name in expected:
            torch.testing.assert_close(weights[name], expected[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_powersgd_with_unused_parameters(pools, world_size):
    results = (
        pools[world_size]
        .run(
            F.hooked,
            "powersgd",
            4,
            16,
            kind="partly",
            matrix_approximation_rank=13,
            start_powerSGD_iter=0,
            min_compression_rate=0,
        )
        .results
    )
    expected = dp_fns.reference("partly", "adam", 4, 16, world_size)
    for weights in results:
        for name in expected:
            torch.testing.assert_close(weights[name], expected[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size", [2, 4])
def test_powersgd_error_feedback_loses_nothing(pools, world_size):
    # Rank 1 of 9 x 12 and 12 x 5 matrices loses most of each step, but what it misses is
    # carried: the sum of what was applied plus the ranks' mean error equals the sum of
    # the true averages. A bias (1-D) travels whole.
    shapes = [(9, 12), (12, 5), (12,)]
    for applied, exact, error in pools[world_size].run(F.powersgd_feedback, shapes, 6, 1).results:
        assert (applied - exact).abs().max() > 0.1  # rank 1 did lose something a step
        torch.testing.assert_close(applied + error, exact, rtol=0, atol=1e-4)


def test_powersgd_low_rank_is_exact_on_a_low_rank_average(pools):
    # every rank's gradient a multiple of one rank-1 matrix: rank 1 misses nothing
    shapes = [(9, 12), (12, 5)]
    for applied, exact, error in pools[2].run(F.powersgd_feedback, shapes, 3, 1, True).results:
        torch.testing.assert_close(applied, exact, rtol=1e-5, atol=1e-5)  # rounding
        assert error.abs().max() < 1e-4
    state = C.PowerSGDState(None, matrix_approximation_rank=1)
    assert state.rank_for(9, 12) == 1
    assert state.rank_for(3, 3) is None  # 1 x (3 + 3) x 2 >= 9: travels whole, as torch's


def test_ours_with_torch_hooks_matches_torch_ddp(pools):
    # torch's fp16_compress_hook on the course's wrapper: the same rounding as on DDP (its
    # bf16_compress_hook runs only on NCCL)
    for name in ("fp16_compress_hook",):
        ours = pools[2].run(F.ours_with_torch_hook, name, 4, 16).results
        theirs = pools[2].run(F.torch_ddp_with_hook, name, 4, 16).results
        for a, b in zip(ours, theirs):
            for key in b:
                torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", "e4m3", "e5m2"])
def test_wire_bytes_equal_the_formula(pools, world_size, fmt):
    numel = 1000  # not a multiple of 4 x 128: FP8's chunks are padded to whole blocks
    results = pools[world_size].run(F.wire_bytes_measured, fmt, numel).results
    assert sum(r[0] for r in results) == C.wire_bytes(numel, world_size, fmt)
    worst = max(r[1] / r[2] for r in results)
    # relative to the largest gradient: fp32 the order of sums; bf16 / fp16 a rounding a
    # hop; FP8 two quantizations (the sum's scale can only be smaller than the largest's)
    bound = {"fp32": 1e-6, "bf16": world_size * 2**-8, "fp16": world_size * 2**-11}
    bound |= {"e4m3": 2 * 2**-4, "e5m2": 2 * 2**-3}
    assert worst <= bound[fmt], (fmt, worst)
    if fmt in ("bf16", "e4m3"):
        assert worst > 1e-6  # it did round


def test_fp8_wire_is_a_quarter_of_fp32():
    numel = 2**20
    for n in (2, 4, 8):
        ratio = C.wire_bytes(numel, n, "e4m3") / C.wire_bytes(numel, n, "fp32")
        assert ratio == pytest.approx((1 + 4 / 128) / 4, rel=1e-3)
        assert C.wire_bytes(numel, n, "bf16") * 2 == C.wire_bytes(numel, n, "fp32")


# SGD (lr 0.05, momentum 0.9) for 5 steps moves a weight by lr x 13.1 (the momentum's sums)
# x its gradients, so a weight lies within 0.66 x the largest gradient error of fp32's (to
# first order). The Net's gradients stay below 0.5: bf16's error 2 hops x 2**-8 of that,
# FP8's two quantizations of 2**-4 (e4m3) or 2**-3 (e5m2) of it.
NEAR_FP32 = {"bf16": 0.66 * 0.5 * 2 * 2**-8, "e4m3": 0.66 * 0.5 * 2 * 2**-4}
NEAR_FP32["e5m2"] = 2 * NEAR_FP32["e4m3"]


@pytest.mark.parametrize("fmt", ["bf16", "e4m3", "e5m2"])
def test_low_precision_hooks_train_close_to_fp32(pools, fmt):
    results = pools[4].run(F.hooked, fmt, 5, 18, opt_name="sgd").results
    expected = dp_fns.reference("plain", "sgd", 5, 18, 4)
    for weights in results[1:]:  # the same weights on every rank
        for key in weights:
            torch.testing.assert_close(weights[key], results[0][key], rtol=0, atol=0)
    worst = max(float((results[0][k] - expected[k]).abs().max()) for k in expected)
    assert 0 < worst <= NEAR_FP32[fmt], (fmt, worst)


def test_measured_errors_a_step(pools):
    bf16 = pools[2].run(F.measured_errors, "bf16", 3).results[0]
    e4m3 = pools[2].run(F.measured_errors, "e4m3", 3).results[0]
    assert len(bf16) == len(e4m3) == 3
    assert all(0 < e < 2**-7 for e in bf16), bf16
    assert all(0 < e < 2**-3 for e in e4m3), e4m3
    assert sum(e4m3) > sum(bf16)  # 3 bits of mantissa against 8


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("twice", "can only be called once"),
        ("late", "before the first backward"),
        ("no future", "must return a future"),
    ],
)
def test_hook_misuse_is_refused(pools, what, message):
    with pytest.raises(RankError, match=message):
        pools[2].run(F.misuse, what)


def test_bad_states_are_refused():
    with pytest.raises(ValueError, match="fmt must be one of"):
        C.LowPrecision(None, "int4")
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        C.PowerSGDState(None, matrix_approximation_rank=0)

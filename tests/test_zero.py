"""ZeRO stages 1-3 train to the same weights as one process; state is 1/N per rank.

Tolerance: fp32 on gloo; the sum over ranks' shard gradients is added in another
order than autograd's in one process (rtol=1e-5, atol=1e-6 after five steps).
"""

import json
import math

import dp_fns as F
import pytest
import torch
import zero_fns as Z

from parcourse import RankError

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
            torch.testing.assert_close(
                weights[name], expected[name], **TOL, msg=lambda m: f"rank {rank}, {name}: {m}"
            )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_state_is_one_nth_per_rank(pools, world_size, stage):
    results = pools[world_size].run(Z.train, stage, "adam", 1, 8).results
    per_rank = [numel for _, numel in results]
    # Adam: two states per element of the parameters that got a gradient (all but the
    # unused branch's 70), each element on exactly one rank.
    assert sum(per_rank) == 2 * (N_PARAMS - 70)
    # Rows split as evenly as they can: a rank holds ceil(rows / N) rows of each.
    shapes = [(13, 7), (13, 1), (13, 13), (13, 1), (5, 13), (5, 1)]
    most = sum(math.ceil(rows / world_size) * cols for rows, cols in shapes)
    assert max(per_rank) <= 2 * most


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
    with pytest.raises(RankError, match="keep_modules: Linear is not a submodule"):
        pools[2].run(make, stage=3, keep_modules=[torch.nn.Linear(2, 2)])
    with pytest.raises(RankError, match="unknown algorithm"):
        pools[2].run(make, stage=1, algorithm="tree")
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
    from parcourse.theory import zero_bytes

    n, p = 4, 1000
    assert zero_bytes(p, n, 0) == {"params": 4000, "grads": 4000, "optimizer": 8000}
    assert zero_bytes(p, n, 1) == {"params": 4000, "grads": 4000, "optimizer": 2000}
    assert zero_bytes(p, n, 2) == {"params": 4000, "grads": 1000, "optimizer": 2000}
    assert zero_bytes(p, n, 3) == {"params": 1000, "grads": 1000, "optimizer": 2000}
    mixed = zero_bytes(p, 1, 0, torch.bfloat16)  # the paper's 2 + 2 + 12 = 16 bytes
    assert mixed == {"params": 2000, "grads": 2000, "optimizer": 12000}
    # Gradient shards reach the optimizer in fp32, the dtype of its masters.
    assert zero_bytes(p, n, 2, torch.bfloat16) == {"params": 2000, "grads": 1000, "optimizer": 3000}
    with pytest.raises(ValueError, match="stage must be"):
        zero_bytes(p, n, 4)


def check_against_formula(run):
    from parcourse.experiments.zero import measured_over_formula

    for category, (mean, largest) in measured_over_formula(run).items():
        # Mean over ranks within 2%: Adam keeps a 4-byte step per tensor, and gradient
        # shards arrive in a buffer with the padding rows and a used-flag per parameter
        # (tiny buckets of a tiny model here). The largest rank within 5%: each
        # parameter's rows split over 4 ranks as evenly as they can.
        assert mean == pytest.approx(1, rel=0.02), category
        assert largest <= 1.05, category


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_measured_bytes_per_rank_equal_the_formula(pools, stage):
    from parcourse.experiments.zero import memory_by_stage

    run = pools[4].run(memory_by_stage, stage, 20_000, bucket_mb=0.01)
    check_against_formula(run)
    assert set(run.trace.memory_at("peak in backward")) == {0, 1, 2, 3}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_sent_counted_from_messages(pools, world_size, stage):
    """Stages 1 and 2 send what DDP's ring all-reduce sends, 2(N-1)/N x S; stage 3 1.5x."""
    from parcourse.experiments.zero import memory_by_stage
    from parcourse.theory import bytes_sent_per_rank

    run = pools[world_size].run(memory_by_stage, stage, 20_000, bucket_mb=1.0)
    ddp = bytes_sent_per_rank("ring", run.results[0]["params"] * 4, world_size)
    for r in run.results:
        # The buffers carry padding rows (this MLP's 71 rows travel as 4 x 18, or 2 x 36)
        # and one used-flag per parameter: 1.5% more here, 0.002% with 500 rows.
        assert r["bytes_sent"] / ddp == pytest.approx(1.5 if stage == 3 else 1.0, rel=0.02)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_computes_in_16_bits_with_fp32_masters(pools, stage, dtype):
    results = pools[2].run(Z.mixed, stage, 5, 16, dtype).results
    expected = F.reference("plain", "sgd", 5, 16, 2)
    for weights, losses, seen, masters in results:
        assert seen == [f"torch.{dtype}"], "forward ran on 16-bit weights"
        assert masters == {"torch.float32"}
        assert losses[-1] < losses[0]
        start = F.Net().state_dict()
        for name in expected:
            assert weights[name].dtype == torch.float32
            # 16-bit forward and backward: bf16 keeps 8 bits of mantissa, so five steps
            # land within 0.2-0.4% (of how far fp32 training moved each tensor) of fp32
            # training; 2% leaves room, and a learning rate 10% off is caught
            moved = (expected[name] - start[name]).norm()
            off = (weights[name] - expected[name]).norm()
            assert off <= 0.02 * moved, (name, float(off / moved) if moved else off)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_bytes_follow_2_2_12(pools, stage):
    from parcourse.experiments.zero import memory_by_stage

    run = pools[4].run(memory_by_stage, stage, 20_000, bucket_mb=0.01, mixed_precision="bfloat16")
    check_against_formula(run)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_with_no_sync_equals_one_big_batch(pools, stage):
    four = pools[2].run(Z.accumulate, stage, 4, 32).results
    one = pools[2].run(Z.accumulate, stage, 1, 32).results
    assert len(four) == len(one) == 2
    for a, b in zip(four, one, strict=True):
        assert len(a) == len(b) and any(g is not None for g in a)
        for ga, gb in zip(a, b, strict=True):  # a gradient where the other has one
            assert (ga is None) == (gb is None)
            if ga is not None:
                torch.testing.assert_close(ga, gb, **TOL)


# --- real training loops: param groups, accumulation, a plain optimizer, tied weights

LOOP_TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32; only the order of the sums over ranks differs


@pytest.fixture(scope="module")
def pool3():
    from parcourse import Pool

    with Pool(3, timeout=60) as pool:
        yield pool


def assert_same_weights(results, expected):
    for rank, (weights, *_) in enumerate(results):
        for name in expected:
            torch.testing.assert_close(
                weights[name], expected[name], **LOOP_TOL, msg=lambda m: f"rank {rank}, {name}: {m}"
            )


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_optimizer_keeps_param_groups(pools, world_size):
    """Two AdamW groups (decay and lr differ) and a scheduler halving every lr."""
    results = pools[world_size].run(Z.groups_drop_in, 3, 24).results
    assert_same_weights(results, Z.one_process("plain", 3, 24, world_size))
    for _, hyper in results:  # saved and loaded with the state, as the scheduler left them
        assert hyper == [(0.02 / 8, 0.1), (0.005 / 8, 0.0)]


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero_optimizer_trains_a_group_added_later(pools, world_size):
    """add_param_group, as torch's: the added group is trained at its own lr (it had been
    left out of every rank's optimizer and never moved)."""
    want = Z.added_group(None, 24)
    for got in pools[world_size].run(Z.added_group, 24).results:
        assert not torch.equal(got["out.weight"], Z.Net().state_dict()["out.weight"])
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["plain", "gpt"])
def test_plain_optimizer_over_model_parameters(pools, pool3, kind, world_size, stage):
    """FSDP2's loop: model = ZeroModel(net), opt = AdamW(groups of model.named_parameters()).
    "gpt" ties the embedding to the head; 3 ranks split no row count evenly."""
    pool = pool3 if world_size == 3 else pools[world_size]
    results = pool.run(Z.fsdp2_loop, kind, stage, 3, 24).results
    assert_same_weights(results, Z.one_process(kind, 3, 24, world_size))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_torch_collectives_train_alike(pools, stage):
    """algorithm="torch" (what NCCL runs): torch.distributed's reduce-scatter and
    all-gather instead of the course's ring; same weights as one process."""
    results = pools[2].run(Z.fsdp2_loop, "gpt", stage, 3, 24, algorithm="torch").results
    assert_same_weights(results, Z.one_process("gpt", 3, 24, 2))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("microsteps", [2, 3])
@pytest.mark.parametrize("no_sync", [False, True])
def test_accumulation_over_backward_passes(pools, world_size, stage, microsteps, no_sync):
    """Several backward passes before one step, synchronised each time or only the last."""
    results = (
        pools[world_size].run(Z.fsdp2_loop, "plain", stage, 2, 24, microsteps, no_sync).results
    )
    assert_same_weights(results, Z.one_process("plain", 2, 24, world_size, microsteps))


@pytest.mark.parametrize("world_size", [2, 4])
def test_kept_modules_stay_whole_and_fp32(pools, world_size):
    """keep_modules=[ln] at stage 3: exact in fp32; under bf16 the LayerNorm stays fp32."""
    exact = pools[world_size].run(Z.fsdp2_loop, "gpt", 3, 3, 24, keep_ln=True).results
    expected = Z.one_process("gpt", 3, 24, world_size)
    assert_same_weights(exact, expected)
    mixed = (
        pools[world_size]
        .run(Z.fsdp2_loop, "gpt", 3, 3, 24, keep_ln=True, mixed_precision="bfloat16")
        .results
    )
    for weights, ln_dtype in mixed:
        assert ln_dtype == "torch.float32"
        for name in expected:
            # AdamW moves an element by about lr per step whatever its gradient's size, so
            # where bf16 flips the sign of a tiny gradient the element can end up 2 x lr
            # away per step (3 steps, lr 0.02). On average the weights stay close.
            diff = (weights[name] - expected[name]).abs()
            assert diff.max() <= 3 * 2 * 0.02 and diff.mean() <= 0.005, name


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clip_grad_norm_over_every_rank(pools, world_size, stage):
    """model.clip_grad_norm_ clips by the norm over the whole model, as torch's over one
    process (tied embedding counted once, the kept LayerNorm's replicated grads once)."""
    results = (
        pools[world_size].run(Z.fsdp2_loop, "gpt", stage, 3, 24, keep_ln=True, clip=0.05).results
    )
    assert_same_weights(results, Z.one_process("gpt", 3, 24, world_size, clip=0.05))


@pytest.mark.parametrize("stage", [1, 3])
def test_clip_grad_norm_by_the_largest_gradient(pools, stage):
    """norm_type=inf: the largest |gradient| over every rank, shards and kept parameters,
    as torch's inf norm over one process (it had taken 0 ** 0: a norm of 1, whatever the
    gradients). 0.01 clips: the largest gradient is about 0.09."""
    results = (
        pools[4]
        .run(Z.fsdp2_loop, "gpt", stage, 3, 24, keep_ln=True, clip=0.01, norm_type=float("inf"))
        .results
    )
    assert_same_weights(results, Z.one_process("gpt", 3, 24, 4, clip=0.01, norm_type=float("inf")))


def test_a_load_after_a_forward_is_what_the_next_forward_uses(pools):
    """A prefetch still in flight at load_full_state_dict (started by a forward before it,
    for a unit that forward never used) had given the next forward the old weights."""
    assert pools[2].run(Z.load_after_a_forward).results == [0.0, 0.0]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_state_of_other_keys_or_shapes_is_refused(pools, stage):
    """Strict, as torch's load_state_dict: a key the model lacks, or a weight of another
    shape (copy_ broadcasts, and a flat unit takes any shape of the same size)."""
    extra = pools[2].run(Z.load_refused, stage, "extra").results[0]
    assert extra == "KeyError: \"the model has no ['extra.weight']\"", extra
    shape = pools[2].run(Z.load_refused, stage, "shape").results[0]
    assert shape.startswith("ValueError: shapes differ from the model's: ") and " for " in shape


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_kept_modules_some_ranks_did_not_use(pools, stage):
    """Each rank runs one of two kept LayerNorms (a branch chosen by its data): their
    gradients are all-reduced in one layout with a used-flag each, as the shards' are
    (each rank had sent only those it had, so ln_a's summed with ln_b's)."""
    want = Z.kept_branches(None, stage, 16, world_size=2)
    for got in pools[2].run(Z.kept_branches, stage, 16).results:
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_module_called_itself_after_a_step_has_the_new_weights(pools, stage):
    """As with FSDP2, the module may be called itself: at stages 1-2 the gather of the
    stepped rows had hung on the wrapper, so the module computed with this rank's new
    rows beside the others' old ones (and differed from rank to rank)."""
    results = pools[2].run(Z.module_called_itself, stage).results
    for itself, wrapped in results:
        assert torch.equal(itself, wrapped)
    assert torch.equal(results[0][0], results[1][0])


@pytest.mark.parametrize("how", ["shards 1", "shards 2", "shards 3", "module 3"])
def test_a_layer_frozen_midway_stops_training(pools, how):
    """Freezing a layer after two steps, through the wrapper's named_parameters() (the
    shards) or the module's own parameters: the layer stops, the rest trains on, as in
    one process (a frozen shard had gone on training from its module parameter's
    gradient)."""
    want = Z.frozen_midway(None, how)
    for got in pools[2].run(Z.frozen_midway, how).results:
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["ddp", "zero"])
def test_a_layer_unfrozen_after_wrapping_is_refused(pools, kind):
    """Frozen parameters are in no bucket or shard; unfrozen later, each rank would train
    its own copy. The next forward raises, naming them."""
    with pytest.raises(
        RankError,
        match="inp.weight, inp.bias did not require a gradient when the model was wrapped",
    ):
        pools[2].run(Z.thawed_after_wrapping, kind)


@pytest.mark.parametrize("kind", ["ddp", "zero"])
def test_wrapping_again_after_unfreezing_works(pools, kind):
    """What the refusal says to do: drop the wrapper, unfreeze, wrap again. The dropped
    wrapper's hooks on the module go with it (held strongly, they had kept it alive,
    refusing and syncing on the new one's forwards)."""
    first, second = pools[2].run(Z.rewrapped_after_unfreezing, kind).results
    assert (first is second is None) if kind == "zero" else torch.equal(first, second)


def test_a_dropped_model_is_freed(pools):
    """A wrapper dropped after training is freed, as torch's are. Its gradient hooks had
    held it through a list the garbage collector cannot see, so a pool's ranks, which
    live on between a panel's runs, kept every model, optimizer state and thread."""
    for freed in pools[2].run(Z.dropped_models_are_freed).results:
        assert freed == dict.fromkeys(freed, True) and len(freed) == 5, freed


@pytest.mark.parametrize("stage", [1, 3])
def test_state_dict_points_to_full_state_dict(pools, stage):
    # The module's own tensors are gathered copies (freed at stage 3): saving them would
    # save the wrong weights, or read freed memory.
    with pytest.raises(RankError, match="full_state_dict"):
        pools[2].run(Z.state_dict_refused, stage)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_over_the_unsharded_module_raises(pools, stage):
    with pytest.raises(RankError, match="Build the optimizer from the sharded model"):
        pools[2].run(Z.optimizer_before_sharding, stage)


# --- the lessons' exercises: their checks reject wrong answers


def test_rows_exercise_check(capsys):
    from parcourse.experiments.zero import check_rows

    def right(param, rank, n):
        c = math.ceil(param.shape[0] / n)
        return param[rank * c : (rank + 1) * c]

    def floor_division(param, rank, n):  # loses the last rows when N does not divide them
        c = param.shape[0] // n
        return param[rank * c : (rank + 1) * c]

    def stub(param, rank, n):
        raise NotImplementedError

    assert check_rows(right)
    assert not check_rows(floor_division)
    assert "should keep rows 0..6" in capsys.readouterr().out
    assert not check_rows(lambda param, rank, n: right(param, rank, n).clone())  # asked: a view
    assert "the rows are right, but a copy" in capsys.readouterr().out
    assert not check_rows(stub)
    assert "Not written yet" in capsys.readouterr().out
    assert not check_rows(lambda param, rank, n: param.rows)  # a bug: one line, no traceback
    assert (
        "raised AttributeError: 'Tensor' object has no attribute 'rows'" in capsys.readouterr().out
    )


def test_unpack_exercise_check(capsys):
    from parcourse.experiments.zero import check_unpack

    def right(parts, shapes, n):
        params, offset = [], 0
        for shape in shapes:
            rows, rest = shape[0], math.prod(shape[1:])
            c = math.ceil(rows / n)
            params.append(parts[:, offset : offset + c * rest].reshape(n * c, *shape[1:])[:rows])
            offset += c * rest
        return params

    def ignores_padding(parts, shapes, n):  # reads the parts as if nothing were padded
        flat, out, offset = parts.reshape(-1), [], 0
        for shape in shapes:
            out.append(flat[offset : offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
        return out

    assert check_unpack(right)
    assert not check_unpack(ignores_padding)
    out = capsys.readouterr().out
    assert "Not quite" in out and "Hint" in out and "Traceback" not in out
    assert not check_unpack(lambda parts, shapes, n: parts.view(-1, 5))
    assert "your function raised RuntimeError" in capsys.readouterr().out

    def forgets_return(parts, shapes, n):
        right(parts, shapes, n)

    assert not check_unpack(forgets_return)
    assert capsys.readouterr().out == (
        "Not quite: expected a list of tensors, one per parameter, got NoneType (is a return "
        "missing?).\n"
    )
    assert check_unpack(lambda parts, shapes, n: tuple(right(parts, shapes, n)))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_mixed_precision_masters_are_the_given_weights_bitwise(pools, world_size):
    """Mixed precision's contract: the fp32 masters are the user's weights, exactly; the
    16-bit copy is what forward computes with, never where the masters come from."""
    from parcourse import Pool

    pool = pools.get(world_size) or Pool(world_size, timeout=60)
    try:
        results = pool.run(Z.masters_at_start).results
    finally:
        if world_size not in pools:
            pool.close()
    for per_rank in results:
        for stage, dtype, given, state in per_rank:
            for name, value in given.items():
                assert state[name].dtype == torch.float32, (stage, dtype, name)
                assert torch.equal(state[name], value), (stage, dtype, name)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_mixed_precision_step_is_the_16_bit_reference(pools, stage, dtype):
    """After one SGD step the masters equal the reference (fp32 masters, 16-bit forward
    and backward, fp32 update) but for one rounding: ZeRO adds the ranks' gradients in 16
    bits before the fp32 update, which moves an element by at most lr x eps/2 x |gradient|
    (taken as lr x eps x |gradient|), plus fp32's own rounding of the update (2**-23 x
    |weight|). The old defect (masters rounded to 16 bits when the model was built) was
    off by up to half a 16-bit spacing of the weight itself, far more."""
    results = pools[2].run(Z.mixed_one_step, stage, dtype).results
    expected, grads = Z.mixed_reference(dtype, 2)
    eps = torch.finfo(getattr(torch, dtype)).eps
    for state in results:
        for name, value in expected.items():
            bound = 0.1 * eps * grads[name].abs() + 2**-23 * value.abs()
            assert ((state[name] - value).abs() <= bound).all(), name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_layer_frozen_before_wrapping_runs_in_16_bits_and_exports_in_32(pools, stage):
    """Mixed precision with a layer frozen before sharding (fine-tuning's usual start), as
    fully_shard runs it: the frozen layer's forward sees bf16 weights, the module keeps
    them in fp32, one step equals the 16-bit reference (the frozen weights exactly as
    they were) and a reload's new frozen weights are what the next forward uses."""
    results = pools[2].run(Z.mixed_one_step_frozen, stage, "bfloat16").results
    expected, grads = Z.mixed_reference("bfloat16", 2, kind="frozen")
    eps = torch.finfo(torch.bfloat16).eps
    for seen, kept, state, doubled, x, out in results:
        assert seen == ["torch.bfloat16", "torch.bfloat16"] and kept == {"torch.float32"}
        for name, value in expected.items():
            assert state[name].dtype == torch.float32, name
            bound = 0.1 * eps * grads[name].abs() + 2**-23 * value.abs()
            assert ((state[name] - value).abs() <= bound).all(), name
        assert torch.equal(state["hidden.weight"], expected["hidden.weight"])
        half = Z.Net("frozen").to(torch.bfloat16)
        half.load_state_dict({k: v.to(torch.bfloat16) for k, v in doubled.items()})
        with torch.no_grad():
            assert torch.equal(out, half(x.to(torch.bfloat16)).float())


# --- a DeepSpeed configuration

DS_CONFIG = {
    "zero_optimization": {
        "stage": 2,
        "reduce_bucket_size": 2000,
        "allgather_bucket_size": 2000,
        "overlap_comm": True,
    },
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.999]}},
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "train_batch_size": "auto",
    "gradient_clipping": 0.05,
}


BEYOND = {
    "offload": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "infinity": {
        "offload_optimizer": {"device": "nvme", "nvme_path": "{tmp}"},
        "offload_param": {"device": "cpu"},
    },
    "zero++": {"zero_hpz_partition_size": 2},
}


@pytest.mark.parametrize(
    "stage,beyond",
    [(1, None), (2, None), (3, None), (2, "offload"), (3, "infinity"), (3, "zero++")],
)
def test_a_ds_config_trains_as_one_process_with_the_same_settings(pools, tmp_path, stage, beyond):
    """DeepSpeed's loop (backward per micro-batch, step at the accumulation boundary,
    clipping by the global norm) on 2 ranks x 2 micro-batches of 4 equals one process
    stepping on the 16 rows with clip_grad_norm_ (0.05 clips: the norm is above it).
    Offload and Infinity change where the optimizer's side lives, not the numbers (ZeRO++'s
    quantizing options are tested against their bounds in test_zero_beyond.py)."""
    extra = json.loads(json.dumps(BEYOND.get(beyond, {})).replace("{tmp}", str(tmp_path)))
    config = {
        **DS_CONFIG,
        "zero_optimization": {**DS_CONFIG["zero_optimization"], "stage": stage, **extra},
    }
    from dp_fns import Net, data

    results = pools[2].run(Z.from_config_train, config, 3, 16).results
    model = Net()
    # An offloaded optimizer is built fused (its update runs on the host): so is this one.
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=beyond in ("offload", "infinity"))
    x, y = data(16)
    norms = []
    for _ in range(3):
        torch.nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    assert min(norms) > 0.05
    for state in results:
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, **LOOP_TOL, msg=name)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"steps_per_print": 10}, "unknown key 'steps_per_print'; supported: zero_optimization"),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "cpu", "buffer_count": 4},
                }
            },
            "'buffer_count' asks for DeepSpeed's count of NVMe swap buffers",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
            "needs its nvme_path",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            "is not built here",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "offload_param is stage 3's",
        ),
        (
            {"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}},
            "ZeRO\\+\\+ .* is stage 3's",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}},
            "must be 'none', 'cpu' or 'nvme'",
        ),
        ({"train_batch_size": 32}, r"train_batch_size 32 != .* 4 x .* 2 x 2 ranks = 16"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "only you know it"),
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "choose one"),
        ({"zero_optimization": {"stage": 0}}, "plain data parallelism"),
    ],
)
def test_a_ds_config_refuses_what_it_does_not_build_by_name(pools, change, message):
    import re

    got = pools[2].run(Z.from_config_error, {**DS_CONFIG, **change}).results[0]
    assert got is not None and re.search(message, got), got


@pytest.mark.parametrize("rows", [8, 7])
def test_offloaded_optimizer_state_is_refused_in_another_rank(pools, rows):
    """`from_config` with `offload_optimizer: cpu` handed back a bare torch optimizer: the
    other rank's state loaded without a word (8 rows: shards alike in shape, trains wrong)
    or aborted the rank (7 rows: "double free or corruption"). Now its state says whose
    shard it is, and another rank's is refused in one line."""
    said = pools[2].run(Z.offloaded_state_in_the_other_rank, rows).results
    assert said[0] == (
        "this optimizer state holds (stage, rank, world_size) = (2, 1, 2), "
        "this rank's optimizer is (2, 0, 2)"
    )
    assert said[1].startswith("this optimizer state holds (stage, rank, world_size) = (2, 0, 2)")


STEPS_FP16 = 8


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_with_sharded_grad_scaler_equals_one_process_with_grad_scaler(
    pools, world_size, stage
):
    """fp16 compute under ZeRO stepped through torch's ShardedGradScaler, against one
    process's loop with a plain torch.amp.GradScaler (Z.fp16_scaled_reference): the same
    scale before every step (the first steps overflow and are skipped, two good steps
    grow it), and an inf planted in one rank's gradient rows after backward skips the
    step on every rank, as an inf anywhere in one process does.

    Tolerance: at 2 ranks none (an fp16 sum of two is the same either way round, and
    nothing else differs). At 4, ZeRO's ring adds the ranks' fp16 gradients in another
    order than the reference: each sum is off by at most fp16's eps x |gradient|, an
    update by lr x that; over the steps at most steps x lr x eps x the largest gradient,
    doubled (measured: 6e-6 against a bound of 1.6e-4)."""
    plain, scales, largest = Z.fp16_scaled_reference(STEPS_FP16, world_size)
    k = _a_step_that_steps(scales)
    planted, planted_scales, _ = Z.fp16_scaled_reference(STEPS_FP16, world_size, plant_step=k)
    assert planted_scales[k + 1] == scales[k + 1] / 2 and scales[0] > scales[-1]
    bound = _fp16_bound(world_size, largest)
    for plant, expected, expected_scales in (
        (None, plain, scales),
        ((k, world_size - 1), planted, planted_scales),
    ):
        run = pools[world_size].run(Z.fp16_scaled, stage, STEPS_FP16, "sharded", plant)
        for weights, got_scales in run.results:
            _assert_fp16_run(weights, got_scales, expected, expected_scales, bound, plant)


def _a_step_that_steps(scales):
    """Where to plant an inf: a step that would have stepped (its scale not backed off)."""
    return next(i for i in range(1, STEPS_FP16 - 1) if scales[i + 1] >= scales[i])


def _fp16_bound(world_size, largest):
    """The tolerance the fp16 tests state: none at 2 ranks, at more STEPS_FP16 x lr (0.1)
    x fp16's eps x the largest gradient, doubled."""
    return 0.0 if world_size == 2 else 2 * STEPS_FP16 * 0.1 * 2**-10 * largest


def _assert_fp16_run(weights, got_scales, expected, expected_scales, bound, plant):
    assert got_scales == expected_scales, (plant, got_scales, expected_scales)
    for name, value in expected.items():
        off = float((weights[name] - value).abs().max())
        assert off <= bound, (plant, name, off, bound)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_plain_grad_scaler_that_skips_on_one_rank_only_is_an_error(pools, stage):
    """torch.amp.GradScaler looks at this rank's gradient rows only: an inf in one rank's
    rows skips the step there and steps the others, and the shards stop belonging to one
    model. The next forward says so and names ShardedGradScaler."""
    with pytest.raises(RankError, match=r"stepped on 1 of 2 ranks.*ShardedGradScaler"):
        pools[2].run(Z.fp16_scaled, stage, 5, "plain", (3, 1))


def test_the_loss_scale_follows_deepspeeds_rules_by_hand():
    """DeepSpeed's DynamicLossScaler.update_scale, worked by hand: hysteresis 2 lets one
    overflow pass (the step is still skipped) and halves at the second; the scale doubles
    once `window` steps have passed since the last overflow without one (here 2), and the
    hysteresis is refilled then; never below min_loss_scale, and an overflow there is an
    error; a static scale never moves and an overflow under it is an error."""
    from parcourse.zero import LossScale

    s = LossScale(scale=2.0**4, window=2, hysteresis=2, min_scale=2.0)
    seen = []
    for overflow in [True, True, False, False, False, True, True, True]:
        s.update(overflow)
        seen.append((s.scale, s.hysteresis_left))
    assert seen == [
        (16.0, 1),  # one overflow passes: hysteresis 2 -> 1
        (8.0, 1),  # the second halves
        (8.0, 1),  # stable 0
        (8.0, 1),  # stable 1
        (16.0, 2),  # stable 2 = window: doubled, hysteresis refilled
        (16.0, 1),
        (8.0, 1),
        (4.0, 1),
    ]
    low = LossScale(scale=2.0, hysteresis=1, min_scale=2.0)
    with pytest.raises(FloatingPointError, match="smallest loss scale"):
        low.update(True)
    fixed = LossScale(scale=128.0, dynamic=False)
    fixed.update(False)
    assert fixed.scale == 128.0
    with pytest.raises(FloatingPointError, match="static loss scale 128"):
        fixed.update(True)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"enabled": True, "loss_scale": -1}, "fp16.loss_scale must be 0"),
        ({"enabled": True, "initial_scale_power": 100}, "initial_scale_power must be"),
        ({"enabled": True, "loss_scale_window": 0}, "window must be a whole number"),
        ({"enabled": True, "fp16_master_weights_and_grads": True}, "unknown key fp16"),
        ({"enabled": "auto"}, "fp16.enabled 'auto'"),
    ],
)
def test_a_bad_fp16_section_is_refused_in_one_line(section, message):
    with pytest.raises(ValueError, match=message):
        from parcourse.zero import check_config

        check_config({"zero_optimization": {"stage": 2}, "fp16": section}, 2)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 3])
def test_the_engines_fp16_equals_one_process_with_grad_scaler(pools, world_size, stage):
    """from_config's fp16 section (initial_scale_power 20, loss_scale_window 1,
    hysteresis 1) against one process (Z.fp16_scaled_reference, tolerance as in the
    ShardedGradScaler test above). Unplanted, every growth here is followed by an
    overflow, where DeepSpeed's rules and torch's GradScaler(growth_interval=2) agree:
    the engine equals the loop with GradScaler. With an inf planted in one rank's rows
    (skipped on every rank, and counted) two growths come in a row, where the two differ
    (DeepSpeed doubles again one step later; GradScaler waits two): the engine equals the
    loop with DeepSpeed's rules (Z.DeepSpeedRules)."""
    plain, scales, largest = Z.fp16_scaled_reference(STEPS_FP16, world_size)
    k = _a_step_that_steps(scales)
    rules = Z.DeepSpeedRules(scale=2.0**20, window=1, hysteresis=1)
    planted, planted_scales, _ = Z.fp16_scaled_reference(
        STEPS_FP16, world_size, plant_step=k, scaling=rules
    )
    bound = _fp16_bound(world_size, largest)
    for plant, expected, expected_scales in (
        (None, plain, scales),
        ((k, world_size - 1), planted, planted_scales),
    ):
        run = pools[world_size].run(Z.fp16_engine, stage, STEPS_FP16, plant)
        skipped = sum(1 for a, b in zip(expected_scales, expected_scales[1:]) if b < a)
        for weights, got_scales, got_skipped in run.results:
            assert got_skipped == skipped, (plant, got_skipped, skipped)
            _assert_fp16_run(weights, got_scales, expected, expected_scales, bound, plant)


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_without_a_scaler_trains_as_a_16_bit_reference(pools, stage):
    """What a course's FSDP suite checks in fp16 (no loss scaler: its gradients are far
    above fp16's smallest number): ZeRO with fp16 compute and fp32 norms, 2 ranks on
    half the batch each, against one process computing in fp16 on the whole batch, after
    each of 3 SGD steps, within the suite's own tolerance (atol = rtol = 1e-4). The
    difference is where fp16 rounds: ZeRO rounds each half's gradient and their sum,
    the reference the whole batch's, about eps x |gradient| (1e-3 relative) times lr."""
    expected = Z.fp16_unscaled_reference(3)
    for after in pools[2].run(Z.fp16_unscaled, stage, 3).results:
        for step, (got, want) in enumerate(zip(after, expected)):
            for name, value in want.items():
                assert torch.allclose(got[name], value, atol=1e-4, rtol=1e-4), (
                    step,
                    name,
                    float((got[name] - value).abs().max()),
                )


def test_the_engines_fp16_unscales_before_it_clips(pools):
    """gradient_clipping under fp16: the engine divides the gradients by the scale, then
    clips them by the global norm, as torch's loop does with GradScaler.unscale_ before
    clip_grad_norm_ (0.05 is below every step's norm here: each step clips)."""
    expected, scales, largest = Z.fp16_scaled_reference(STEPS_FP16, 2, max_norm=0.05)
    unclipped, _, _ = Z.fp16_scaled_reference(STEPS_FP16, 2)
    moved = max(float((expected[k] - unclipped[k]).abs().max()) for k in expected)
    assert moved > 1e-3, "the clip changed nothing: choose a smaller max_norm"
    for weights, got_scales, _ in pools[2].run(Z.fp16_engine, 3, STEPS_FP16, None, 0.05).results:
        assert got_scales == scales
        for name, value in expected.items():
            # fp32's own rounding of the norm and of the clipped update, over the steps
            assert torch.allclose(weights[name], value, rtol=1e-5, atol=1e-6), name

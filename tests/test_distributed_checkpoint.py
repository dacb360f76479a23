"""Distributed checkpoints (parcourse.checkpoint): a run saved midway on one mesh and
resumed on another (or in one process) continues as if it had never stopped.

Tolerance: the losses of a resumed run against the uninterrupted one, rel 1e-5; its
weights rel 1e-4 / abs 1e-5, as tests/test_hybrid.py and for its reason: fp32 on gloo,
the same arithmetic on the same values, only the order of the reductions differs with
the mesh (tp's all-reduce, dp's mean), and Adam divides each gradient by its own root
mean square, which turns an ulp's difference in a near-zero gradient into a visible one
in its update. A wrong piece (a shard at the wrong offset, a lost optimizer state) is
off by the size of the weights themselves."""

import pytest
import torch
from dcp_fns import resume, train_and_save
from hybrid_fns import CONFIG

from parcourse import RankDied, RankError, launch
from parcourse.checkpoint import check_compatible, full_state_dict, latest, read_meta

STEPS, SAVE_AT = 4, 2
SAVED_ON = {"dp": 2, "pp": 2}


def close(a, b):
    """The same keys, none missing on either side, and every value close."""
    return (
        a.keys() == b.keys()
        and len(a) > 0
        and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in a)
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory, pool4):
    """A 4-rank run (dp 2 x pp 2) that saved after step 2 of 4, uninterrupted."""
    root = tmp_path_factory.mktemp("ckpt")
    run = pool4.run(train_and_save, SAVED_ON, str(root), STEPS, SAVE_AT)
    losses = next(r[0] for r in run.results if r[0][0] is not None)
    return root, losses, run.results[0][1]


@pytest.mark.parametrize(
    "shape,zero",
    [
        (SAVED_ON, 0),
        ({"tp": 2, "pp": 2}, 0),
        ({"tp": 4}, 0),  # 30 tokens over 4 ranks: vocabulary shards of 8, 8, 8 and 6
        ({"dp": 4}, 1),  # ZeRO-1's slices at another dp
        ({"dp": 2, "pp": 2}, 2),
        ({"dp": 2, "pp": 2}, 3),  # ZeRO-3: weights gathered to load, then each keeps a slice
        ({"dp": 4}, 3),
    ],
    ids=lambda v: "x".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else f"zero{v}",
)
def test_resumed_on_another_mesh_continues_as_uninterrupted(saved, pool4, shape, zero):
    root, losses, weights = saved
    run = pool4.run(resume, shape, str(root), STEPS, zero)
    step, after, final = next(r for r in run.results if r[1][0] is not None)
    assert step == SAVE_AT
    assert after == pytest.approx(losses[SAVE_AT:], rel=1e-5)
    assert close(run.results[0][2], weights)


def test_resumed_on_two_ranks_and_in_one_process(saved):
    root, losses, weights = saved
    for world_size, shape in ((2, {"pp": 2}), (1, {"dp": 1})):
        run = launch(resume, world_size, shape, str(root), STEPS)
        step, after, final = next(r for r in run.results if r[1][0] is not None)
        assert after == pytest.approx(losses[SAVE_AT:], rel=1e-5), world_size
        assert close(run.results[0][2], weights), world_size


@pytest.mark.parametrize("zero", [1, 3])
def test_saved_with_zero_loads_without_it(tmp_path, pool4, zero):
    whole = pool4.run(train_and_save, {"dp": 4}, str(tmp_path / "a"), STEPS, SAVE_AT, zero)
    run = pool4.run(resume, {"tp": 2, "pp": 2}, str(tmp_path / "a"), STEPS, 0)
    assert close(run.results[0][2], whole.results[0][1])


def test_the_weights_read_in_one_process(saved):
    root, _, _ = saved
    path = latest(root)
    state = full_state_dict(path)
    assert read_meta(path)["step"] == SAVE_AT and read_meta(path)["mesh"]["dp"] == 2
    assert state["tok_emb.weight"].shape == (30, 24)
    assert torch.equal(state["tok_emb.weight"], state["head.weight"])  # tied


def test_a_save_killed_before_its_commit_leaves_the_last_one(tmp_path, pool4):
    with pytest.raises(RankDied, match="rank 0 was killed by SIGKILL"):
        pool4.run(train_and_save, SAVED_ON, str(tmp_path), STEPS, SAVE_AT, crash_in_commit=True)
    assert latest(tmp_path).name == f"step-{SAVE_AT:08d}"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    pool4.close()  # it lost a rank: the next run starts fresh ones
    run = pool4.run(resume, {"tp": 2, "pp": 2}, str(tmp_path), STEPS)
    assert run.results[0][0] == SAVE_AT


def test_a_checkpoint_of_another_run_is_refused(saved, pool4):
    root, _, _ = saved
    with pytest.raises(RankError, match="corpus: saved 'abc', here 'xyz'"):
        pool4.run(resume, SAVED_ON, str(root), STEPS, expect={"corpus": "xyz"})
    meta = read_meta(latest(root))
    meta["config"]["d_model"] = 48
    with pytest.raises(ValueError, match="d_model: saved 48, here 24"):
        check_compatible(meta, CONFIG)


@pytest.mark.parametrize("zero", [0, 3])
def test_a_checkpoint_written_in_the_background_while_training_goes_on(tmp_path, pool4, zero):
    """save(blocking=False): the state is copied, then written while the next steps
    change the weights (ZeRO-3: and free them); resumed, it is the state of its own
    step."""
    run = pool4.run(train_and_save, SAVED_ON, str(tmp_path), STEPS, SAVE_AT, zero, blocking=False)
    losses = next(r[0] for r in run.results if r[0][0] is not None)
    assert latest(tmp_path).name == f"step-{SAVE_AT:08d}"
    resumed = pool4.run(resume, {"tp": 2, "pp": 2}, str(tmp_path), STEPS)
    step, after, _ = next(r for r in resumed.results if r[1][0] is not None)
    assert step == SAVE_AT and after == pytest.approx(losses[SAVE_AT:], rel=1e-5)
    assert close(resumed.results[0][2], run.results[0][1])


def test_a_frozen_weight_leaves_the_others_state_saved(tmp_path, pool4):
    """A frozen weight has no optimizer state; the others' is still saved and loaded
    (the state's names are asked of every weight, not the first)."""
    from dcp_fns import frozen_first

    whole = pool4.run(frozen_first, SAVED_ON, str(tmp_path), STEPS, SAVE_AT)
    resumed = pool4.run(
        frozen_first, {"tp": 2, "pp": 2}, str(tmp_path), STEPS, SAVE_AT, resuming=True
    )
    ours = next(r[0] for r in resumed.results if r[0][0] is not None)
    theirs = next(r[0] for r in whole.results if r[0][0] is not None)
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert close(resumed.results[0][1], whole.results[0][1])
    assert all(r[2] for r in whole.results + resumed.results)  # the frozen weight never moved


def test_freezing_a_weight_after_zero_was_made_is_refused(pool4):
    from dcp_fns import freeze_after_zero

    with pytest.raises(RankError, match="frozen or unfrozen after Hybrid"):
        pool4.run(freeze_after_zero)


def test_experts_cut_over_ep_resume_on_another_cut(tmp_path, pool4):
    """A GPT with experts (and a balancing bias, a buffer that moves) saved on dp 2 x ep 2
    under ZeRO-1 (the experts' optimizer state sharded over their copies): each rank writes
    its experts as its rows of the whole (E, ...) weights, and a run resumed on ep 4, on
    dp 4 (experts whole) or under ZeRO-3 continues as the uninterrupted one; read in one
    process, the experts are whole. Same replicas (4) and microbatches, so the routing
    groups and balancing losses are the same."""
    import dataclasses

    from hybrid_fns import EXPERTS

    config = dataclasses.replace(EXPERTS, bias_rate=0.01)
    root = str(tmp_path / "experts")
    whole = pool4.run(train_and_save, {"dp": 2, "ep": 2}, root, STEPS, SAVE_AT, 1, config=config)
    losses = next(r[0] for r in whole.results if r[0][0] is not None)
    weights = whole.results[0][1]
    assert weights["blocks.0.mlp.router.bias"].abs().sum() > 0  # it moved, and is saved
    for shape, zero in (({"ep": 4}, 0), ({"dp": 4}, 0), ({"dp": 2, "ep": 2}, 3)):
        run = pool4.run(resume, shape, root, STEPS, zero, config=config)
        step, after, _ = next(r for r in run.results if r[1][0] is not None)
        assert step == SAVE_AT
        assert after == pytest.approx(losses[SAVE_AT:], rel=1e-5), shape
        assert close(run.results[0][2], weights), shape
    state = full_state_dict(latest(root))
    assert state["blocks.0.mlp.up_weight"].shape == (4, 24, 96)


def test_fp16_with_a_loss_scaler_resumes_as_uninterrupted(tmp_path, pool4):
    """Mixed precision from construction to reload: fp16 compute under ZeRO-3 with its
    fp32 masters and torch's ShardedGradScaler, saved after 3 of 7 steps (the scaler has
    backed off three times by then) and resumed under ZeRO-2, whose sums are ZeRO-3's
    (each microbatch reduced, the slices added in fp32): the checkpoint holds the fp32
    masters and the scaler's state, so the resumed run's scales, losses and weights are
    the uninterrupted run's, exactly."""
    from dcp_fns import fp16_run

    root = str(tmp_path / "fp16")
    whole = pool4.run(fp16_run, SAVED_ON, root, 7, 3, save_at=3).results
    resumed = pool4.run(fp16_run, SAVED_ON, root, 7, 2, resume=True).results
    for (scales, losses, weights), (got_scales, got_losses, got) in zip(whole, resumed):
        assert scales[0] > scales[3] and got_scales == scales[3:], (scales, got_scales)
        assert got_losses == losses[3:]
        assert weights.keys() == got.keys()
        for name, value in weights.items():
            assert value.dtype == torch.float32 and torch.equal(got[name], value), name

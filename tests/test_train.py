"""Training for real: the GPT on the standard library's source, on a mesh."""

import math

import pytest
import torch

from parcourse.train import TrainSettings, learning_rate


def cosine_with_warmup(step, steps, warmup, lr, min_lr):
    """nanoGPT's schedule, written here apart from the library: lr x (step + 1) / warmup
    for the first `warmup` steps, then half a cosine from lr down to min_lr, reached at
    step `steps` and kept after it."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= steps:
        return min_lr
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))) / 2


@pytest.mark.parametrize("steps, warmup", [(100, 10), (37, 7), (20, 0), (5, 4)])
def test_the_learning_rate_warms_up_then_decays_to_its_floor(steps, warmup):
    """Every step, and past the last, value by value (lr / warmup is not min_lr here, so
    warming up from 0 and from min_lr differ)."""
    lr, min_lr = 1e-3, 3e-5
    s = TrainSettings(steps=steps, warmup=warmup, lr=lr, min_lr=min_lr)
    for step in range(steps + 5):
        assert learning_rate(step, s) == pytest.approx(
            cosine_with_warmup(step, steps, warmup, lr, min_lr), rel=1e-12, abs=0
        ), step


def test_settings_that_do_not_divide_are_refused():
    assert TrainSettings(plan="dp3 pp2 1f1b m2", batch=16).problems() == [
        "the global batch of 16 does not cut into dp 3 x 2 microbatches equal parts"
    ]


def local_and_global(ctx):
    """One step with each replica's rows given (local=True) and one with the global batch:
    the same weights."""
    from parcourse.data import progressions, shard
    from parcourse.hybrid import Hybrid
    from parcourse.mesh import Mesh
    from parcourse.models import GPTConfig, gpt

    config = GPTConfig(vocab=32, block_size=8, n_layers=2, n_heads=2, d_model=16)
    x, y = progressions(8, 8, 32)
    out = []
    for local in (False, True):
        mesh = Mesh({"dp": 2, "pp": 2}, ctx.group)
        model = Hybrid(gpt(config), mesh, microbatches=2)
        r = mesh.coordinate("dp")
        args = (shard(x, r, 2), shard(y, r, 2)) if local else (x, y)
        model.step(*args, local=local)
        out.append(model.full_state_dict())
    return out


def test_a_replica_given_its_own_rows_steps_as_with_the_global_batch(pool4):
    for global_, local in pool4.run(local_and_global).results:
        for name, value in global_.items():
            assert torch.equal(value, local[name]), name


def test_train_command_learns_real_text_and_samples(tmp_path, capsys):
    from parcourse.cli import main

    corpus, run = ["--corpus", str(tmp_path / "corpus")], ["--out", str(tmp_path / "run")]
    assert (
        main(
            [
                "train",
                "--dp",
                "2",
                "--pp",
                "2",
                "--steps",
                "30",
                "--eval-every",
                "15",
                "--save-every",
                "15",
                "--async-save",
                *corpus,
                *run,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "standard library" in out and "sha256" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit()]
    first, last = float(rows[0][2]), float(rows[-1][2])
    assert first > 5.0 and last < first - 1.5, (first, last)  # from ln 256 = 5.55, down
    assert "sample      greedy" in out and "temperature 0.8" in out
    assert "saved       " in out and "step-00000030" in out
    # Two steps more, on another mesh (each sequence cut over cp), from the checkpoint
    # after step 30: a longer run is asked for by name; without it, the other --steps is
    # refused before any rank starts.
    longer = [
        "train",
        "--dp",
        "1",
        "--tp",
        "2",
        "--pp",
        "1",
        "--cp",
        "2",
        "--steps",
        "32",
        "--eval-every",
        "16",
        "--resume",
        *corpus,
        *run,
    ]
    with pytest.raises(SystemExit):
        main(longer)
    err = capsys.readouterr().err
    assert "with other settings: --steps 32 (saved: 30); give --change steps" in err, err
    assert main([*longer, "--change", "steps"]) == 0
    out = capsys.readouterr().out
    assert "resumed     from" in out and "after step 30" in out
    # A newest checkpoint cut short, then one whose metadata is broken: each named in one
    # line, and --resume takes the newest complete one.
    checkpoints = tmp_path / "run" / "checkpoints"
    shard = sorted((checkpoints / "step-00000032").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    (checkpoints / "step-00000030" / "parcourse.json").write_text('{"step": 3')
    from parcourse.checkpoint import latest
    from parcourse.cli import build_parser
    from parcourse.cli import train as command

    assert latest(checkpoints).name == "step-00000015"
    args = build_parser().parse_args([*longer, "--steps", "30"])
    assert command.check(args) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{shard} holds 100 bytes of the "), err
    assert err[0].endswith("; --resume will use step 15 (the newest complete one)"), err
    with pytest.raises(SystemExit):
        main(["train", "--dp", "3", "--batch", "16"])
    assert "does not cut into dp 3 x 2 microbatches equal parts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--resume", "--out", str(tmp_path / "nothing")])
    assert "no checkpoint under" in capsys.readouterr().err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from parcourse.corpus import build_corpus

    return str(build_corpus(tmp_path_factory.mktemp("corpus")).directory)


def test_a_killed_rank_is_named_and_the_run_resumes_on_another_mesh(corpus, tmp_path):
    """Killed in step 7 of 8 after a checkpoint at step 4: the launcher names the rank and
    the step; resumed on tp 2 x pp 2 instead of dp 2 x pp 2, the run loses steps 5-6 only
    and repeats the uninterrupted run's losses (rel 1e-4: only the order of reductions
    differs with the mesh, see tests/test_distributed_checkpoint.py)."""
    from parcourse import RankDied, launch
    from parcourse.train import train_on_corpus

    s = TrainSettings(plan="dp2 pp2 1f1b m2", steps=8, eval_every=8, save_every=4, warmup=2)
    whole = launch(train_on_corpus, 4, s, corpus).results[0]["history"]
    with pytest.raises(RankDied, match=r"rank 1 was killed by SIGKILL.*in step 7 of 8"):
        launch(train_on_corpus, 4, s, corpus, str(tmp_path), kill=(1, 6))
    other = TrainSettings(plan="dp1 tp2 pp2 1f1b m2", steps=8, eval_every=8, save_every=4, warmup=2)
    resumed = launch(train_on_corpus, 4, other, corpus, str(tmp_path), True).results[0]
    assert resumed["started_at"] == 4 and resumed["resumed_from"].endswith("step-00000004")
    assert [h["loss"] for h in resumed["history"]] == pytest.approx(
        [h["loss"] for h in whole], rel=1e-4
    )
    assert resumed["history"][-1]["val_loss"] == pytest.approx(whole[-1]["val_loss"], rel=1e-4)


def test_under_torchrun_a_killed_rank_restarts_and_resumes_by_itself(corpus, tmp_path):
    """`torchrun --max-restarts 1`: rank 1 killed in step 7 of 8, torchrun starts every
    worker again, and the same command resumes from the checkpoint after step 4. (Two
    workers: each of torchrun's starts a fresh Python that imports torch, a few seconds of
    a core each; four ranks killed and resumed on another mesh are tested above, started
    by the course's launcher.)"""
    from torchrun import torchrun

    code, stdout, stderr = torchrun(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "-m",
        "parcourse",
        "train",
        "--pp",
        "1",
        "--steps",
        "8",
        "--eval-every",
        "8",
        "--save-every",
        "4",
        "--corpus",
        corpus,
        "--out",
        str(tmp_path),
        "--kill",
        "1:6",
        timeout=240,
    )
    assert code == 0, stderr[-3000:]
    assert "resumed     from" in stdout and "after step 4" in stdout, stdout
    assert "step-00000008" in stdout


def test_lesson_10s_exercise_check_and_meshes(capsys):
    from parcourse.experiments.training import check_replica_rows, lesson_settings, meshes
    from parcourse.ranges import chunk_bounds

    assert check_replica_rows(lambda b, n, r: chunk_bounds(b, n)[r])
    assert not check_replica_rows(lambda b, n, r: (r * (b // n), (r + 1) * (b // n)))
    assert "row 2 is read by no replica" in capsys.readouterr().out  # 3 rows over 2
    assert not check_replica_rows(lambda b, n, r: (r * b // n, (r + 1) * b // n + 1))
    assert "each replica must start where the one before it ended" in capsys.readouterr().out
    assert not check_replica_rows(lambda b, n, r: (0, b) if r == 0 else (b, b))
    assert "at most one apart" in capsys.readouterr().out
    # the round-robin rows the prose has just described, no answer, a raise, a wrong type:
    # each a line, never a traceback from the course's code
    for wrong in (
        lambda b, n, r: list(range(r, b, n)),
        lambda b, n, r: None,
        lambda b, n, r: 1 / 0,
        lambda b, n, r: "0:4",
        lambda b, n, r: (0.5, 2),
    ):
        assert not check_replica_rows(wrong)
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and out.startswith("Not "), out
    assert check_replica_rows(lambda b, n, r: list(chunk_bounds(b, n)[r]))  # a list will do
    for world_size in range(1, 5):
        for mesh in meshes(world_size):
            s = lesson_settings(mesh, 16)
            assert s.world_size == world_size and not s.problems(), (world_size, mesh)
    with pytest.raises(ValueError, match="1 to 4 ranks"):
        meshes(5)


def test_a_ranks_step_status_reads_back():
    from parcourse.train import read_step_status, step_status

    assert step_status(0, 8, None) == "in step 1 of 8"
    assert read_step_status(step_status(0, 8, None)) is None  # no loss yet
    assert read_step_status(step_status(6, 8, 2.5)) == (6, 2.5)  # 6 steps done, the last's
    assert read_step_status("saving a checkpoint after step 4") is None


def test_settings_hold_one_plan_given_as_a_record_or_its_label():
    """The run's layout is its `ParallelPlan`, not fields beside it: a label reads back
    into the same record, and what is neither is refused."""
    from parcourse.plan import ParallelPlan

    label = TrainSettings(plan="dp2 tp2 pp1 1f1b m2 ZeRO-1")
    assert label.plan == ParallelPlan(dp=2, tp=2, microbatches=2, zero=1)
    assert label.world_size == 4 and label == TrainSettings(plan=label.plan)
    with pytest.raises(TypeError, match="a ParallelPlan or its label, got dict"):
        TrainSettings(plan={"dp": 2})

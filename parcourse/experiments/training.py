"""Lesson 10's experiments: a training run on real text watched as it goes, its
throughput against the planner, and the data-parallel slice exercise.

    s = lesson_settings(meshes(4)[0], steps=150)
    run = train_live(pool, s, corpus_dir, "runs/lesson10")   # a loss curve that grows
    measured_against_plan(run, s)                            # tokens/s, measured and predicted
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, TypedDict

from parcourse.experiments.exercises import ask, whole_numbers
from parcourse.plan import ParallelPlan
from parcourse.plots import count
from parcourse.train import TrainSettings, planned, read_step_status, train_on_corpus


class LessonShape(TypedDict):
    """A mesh of the lesson: the sizes of its dp, tp and pp axes."""

    dp: int
    tp: int
    pp: int


def meshes(world_size: int) -> tuple[LessonShape, LessonShape]:
    """(the mesh the lesson trains on, another it resumes on) for 1-4 ranks: a pipeline
    of 2 stages when the ranks are even, then replicas; tensor parallelism for the
    other, or a pipeline as deep as the ranks when they are odd."""
    if not 1 <= world_size <= 4:
        raise ValueError(f"lesson 10 runs on 1 to 4 ranks, got {world_size}")
    pp = 2 if world_size % 2 == 0 else 1
    first: LessonShape = {"dp": world_size // pp, "tp": 1, "pp": pp}
    if world_size == 1:
        return first, first.copy()
    if world_size % 2:
        return first, {"dp": 1, "tp": 1, "pp": world_size}
    pp = 2 if world_size % 4 == 0 else 1
    return first, {"dp": world_size // (2 * pp), "tp": 2, "pp": pp}


def lesson_settings(mesh: LessonShape, steps: int, **changes: Any) -> TrainSettings:
    """The lesson's run: a 2-block GPT of width 64 on 64-byte sequences, 24 a batch
    (divisible by every mesh of `meshes` times 2 microbatches), a validation loss a
    few times a run and a checkpoint halfway and at the end."""
    defaults = dict(
        batch=24,
        block_size=64,
        layers=2,
        width=64,
        heads=4,
        warmup=10,
        eval_every=max(1, steps // 6),
        save_every=max(1, steps // 2),
    )
    plan = ParallelPlan(**mesh, microbatches=2)
    return TrainSettings(plan=plan, steps=steps, **{**defaults, **changes})


def train_live(
    pool: Any,
    s: TrainSettings,
    corpus_dir: str,
    out: str,
    *,
    resume: bool = False,
    kill: tuple[int, int] | None = None,
    every_s: float = 2.0,
    title: str = "",
) -> Any:
    """`train_on_corpus` on the pool's ranks, with the loss drawn as it falls: in a
    notebook a figure under the cell, redrawn every `every_s` seconds from what the ranks
    report (their status names the step and the last loss). Returns the Run; a killed
    rank raises as any run's does."""
    import matplotlib.pyplot as plt

    from parcourse.launch.progress import LiveStatus

    points: dict[int, float] = {}
    shown: dict[str, Any] = {"handle": None, "next": time.perf_counter() + every_s}
    live = LiveStatus.in_notebook(pool) is not None

    def draw(final: list[dict[str, Any]] | None = None) -> Any:
        fig, ax = plt.subplots(figsize=(8, 3), layout="constrained")
        if final is not None:
            steps = [h["step"] + 1 for h in final]
            ax.plot(steps, [h["loss"] for h in final], lw=1, label="train (global batch)")
            val = [(h["step"] + 1, h["val_loss"]) for h in final if h.get("val_loss")]
            if val:
                ax.plot(*zip(*val), "o-", label="validation")
        else:
            ax.plot(
                sorted(points),
                [points[k] for k in sorted(points)],
                lw=1,
                label="train (as reported)",
            )
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per byte)")
        ax.set_title(title or s.plan.label(), loc="left", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
        plt.close(fig)
        return fig

    def watch(statuses: list[str], _elapsed: float) -> None:
        for status in statuses:
            if (done := read_step_status(status)) is not None:
                points[done[0] - 1] = done[1]  # the last finished step's loss, from 0
        now = time.perf_counter()
        if not live or now < shown["next"] or len(points) < 2:
            return
        shown["next"] = now + every_s
        from IPython.display import display

        if shown["handle"] is None:
            shown["handle"] = display(draw(), display_id=True)
        else:
            shown["handle"].update(draw())

    try:
        run = pool.run(
            train_on_corpus, s, corpus_dir, out, resume, kill, on_progress=watch, timeout=600
        )
    except Exception:
        if shown["handle"] is not None:  # the curve as far as the ranks reported it
            shown["handle"].update(draw())
        raise
    if shown["handle"] is not None:
        shown["handle"].update(draw(run.results[0]["history"]))
    return run


def measured_against_plan(run: Any, s: TrainSettings, flops: float) -> dict[str, float]:
    """Tokens per second of the run (the median step after the first few, the slowest
    rank's) against the planner's prediction for this machine (`flops`: one rank's
    FLOP/s on the model, `planner.measure_flops`)."""
    start = run.results[0]["started_at"]
    per_step = [
        max(r["history"][i]["seconds"] for r in run.results)
        for i in range(start, len(run.results[0]["history"]))
    ]
    steady = per_step[min(5, len(per_step) - 1) :]
    seconds = statistics.median(steady)
    predicted = planned(s, flops)
    tokens = s.batch * s.block_size
    return {
        "measured_tokens_per_s": tokens / seconds,
        "predicted_tokens_per_s": predicted["tokens_per_s"],
        "measured_step_s": seconds,
        "predicted_step_s": predicted["step"],
    }


def check_replica_rows(fn: Callable[[int, int, int], Any]) -> bool:
    """Lesson 10's exercise: `fn(batch, replicas, replica)` gives (start, end), the rows
    of a global batch that replica reads. Checked for every batch up to 24 and every
    count of replicas up to the batch: contiguous, disjoint, covering the batch, in
    replica order, no replica more than one row above another. One short verdict."""
    for batch in range(1, 25):
        for replicas in range(1, batch + 1):
            where = f"{count(batch, 'row')} over {count(replicas, 'replica')}"
            ok, answers = ask(
                lambda: [fn(batch, replicas, r) for r in range(replicas)], where=f"with {where}, "
            )
            if not ok:
                return False
            pairs = [whole_numbers(a, 2) for a in answers]
            if None in pairs:
                bad = pairs.index(None)
                print(
                    f"Not quite: {where}, replica {bad} got {answers[bad]!r}: "
                    "return the pair (start, end) of its rows, one contiguous range (a "
                    "DistributedSampler's every-n-th row is not one)."
                )
                return False
            rows = [tuple(p) for p in pairs if p is not None]
            ends = [0] + [end for _, end in rows]
            if [start for start, _ in rows] == ends[:-1] and 0 <= ends[-1] < batch:
                left = (
                    f"row {ends[-1]} is"
                    if ends[-1] == batch - 1
                    else f"rows {ends[-1]} to {batch - 1} are"
                )
                print(
                    f"Not quite: {where} gave {rows}: {left} read by no replica. Hint: share "
                    "the rows left over after dividing, one more to each of the first "
                    "replicas."
                )
                return False
            if [start for start, _ in rows] != ends[:-1] or ends[-1] != batch:
                print(
                    f"Not quite: {where} gave {rows}: each replica must start where the "
                    f"one before it ended, from 0 to {batch}, so that every row is read "
                    "once and by one replica."
                )
                return False
            sizes = [end - start for start, end in rows]
            if min(sizes) < 0 or max(sizes) - min(sizes) > 1:
                print(
                    f"Not quite: {where} gave {sizes} rows: at most one apart, or one "
                    "replica waits for another every step."
                )
                return False
    print(
        "Correct: every row read once, by one replica, the replicas at most one row "
        "apart (what ShardedLoader does, with parcourse.ranges.chunk_bounds)."
    )
    return True


def checkpoint_costs(ctx: Any, s: TrainSettings, root: str, repeats: int) -> dict[str, Any]:
    """benchmarks/training.py, on each rank: the model of `s` after one AdamW step,
    checkpointed `repeats` times by `parcourse.checkpoint` (save, then load), by DCP's
    async_save (the caller's blocked time, then the whole), and gathered whole then
    torch.save on rank 0; median seconds of each, and the bytes this rank wrote."""
    import os
    from concurrent.futures import Future
    from pathlib import Path

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from parcourse import checkpoint
    from parcourse.data import progressions
    from parcourse.hybrid import Hybrid
    from parcourse.mesh import Mesh
    from parcourse.models import gpt

    mesh = Mesh(s.plan.shape, ctx.group, order=s.plan.order)
    model = Hybrid.from_plan(
        gpt(s.config), mesh, s.plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3)
    )
    x, y = progressions(s.batch, s.block_size, s.config.vocab)
    model.step(x, y)  # the optimizer's state exists
    out: dict[str, list[float]] = {
        "save": [],
        "load": [],
        "async_blocked": [],
        "async_total": [],
        "torch_save": [],
    }
    mine = Path(root) / f"rank{ctx.rank}"
    for k in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        saved = checkpoint.save(model, root, k)
        assert isinstance(saved, Path)  # a blocking save returns the committed directory
        path = saved
        out["save"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        checkpoint.load(model, path)
        out["load"].append(time.perf_counter() - t)
        state, _ = checkpoint._dcp_state(model)
        dist.barrier()
        t = time.perf_counter()
        future = dcp.async_save(
            state, checkpoint_id=str(Path(root) / f"async{k}"), process_group=mesh.parent
        )
        out["async_blocked"].append(time.perf_counter() - t)
        assert isinstance(future, Future)  # DCP's default staging copies at once: one Future
        future.result()
        out["async_total"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        full = model.full_state_dict()
        if ctx.rank == 0:
            mine.mkdir(exist_ok=True)
            torch.save(full, mine / "model.pt")
        dist.barrier()
        out["torch_save"].append(time.perf_counter() - t)
    written = os.path.getsize(next(path.glob(f"__{ctx.rank}_*.distcp")))
    full_bytes = os.path.getsize(mine / "model.pt") if ctx.rank == 0 else 0
    return {
        "median": {k: statistics.median(v) for k, v in out.items()},
        "written": written,
        "torch_bytes": full_bytes,
    }

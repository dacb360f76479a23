"""Training for real (lesson 10): the course's GPT on the standard library's source
(`parcourse.corpus`), on a dp x tp x pp mesh (`Hybrid`), with what real runs have: each
replica reading its own rows (`ShardedLoader`), AdamW with warm-up then a cosine decay of
the learning rate, clipping by the global gradient norm, a validation loss every few steps,
and text sampled from the trained weights at the end.

    settings = TrainSettings(plan="dp2 pp2 1f1b m2", steps=100)
    run = launch(train_on_corpus, settings.world_size, settings, "runs/corpus")
    sample(run.results[0]["state"], settings.config, "def ")
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parcourse.models import GPTConfig
from parcourse.plan import ParallelPlan

if TYPE_CHECKING:
    from parcourse.checkpoint import PendingSave
    from parcourse.corpus import Corpus, ShardedLoader
    from parcourse.hybrid import Hybrid
    from parcourse.mesh import Mesh


@dataclass(frozen=True)
class TrainSettings:
    """The plan (mesh, schedule, ZeRO), the model, the data and the optimizer of a run;
    defaults that train for seconds on a laptop. `plan`: a `ParallelPlan`, or its label
    (`"dp2 tp2 pp1 1f1b m2 ZeRO-1"`), read at once."""

    plan: ParallelPlan = ParallelPlan(dp=2, pp=2, schedule="1f1b", microbatches=2)
    steps: int = 200
    batch: int = 16  # global, in sequences
    block_size: int = 64
    layers: int = 2
    width: int = 64
    heads: int = 4
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 10
    weight_decay: float = 0.01
    clip: float = 1.0
    eval_every: int = 50
    eval_batch: int = 32
    save_every: int = 0  # steps between checkpoints (0: only at the end), when saving
    async_save: bool = False  # write checkpoints in the background while training goes on
    seed: int = 0
    experts: int = 0  # > 0: every block's MLP a mixture of this many experts
    top_k: int = 2  # experts a token goes to

    def __post_init__(self) -> None:
        if isinstance(self.plan, str):
            object.__setattr__(self, "plan", ParallelPlan.parse(self.plan))
        elif not isinstance(self.plan, ParallelPlan):
            raise TypeError(f"plan: a ParallelPlan or its label, got {type(self.plan).__name__}")

    @property
    def world_size(self) -> int:
        return self.plan.gpus

    @property
    def config(self) -> GPTConfig:
        return GPTConfig(
            vocab=256,
            block_size=self.block_size,
            n_layers=self.layers,
            n_heads=self.heads,
            d_model=self.width,
            experts=self.experts,
            top_k=self.top_k,
        )

    def problems(self) -> list[str]:
        """What cannot run, in words, before any rank starts: the plan's rules
        (`ParallelPlan.problems`, in the words `Hybrid` and the planner use), then the
        model's and the run's."""
        out = self.plan.problems()
        for name in (
            "steps",
            "batch",
            "block_size",
            "layers",
            "width",
            "heads",
            "eval_every",
            "eval_batch",
        ):
            if getattr(self, name) < 1:
                out.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if out:
            return out
        try:
            self.config  # noqa: B018 - its own checks, in its words
        except ValueError as e:
            return [*out, str(e)]
        out += self.plan.problems(self.config, self.batch)
        if not 0 < self.min_lr <= self.lr:
            out.append(f"min_lr ({self.min_lr}) must be above 0 and at most lr ({self.lr})")
        return out


def learning_rate(step: int, s: TrainSettings) -> float:
    """Linear warm-up over `warmup` steps, then a cosine decay to `min_lr` at the last
    step (nanoGPT's schedule)."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    span = max(1, s.steps - s.warmup)
    progress = min(1.0, (step - s.warmup) / span)
    return s.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (s.lr - s.min_lr)


def evaluate(
    state: dict[str, torch.Tensor], config: GPTConfig, x: torch.Tensor, y: torch.Tensor
) -> float:
    """The mean cross-entropy of whole weights `state` on the batch (x, y)."""
    from parcourse.models import gpt

    model = gpt(config)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


def train_on_corpus(
    ctx: Any,
    s: TrainSettings,
    corpus_dir: str,
    out: str | None = None,
    resume: bool = False,
    kill: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The run, on each rank: `steps` AdamW steps; per step the learning rate, the global
    batch's loss (on the last stage's ranks) and the seconds; the validation loss every
    `eval_every` steps and at the end (on rank 0, from the whole weights gathered over the
    mesh); the final weights (rank 0).

    With `out`, a distributed checkpoint (`parcourse.checkpoint`) goes to
    `out/checkpoints` every `save_every` steps and at the end, with the loader's position
    and the history so far; `resume=True` starts from the newest one there (on this
    mesh, whatever mesh saved it) and goes on to `steps`. The rank's status names the
    step it is in, so a rank that dies is reported with it. `kill=(rank, step)`: that
    rank kills itself (SIGKILL, as the OOM killer or a lost node would) when it reaches
    that step: a fault on purpose, for lesson 10 and the tests.

    In phases, one function each: set up the mesh, the model and the data (`_set_up`),
    resume from a checkpoint (`_resume`), then every step (`_train_step`) and the
    checkpoints after some of them (`_Checkpoints`)."""
    from parcourse.corpus import open_corpus

    corpus = open_corpus(corpus_dir)
    run = _set_up(ctx, s, corpus)
    history: list[dict[str, Any]] = []
    start, resumed_from = 0, None
    saves = None if out is None else f"{out}/checkpoints"
    if resume:
        start, history, resumed_from = _resume(ctx, run, saves, corpus.meta["sha256"])
    checkpoints = _Checkpoints(ctx, s, run, saves, corpus.meta["sha256"])
    for step in range(start, s.steps):
        checkpoints.collect()
        ctx.tracer.set_status(step_status(step, s.steps, history[-1]["loss"] if history else None))
        if kill is not None and kill == (ctx.rank, step):
            if out is not None:  # when, for the benchmark that measures the recovery
                Path(out, "killed_at").write_text(f"{time.time()!r}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        history.append(_train_step(ctx, s, run, step))
        if saves is not None and (
            step == s.steps - 1 or (s.save_every and (step + 1) % s.save_every == 0)
        ):
            checkpoints.save(step + 1, history)
    checkpoints.finish()
    dist.barrier(group=ctx.group)  # rank 0 has committed the last one
    final = run.model.full_state_dict()
    return {
        "history": history,
        "state": final if ctx.rank == 0 else None,
        "loader": run.loader.state_dict(),
        "corpus": corpus.meta["sha256"],
        "memory": run.model.memory(),
        "saved": checkpoints.saved,
        "resumed_from": resumed_from,
        "started_at": start,
    }


@dataclass
class _Run:
    """What a rank trains with: its mesh, its part of the model (with the optimizer), the
    loader of its replica's rows, and the validation batch (the same on every rank)."""

    mesh: Mesh
    config: GPTConfig
    model: Hybrid
    loader: ShardedLoader
    val: tuple[torch.Tensor, torch.Tensor]


def _set_up(ctx: Any, s: TrainSettings, corpus: Corpus) -> _Run:
    """The mesh of the plan, the model on it (seeded alike on every rank), the loader of
    this rank's replica and the validation batch."""
    from parcourse.corpus import ShardedLoader
    from parcourse.hybrid import Hybrid
    from parcourse.mesh import Mesh
    from parcourse.models import gpt

    mesh = Mesh(s.plan.shape, ctx.group, order=s.plan.order)
    config = s.config
    s.plan.check(config, s.batch)
    torch.manual_seed(s.seed)
    model = Hybrid.from_plan(
        gpt(config, seed=s.seed),
        mesh,
        s.plan,
        max_norm=s.clip,
        seed=s.seed,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=s.lr, weight_decay=s.weight_decay),
    )
    replica, replicas = model.replica  # dp's coordinate and, inside it, ep's
    loader = ShardedLoader(
        corpus.train, s.block_size, s.batch, replica=replica, replicas=replicas, seed=s.seed
    )
    val = ShardedLoader(
        corpus.val if len(corpus.val) > s.block_size * s.eval_batch else corpus.train,
        s.block_size,
        s.eval_batch,
        seed=s.seed + 1,
    ).next()
    return _Run(mesh, config, model, loader, val)


def _resume(
    ctx: Any, run: _Run, saves: str | None, corpus: str
) -> tuple[int, list[dict[str, Any]], str]:
    """The newest checkpoint under `saves` into the model and the loader (refused if it
    was made on another corpus); returns its step, its history and where it was."""
    from parcourse import checkpoint

    found = checkpoint.latest(saves) if saves is not None else None
    if found is None:
        raise ValueError(f"nothing to resume: no checkpoint under {saves}")
    ctx.tracer.set_status(f"loading {found}")
    meta = checkpoint.load(run.model, found, expect={"corpus": corpus})
    run.loader.load_state_dict(meta["extra"]["loader"])
    return meta["step"], meta["extra"]["history"], str(found)


def _train_step(ctx: Any, s: TrainSettings, run: _Run, step: int) -> dict[str, Any]:
    """One step at its learning rate; its history entry, with the validation loss (rank
    0's; None elsewhere) every `eval_every` steps and at the last."""
    lr = learning_rate(step, s)
    for group in run.model.optimizer.param_groups:
        group["lr"] = lr
    x, y = run.loader.next()
    begin = time.perf_counter()
    loss = run.model.step(x, y, local=True)
    seconds = time.perf_counter() - begin
    # The loss from the last stage to every rank of the pipeline, so that each rank's
    # history (and the checkpoint's, written by rank 0) has it.
    shared = torch.tensor([0.0 if loss is None else loss])
    dist.all_reduce(shared, group=run.mesh.group("pp"))
    entry = {
        "step": step,
        "lr": lr,
        "loss": shared.item(),
        "seconds": seconds,
        "at": time.time(),  # when it ended: what the fault-tolerance benchmark reads
        "grad_norm": run.model.grad_norm,
    }
    if (step + 1) % s.eval_every == 0 or step == s.steps - 1:
        state = run.model.full_state_dict()
        entry["val_loss"] = evaluate(state, run.config, *run.val) if ctx.rank == 0 else None
    return entry


class _Checkpoints:
    """A run's checkpoints under `saves`: written after a step (`save`), in the background
    with `async_save`, one at a time; `saved` lists those committed, `collect` takes in
    a background one that has finished without waiting, `finish` waits for it."""

    def __init__(
        self, ctx: Any, s: TrainSettings, run: _Run, saves: str | None, corpus: str
    ) -> None:
        self.ctx, self.s, self.run, self.saves, self.corpus = ctx, s, run, saves, corpus
        self.saved: list[str] = []
        self.pending: list[PendingSave] = []  # a background save not yet committed

    def collect(self) -> None:
        if self.pending and self.pending[0].poll():  # written: committed (rank 0) at once
            self.saved.append(str(self.pending.pop().result()))

    def finish(self) -> None:
        while self.pending:
            self.saved.append(str(self.pending.pop().result()))

    def save(self, step: int, history: list[dict[str, Any]]) -> None:
        from parcourse import checkpoint

        assert self.saves is not None, "saving needs a directory (`out`)"
        self.finish()  # one at a time
        self.ctx.tracer.set_status(f"saving a checkpoint after step {step}")
        extra = {
            "corpus": self.corpus,
            "loader": self.run.loader.state_dict(),
            "history": list(history),
            "settings": dataclasses.asdict(self.s),
        }
        done = checkpoint.save(
            self.run.model, self.saves, step, extra, blocking=not self.s.async_save
        )
        if isinstance(done, checkpoint.PendingSave):
            self.pending.append(done)
        else:
            self.saved.append(str(done))


def step_status(step: int, steps: int, last_loss: float | None) -> str:
    """What a rank says while it runs step `step` (from 0) of `steps`, with the loss of the
    step before: the launcher shows it, names it when a rank dies, and `read_step_status`
    reads it back for a progress bar or a live curve."""
    return f"in step {step + 1} of {steps}" + (
        f", loss {last_loss:.4f}" if last_loss is not None else ""
    )


_STATUS = re.compile(r"in step (\d+) of \d+, loss ([\d.]+)")


def read_step_status(text: str) -> tuple[int, float] | None:
    """(steps finished, the loss of the last of them) from a `step_status`; None for any
    other status, or before the first loss."""
    m = _STATUS.search(text)
    return (int(m[1]) - 1, float(m[2])) if m else None


def planned(s: TrainSettings, flops: float) -> dict[str, float]:
    """The planner's prediction for this run's mesh on this machine (`flops`: one rank's
    FLOP/s on the model, `planner.measure_flops`): `predict_time`'s step, tokens_per_s
    and mfu, with what a measured MFU is computed from on the same scale: tokens/s x
    "flops_per_token" / "ranks_flops" (the ranks' FLOP/s: one rank's for each core they
    share)."""
    from parcourse.planner import Cluster, model_flops_per_token, predict_time

    choice = s.plan
    cluster = Cluster.this_machine(s.world_size, flops=flops)
    return {
        **predict_time(s.config, choice, s.batch, cluster),
        "flops_per_token": model_flops_per_token(s.config),
        "ranks_flops": min(s.world_size, cluster.cores or s.world_size) * cluster.flops,
    }


@torch.no_grad()
def sample(
    state: dict[str, torch.Tensor],
    config: GPTConfig,
    prompt: str,
    tokens: int = 200,
    temperature: float = 0.0,
    seed: int = 0,
) -> str:
    """Text from the trained weights, in one process: `tokens` bytes after `prompt`,
    greedy (temperature 0) or sampled at `temperature`."""
    from parcourse.models import gpt

    model = gpt(config)
    model.load_state_dict(state)
    model.eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt.encode())], dtype=torch.long)
    for _ in range(tokens):
        logits = model(ids[:, -config.block_size :])[:, -1]
        if temperature <= 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(logits / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=g)
        ids = torch.cat([ids, nxt], dim=1)
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")


def replace(settings: TrainSettings, **changes: Any) -> TrainSettings:
    return dataclasses.replace(settings, **changes)

"""The course's GPT on the corpus of lesson 10, trained by fault-tolerant replicas:
what `train --fault-tolerant`, the benchmark and lesson 13 run.

Replica `r` of `n` reads the rows of each global batch that `ShardedLoader` gives it
(the rows `train_on_corpus` gives dp's replica `r`), chosen by the step alone, so a
replica healed at step k reads what it would have read; when a replica is lost, its
rows of the steps it misses are not read, and the mean is over the survivors' rows."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from parcourse.corpus import ShardedLoader
from parcourse.fault.run import ReplicaContext
from parcourse.fault.training import train_replica
from parcourse.train import TrainSettings, evaluate, learning_rate


def rows_at(loader: ShardedLoader, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's rows of global batch `step`, as `step` calls of `next()` from the
    start would leave them."""
    epoch, index = divmod(step, loader.batches_per_epoch)
    if epoch != loader.epoch:
        loader.epoch = epoch
        loader._order = loader._shuffle()
    loader.position = index * loader.batch
    return loader.next()


def cross_entropy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def train_gpt_replica(
    ctx: ReplicaContext, s: TrainSettings, corpus_dir: str, timeout: float = 10.0
) -> dict[str, Any]:
    """`s.steps` committed steps of the GPT of `s` (AdamW, its schedule and clipping) on
    this replica; `train_replica`'s result with the validation loss at the end."""
    from parcourse.corpus import open_corpus
    from parcourse.models import gpt

    corpus = open_corpus(corpus_dir)
    loader = ShardedLoader(
        corpus.train, s.block_size, s.batch, replica=ctx.replica, replicas=ctx.replicas, seed=s.seed
    )
    val = ShardedLoader(
        corpus.val if len(corpus.val) > s.block_size * s.eval_batch else corpus.train,
        s.block_size,
        s.eval_batch,
        seed=s.seed + 1,
    ).next()

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = gpt(s.config, seed=s.seed)
        return model, torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)

    result = train_replica(
        ctx,
        make,
        lambda step, replica: rows_at(loader, step),
        s.steps,
        cross_entropy,
        timeout=timeout,
        lr=lambda step: learning_rate(step, s),
        clip=s.clip,
    )
    result["val_loss"] = evaluate(result["state"], s.config, *val)
    return result

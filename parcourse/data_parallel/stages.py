"""Gradient synchronisation for a pipeline's stages: lesson 02's buckets, driven by the 3D
step (`parcourse.hybrid`) at the moments its schedule gives. ZeRO's twin, with the same
moments and the same calls, is `parcourse.zero.stages.ShardedStages`.

Inside a pipeline a rank runs its stages one microbatch at a time, in the order the
schedule says, so the hooks of `BucketedDataParallel` (a bucket launched when its last
gradient arrives) cannot tell when a stage's gradient is whole: the schedule can. The
moments, for both implementations:

- `on_weight_gradients(stage, microbatch)`: after each backward action (B or W) of a
  stage; here a stage's buckets start their all-reduce after its last backward of the
  step, while the rank's other actions run (None where an implementation does nothing
  then);
- `around(action)`: a context around each action (ZeRO-3's gather; None here);
- `finalize()`: after the schedule: the tied weights' buckets (their gradient is whole
  only once the pipeline has added it up over its stages), then waiting for every one;
- `step()`: the optimizer's step;
- `gradients()`: (gradient, the weight it is of) for each gradient this rank holds after
  `finalize`, for clipping; `held()`: the gradients' buffers beyond the weights' own.

What is reduced together (`StageWeights`): each stage's weights, a stage's experts apart,
and the weights several stages share; over which groups (`SyncGroups`): the dense
weights over one, the experts over theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parcourse.comm import Comm
from parcourse.data_parallel.bucketed import Bucket, make_buckets


@dataclass
class StageWeights:
    """This rank's trainable weights by what reduces them together: each stage's own
    (`dense`), each stage's experts (`experts`: another group averages them), and the
    weights several stages share (`tied`: a GPT's embedding and head, whose gradient is
    whole only after the schedule). A frozen weight is in none: nothing reduces or steps
    it."""

    dense: dict[int, list[nn.Parameter]]
    experts: dict[int, list[nn.Parameter]]
    tied: list[nn.Parameter]

    @classmethod
    def of(cls, stages: dict[int, nn.Module], tied: set[int], experts: set[int]) -> StageWeights:
        """`stages`: this rank's, by index; `tied`, `experts`: the ids of those weights."""
        dense: dict[int, list[nn.Parameter]] = {}
        expert: dict[int, list[nn.Parameter]] = {}
        seen: set[int] = set()
        for s in sorted(stages):
            held = [
                p
                for p in stages[s].parameters()
                if p.requires_grad and id(p) not in tied and id(p) not in seen
            ]
            seen.update(id(p) for p in held)
            dense[s] = [p for p in held if id(p) not in experts]
            expert[s] = [p for p in held if id(p) in experts]
        params = {id(p): p for s in sorted(stages) for p in stages[s].parameters()}
        return cls(dense, expert, [p for p in params.values() if id(p) in tied and p.requires_grad])


@dataclass(frozen=True)
class SyncGroups:
    """Who averages what: `comm`'s group the dense weights' gradients, `experts`'s each
    expert's (the ranks holding the same experts; None without experts cut over ranks),
    every gradient divided by `mean_over` (all the dense replicas, for both). Under
    hierarchical sharding (HSDP, `Roles.replicate`) ZeRO's groups are the shard's only
    and `replicate` the group each slice is averaged across (None: none)."""

    comm: Comm
    experts: Comm | None
    mean_over: int
    replicate: Comm | None = None


class BucketedStages:
    """Lesson 02's buckets over a pipeline's stages (`bucket_mb`, 25 as DDP's), averaged
    over `groups` (`SyncGroups`: the experts' buckets over their own group); `optimizer`
    builds the optimizer from `params`. `last_backward`: {stage: its last (stage,
    microbatch) backward of the step}; `note`: called once the gradients are whole,
    before they are reduced (memory accounting)."""

    around: Callable[[Any], AbstractContextManager[None]] | None = None

    def __init__(
        self,
        weights: StageWeights,
        params: list[nn.Parameter],
        groups: SyncGroups,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        last_backward: dict[int, tuple[int, int]],
        bucket_mb: float = 25.0,
        note: Callable[[], None] = lambda: None,
    ) -> None:
        self.params, self.comm, self.expert_comm = params, groups.comm, groups.experts
        self.optimizer, self.mean_over, self.note = optimizer(params), groups.mean_over, note
        mean_over = groups.mean_over
        self.last_backward = last_backward
        self.buckets: dict[int | None, list[Bucket]] = {}
        self._expert_buckets: set[int] = set()
        if mean_over > 1:
            units: dict[int | None, list[nn.Parameter]] = {s: ps for s, ps in weights.dense.items()}
            units[None] = weights.tied
            self.buckets = {s: make_buckets(ps, bucket_mb) if ps else [] for s, ps in units.items()}
            for s, ps in weights.experts.items():
                made = make_buckets(ps, bucket_mb) if ps else []
                self._expert_buckets.update(id(b) for b in made)
                self.buckets[s] = self.buckets[s] + made
        self._frozen = {id(p) for p in params if not p.requires_grad}

    def check(self) -> None:
        """Refuse a weight unfrozen after the buckets were made (a frozen one is in none)."""
        if self.buckets and self._frozen - {id(p) for p in self.params if not p.requires_grad}:
            raise ValueError(
                "weights were unfrozen after Hybrid was made: dp's buckets hold "
                "the weights that were trainable then. Set requires_grad before "
                "making it (as DDP asks)."
            )

    @property
    def on_weight_gradients(self) -> Callable[[int, int], None]:
        return self.after_backward

    def after_backward(self, stage: int, microbatch: int) -> None:
        """After a stage's last backward of the step its gradients are whole, and its
        buckets' all-reduces start while the rank's other actions run."""
        if self.buckets and self.last_backward.get(stage) == (stage, microbatch):
            for bucket in self.buckets[stage]:
                self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        bucket.pack()  # an expert bucket over the ranks holding the same experts
        comm = self.expert_comm if id(bucket) in self._expert_buckets else self.comm
        assert comm is not None  # an expert bucket exists only with an expert group
        bucket.done = comm.all_reduce(bucket.buffer, async_op=True)

    def finalize(self) -> None:
        """The tied weights' buckets (and, in a step cut short, any not launched yet),
        then waiting for them all. A frozen weight is in no bucket and keeps no gradient
        (None, so the optimizer skips it, weight decay included); one unused on this
        replica counts as zeros in the mean, one unused on every replica keeps none, as
        in one process."""
        self.note()
        for buckets in self.buckets.values():
            for bucket in buckets:
                if bucket.done is None:
                    self._launch(bucket)
        for buckets in self.buckets.values():
            for bucket in buckets:
                assert bucket.done is not None
                bucket.done.result()
                bucket.done = None
                bucket.unpack(self.mean_over)

    def step(self, optimizer_step: Callable[[], Any] | None = None) -> None:
        (optimizer_step or self.optimizer.step)()

    def gradients(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        return [(p.grad, p) for p in self.params if p.grad is not None]

    def held(self) -> list[torch.Tensor]:
        return []

    def whole_weights(self) -> AbstractContextManager[None]:
        """The weights are whole here at every moment."""
        return nullcontext()

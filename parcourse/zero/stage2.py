"""ZeRO stage 2: the gradients sharded too (Rajbhandari et al., arXiv:1910.02054).

Stage 1 (stage1.py) builds the full gradient on every rank and reduce-scatters it
when backward ends. Stage 2 changes one thing: each unit of gradients (a bucket of
about `bucket_mb`, in backward order, as data parallelism's buckets) is
reduce-scattered as soon as backward has produced it, so the full gradient never
exists at once, and the communication overlaps the rest of backward (as DDP's
buckets do, parcourse/data_parallel/bucketed.py). The volume is stage 1's:
2(N-1)/N x S per step.

Units start strictly in backward order, so every rank issues the same collectives
in the same order even when a parameter goes unused on some rank; at most two
are in flight (stage1.py's `_launch`), each as big as its unit's full gradient.
"""

from __future__ import annotations

import torch

from parcourse.zero.stage1 import ZeroStage1


class ZeroStage2(ZeroStage1):
    """`ZeroStage2(module, group=None, *, bucket_mb=25.0, ...)`, the arguments of
    `ZeroStage1`; `ZeroModel(module, stage=2)` builds one."""

    stage = 2

    def grad_ready(self, param: torch.Tensor) -> None:
        """Note the gradient (stage 1); launch every unit, in order, whose gradients are
        all in."""
        super().grad_ready(param)
        order = self._backward_order
        while self._next < len(order) and order[self._next].complete():
            self._launch(order[self._next])

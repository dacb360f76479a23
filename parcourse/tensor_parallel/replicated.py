"""Gradients of replicated parameters under sequence parallelism, summed once per backward.

Under sequence parallelism (Korthikanti et al., arXiv:2205.05198, sec. 4.2.2) a
LayerNorm, the bias a row-parallel layer adds after its reduce-scatter, and the
position embedding are whole on every rank but see only this rank's chunk of the
sequence: each rank's gradient is a partial sum over its tokens, and the ranks'
parts must be added. Megatron does it once per step, after backward, in one
all-reduce of all of them (finalize_model_grads); this does it at the end of each
backward (autograd's queue_callback, as DDP does), in one all-reduce too.

Only what this backward added is summed, so it stays right under gradient
accumulation: each parameter's gradient from before the backward is put aside
when its first contribution arrives, and afterwards the gradient is that plus the
sum over ranks of this backward's contributions.

A split backward's W runs one backward call per group of weights: inside `one_sum()`
those calls sum once, on leaving, instead of once each.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from parcourse.tensor_parallel.comm import TPComm

# The syncs that backward calls inside `one_sum` have left to sum (None: outside one).
# A process's, not a thread's: on a GPU autograd runs the hooks on a thread of its own.
_held: list[ReplicatedGradSync] | None = None


@contextmanager
def one_sum() -> Iterator[None]:
    """The backward calls made inside sum the replicated gradients once, on leaving,
    not each at its end: a split backward's W, one call per group of weights, would
    otherwise sum every replicated parameter once per call. Nested, the outermost sums;
    a backward already under way when it starts still sums what it meets. If a call
    inside raises, what the calls left is dropped, as a lone backward's is."""
    global _held
    if _held is not None:
        yield
        return
    syncs: list[ReplicatedGradSync] = []
    _held = syncs
    try:
        try:
            yield
        finally:
            _held = None
        for sync in syncs:
            sync._end_of_backward()
    finally:  # after a raise too, inside or in a sum: nothing left for a later one
        for sync in syncs:
            sync._forget()


class ReplicatedGradSync:
    """Hooks on `params` that sum this backward's gradients over the group, in one
    all-reduce (where "replicated grads") when backward ends (or `one_sum` does)."""

    def __init__(self, params: list[nn.Parameter], comm: TPComm) -> None:
        self.params, self.comm = params, comm
        self._new: dict[int, torch.Tensor] = {}  # this backward's contribution, by param
        self._before: dict[int, torch.Tensor | None] = {}  # .grad before this backward
        self._queued: weakref.ref[Callable[[], None]] | None = None  # the sum to come
        self.handles = [p.register_hook(functools.partial(self._arrived, p)) for p in params]

    def _arrived(self, p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
        # Asked whether this backward will run the parameter's gradient accumulator, the
        # engine refuses when it is torch.autograd.grad, which returns gradients instead
        # of accumulating them (the accumulator is looked up, not held: held, it would
        # keep the parameter, and the model, alive through a reference gc cannot see).
        with torch.enable_grad():  # backward runs hooks without it
            view = p.view_as(p).grad_fn
        assert view is not None  # p requires grad
        accumulator = view.next_functions[0][0]
        assert accumulator is not None  # p is a leaf: its gradient accumulator
        try:
            torch._C._will_engine_execute_node(accumulator)
        except RuntimeError as e:  # raised for a leaf under torch.autograd.grad only
            raise RuntimeError(
                "under sequence parallelism a replicated parameter's gradient (a "
                "LayerNorm's, a bias's, the position embedding's) is this rank's tokens' "
                "part until loss.backward() sums it over the ranks at its end; "
                "torch.autograd.grad would return that part alone: call loss.backward() "
                "and read .grad"
            ) from e
        under_way = self._queued is not None and self._queued() is not None
        if _held is not None and not under_way:  # summed when `one_sum` ends
            if not any(sync is self for sync in _held):
                self._forget()
                _held.append(self)
        elif not under_way:
            # The first gradient since the last sum: sum at this backward's end. A sum
            # queued by a backward that raised is gone with it (autograd drops a failed
            # backward's callbacks): what that backward left is dropped too. (Held
            # weakly, a queued sum lives as long as its backward: a checkpoint's
            # backward inside it adds to it, and does not start another.)
            def end_of_backward() -> None:
                self._end_of_backward()

            self._forget()
            self._queued = weakref.ref(end_of_backward)
            torch.autograd.Variable._execution_engine.queue_callback(end_of_backward)
        if id(p) not in self._before:
            self._before[id(p)] = None if p.grad is None else p.grad.clone()
            self._new[id(p)] = grad
        else:  # a parameter used twice: its contributions add up
            self._new[id(p)] = self._new[id(p)] + grad
        return grad

    def _end_of_backward(self) -> None:
        # Every rank sends every parameter, in the same order (zeros for one without a
        # gradient this time), so that the buffers match whatever the ranks computed.
        parts = [self._new.get(id(p), torch.zeros_like(p)).reshape(-1) for p in self.params]
        total = self.comm.all_reduce(torch.cat(parts), "backward", "replicated grads")
        offset = 0
        for p in self.params:
            summed = total[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
            if id(p) not in self._before:
                continue
            before = self._before[id(p)]
            grad = summed if before is None else before + summed
            if p.grad is None:
                p.grad = grad.clone()
            else:
                p.grad.copy_(grad)
        self._forget()
        self._queued = None

    def _forget(self) -> None:
        """Drop what backward has brought since the last sum (a new one starts, or the
        calls that brought it raised)."""
        self._new, self._before = {}, {}

"""A span around a region's backward, for a timeline: autograd runs it later, out of
sight of a `with tracer.span(...)` around the forward.

>>> back = BackwardSpan(tracer, "backward: experts", label="experts")
>>> (x,) = back.enter(x)  # identity; its backward, the region's last, closes the span
>>> y = experts(x)
>>> y = back.leave(y)  # identity; its backward, the region's first, opens it

Autograd reaches `leave`'s node when the output's gradient is ready, then runs the
region's nodes (created after `enter`'s, so run before it), then `enter`'s once every
input's gradient is in: the span is the region's backward. Without a tracer, both are
the tensors themselves.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from parcourse.trace import SpanKind, Tracer


class BackwardSpan:
    """Marks a region of forward (`enter` on its inputs, `leave` on its output) so that
    its backward is recorded on `tracer` as a span `name` of `kind` with `meta`."""

    def __init__(
        self, tracer: Tracer | None, name: str, kind: SpanKind = "compute", **meta: Any
    ) -> None:
        self.tracer, self.name, self.kind, self.meta = tracer, name, kind, meta
        self.start_ns: int | None = None

    def enter(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The region's inputs, unchanged; their gradients close the span."""
        if self.tracer is None or not torch.is_grad_enabled():
            return xs
        return tuple(_Enter.apply(self, *xs))

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """The region's output, unchanged; its gradient opens the span."""
        if self.tracer is None or not torch.is_grad_enabled():
            return y
        return _Leave.apply(y, self)

    def _close(self) -> None:
        if self.tracer is not None and self.start_ns is not None:
            end = time.perf_counter_ns()
            self.tracer.add_span(self.name, self.start_ns, end, self.kind, **self.meta)
            self.start_ns = None


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, span: BackwardSpan, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.span = span
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.span._close()
        return (None, *grads)


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, span: BackwardSpan) -> torch.Tensor:
        ctx.span = span
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.span.start_ns = time.perf_counter_ns()
        return grad, None

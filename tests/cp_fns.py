"""Rank functions for the context-parallelism tests."""

import itertools

import torch
import torch.nn.functional as F

from parcourse.context_parallel import LAYOUTS, METHODS, context_attention, shard_sequence


def errors_against_sdpa(ctx, tokens, dtype, heads=12, methods=METHODS, on="cpu"):
    """For every method, layout and mask: the largest difference between this rank's
    output and gradients (dQ, dK, dV) and its rows of torch's scaled_dot_product_attention
    on the whole sequence in one process, backward from the same upstream gradient; the
    tensors on `on` ("rank": the rank's own, a GPU where it has one)."""
    where = ctx.device if on == "rank" else torch.device(on)
    g = torch.Generator().manual_seed(0)
    q, k, v, up = (
        torch.randn(2, heads, tokens, 8, generator=g, dtype=dtype).to(where) for _ in range(4)
    )
    errors = {}
    for method, layout, causal in itertools.product(methods, LAYOUTS, (False, True)):
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*whole, is_causal=causal).backward(up)
        want = F.scaled_dot_product_attention(*(t.detach() for t in whole), is_causal=causal)

        def mine(t):
            return shard_sequence(t, ctx.rank, ctx.world_size, layout)

        local = [mine(t).clone().requires_grad_() for t in (q, k, v)]
        out = context_attention(
            *local, ctx.group, tokens=tokens, method=method, layout=layout, causal=causal
        )
        out.backward(mine(up))
        out = out.detach()
        errors[method, layout, causal] = max(
            float((out - mine(want)).abs().max()),
            *(float((a.grad - mine(b.grad)).abs().max()) for a, b in zip(local, whole)),
        )
    return errors


def ring_traffic(ctx, tokens, layout, method="ring", heads=3):
    """The bytes this rank sends in forward and in backward (the tracer's count of every
    message), its messages, and the attention blocks it computed."""
    from parcourse.comm import Comm
    from parcourse.context_parallel import attention
    from parcourse.trace import Tracer

    tracer = Tracer(ctx.rank)
    comm = Comm(ctx.group, tracer=tracer, algorithm="auto")  # the course's ring on gloo
    computed = []
    block = attention.block_attention

    def counted(*args, **kwargs):
        computed.append(1)
        return block(*args, **kwargs)

    attention.block_attention = counted
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (
            shard_sequence(
                torch.randn(2, heads, tokens, 4, generator=g), ctx.rank, ctx.world_size, layout
            ).requires_grad_()
            for _ in range(3)
        )
        out = context_attention(
            q, k, v, ctx.group, tokens=tokens, layout=layout, method=method, causal=True, comm=comm
        )
        forward = sum(c.value for c in tracer.data().counters if c.name == "bytes_sent")
        messages = sum(1 for c in tracer.data().counters if c.name == "bytes_sent")
        out.sum().backward()
    finally:
        attention.block_attention = block
    counters = [c for c in tracer.data().counters if c.name == "bytes_sent"]
    return {
        "forward": forward,
        "backward": sum(c.value for c in counters) - forward,
        "messages": len(counters),
        "forward_messages": messages,
        "blocks": len(computed),
        "tokens": q.shape[2],
    }

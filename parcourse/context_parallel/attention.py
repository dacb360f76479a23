"""Attention over a sequence cut across ranks: the block and its merge, the cut, and the
three methods (`parcourse.context_parallel` says what each is).

Tensors are (batch, heads, tokens, head dim), as `scaled_dot_product_attention` takes
them; the tokens dim is the one cut. Scores, the softmax and the merge run in fp32 (fp64
for fp64 inputs), whatever the inputs' dtype.

The ring has a backward of its own (`_Ring`, flash attention's, over the ring): forward
keeps this rank's q, k, v, its output and the log-sum-exp of its scores, nothing of the
blocks it saw; backward sends every block of K and V round the ring again, rebuilds each
block's probabilities from the log-sum-exp (P = exp(S - lse)), adds this rank's share of
dK and dV to the gradient travelling with the block, and after the last hop each block's
gradient is home. So a rank keeps O(its tokens), whatever P. All-gather and Ulysses keep
autograd's backward through their transfers (`_AllGather`: summed back to its owner;
parcourse.comm's `AllToAll`: the inverse all-to-all), the forward the only code to read;
their price is memory: all of K and V (all-gather), the whole sequence's scores for 1/P of the heads
(Ulysses).

On a traced `Comm`, each method draws its work and its waits: attention's compute (a
span per block of K/V, its rank under `BLOCK_KEY`, forward and backward), the time spent
waiting for a message (idle: drawn hatched, never with a block's rank), and the
collectives (all-gather, reduce-scatter, all-to-all; each with its group, so that a
timeline tells the wait for the last partner apart, `trace.with_collective_waits`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist

from parcourse.comm import Comm
from parcourse.comm.alltoall import AllToAll
from parcourse.comm.messenger import Arrival
from parcourse.ranges import chunk_bounds
from parcourse.trace import SpanKind
from parcourse.trace_backward import BackwardSpan

Method = Literal["ring", "all-gather", "ulysses"]
Layout = Literal["contiguous", "zigzag"]
METHODS: tuple[Method, ...] = ("ring", "all-gather", "ulysses")
LAYOUTS: tuple[Layout, ...] = ("contiguous", "zigzag")
TOKENS = 2  # the dim of (batch, heads, tokens, head dim) that is cut
# The span metadata naming whose K/V a span of attention's compute used (a timeline's
# `color_by`): a rank, not one of the zigzag's 2P chunks.
BLOCK_KEY = "K/V of rank"


# --------------------------------------------------------------------------- the cut


def chunks_of(rank: int, size: int, layout: Layout) -> list[int]:
    """The chunks of the sequence rank `rank` of `size` holds, in its order: chunk `rank`
    of `size` (contiguous), or chunks `rank` and 2 size - 1 - rank of 2 size (zigzag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return [rank] if layout == "contiguous" else [rank, 2 * size - 1 - rank]


def _bounds(tokens: int, size: int, layout: Layout) -> list[tuple[int, int]]:
    n = size if layout == "contiguous" else 2 * size
    if tokens < n:
        raise ValueError(
            f"a sequence of {tokens} tokens cannot be cut into the {n} chunks "
            f"the {layout} layout gives {size} ranks"
        )
    return chunk_bounds(tokens, n)


def positions(tokens: int, rank: int, size: int, layout: Layout = "contiguous") -> torch.Tensor:
    """The positions in the whole sequence of rank `rank`'s tokens, in its order (for the
    position embedding, and the causal mask)."""
    bounds = _bounds(tokens, size, layout)
    return torch.cat([torch.arange(*bounds[c]) for c in chunks_of(rank, size, layout)])


def shard_sequence(
    x: torch.Tensor, rank: int, size: int, layout: Layout = "contiguous", dim: int = TOKENS
) -> torch.Tensor:
    """Rank `rank`'s tokens of the whole sequence `x` (cut along `dim`); uneven lengths
    are fine, the first chunks one token longer (`chunk_bounds`)."""
    return x.index_select(dim, positions(x.shape[dim], rank, size, layout).to(x.device))


def unshard_sequence(
    parts: Sequence[torch.Tensor], layout: Layout = "contiguous", dim: int = TOKENS
) -> torch.Tensor:
    """The whole sequence again from every rank's part, in rank order."""
    size = len(parts)
    tokens = sum(p.shape[dim] for p in parts)
    order = torch.cat([positions(tokens, r, size, layout) for r in range(size)])
    whole = torch.cat(list(parts), dim=dim)
    return whole.index_select(dim, torch.argsort(order).to(whole.device))


# --------------------------------------------------------------------------- one block


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor | None = None,
    k_pos: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of queries `q` over the keys `k` and values `v` of one block:
    (out, lse), out in fp32 (fp64 for fp64 inputs), lse the log-sum-exp of each query's
    scores (batch, heads, queries). With positions, a causal mask: a key after its query
    is hidden. A query that sees no key of the block gets out 0 and lse -inf, which
    `merge` gives no weight."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale
    if q_pos is not None and k_pos is not None:
        hidden = k_pos.to(scores.device)[None, :] > q_pos.to(scores.device)[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    p = torch.exp(scores - torch.where(seen, lse, torch.zeros_like(lse))[..., None])
    return p @ v.to(acc), lse


def merge(
    out_a: torch.Tensor | None, lse_a: torch.Tensor | None, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' results for the same queries as one: each rescaled by its share of
    the two softmax sums, exp(lse - lse of both), so the result is the softmax over both
    blocks' keys exactly (no block needs the others' maximum). `out_a` None: nothing yet."""
    if out_a is None or lse_a is None:
        return out_b, lse_b
    lse = torch.logaddexp(lse_a, lse_b)
    both = torch.isfinite(lse)  # -inf for both: no key seen yet, keep 0
    safe = torch.where(both, lse, torch.zeros_like(lse))
    wa = torch.where(both, torch.exp(lse_a - safe), torch.zeros_like(lse))
    wb = torch.where(both, torch.exp(lse_b - safe), torch.zeros_like(lse))
    return out_a * wa[..., None] + out_b * wb[..., None], lse


def _attend(
    acc: tuple[Any, Any],
    q: torch.Tensor,
    q_chunks: list[tuple[int, torch.Tensor]],
    k: torch.Tensor,
    v: torch.Tensor,
    k_chunks: list[tuple[int, torch.Tensor]],
    causal: bool,
    scale: float | None,
) -> tuple[Any, Any]:
    """Merge into `acc` (out, lse) of all of this rank's queries what the block (k, v)
    gives them, chunk by chunk of each; pairs the mask hides entirely are skipped."""
    outs, lses = [], []
    for i, (qc, q_pos) in enumerate(q_chunks):
        start = sum(len(p) for _, p in q_chunks[:i])
        qs = q.narrow(TOKENS, start, len(q_pos))
        out, lse = None, None
        offset = 0
        for kc, k_pos in k_chunks:
            ks, vs = k.narrow(TOKENS, offset, len(k_pos)), v.narrow(TOKENS, offset, len(k_pos))
            offset += len(k_pos)
            if causal and kc > qc:
                continue  # every key after every query: nothing to see
            masked = causal and kc == qc  # the diagonal; before it, every key is seen
            o, s = block_attention(
                qs, ks, vs, q_pos if masked else None, k_pos if masked else None, scale
            )
            out, lse = merge(out, lse, o, s)
        if out is None or lse is None:  # no key of the block for these queries
            shape = (*q.shape[:TOKENS], len(q_pos))
            acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            lse = torch.full(shape, float("-inf"), dtype=acc_dtype, device=q.device)
            out = torch.zeros(*shape, v.shape[-1], dtype=acc_dtype, device=q.device)
        outs.append(out)
        lses.append(lse)
    block = (torch.cat(outs, dim=TOKENS), torch.cat(lses, dim=TOKENS))
    return merge(acc[0], acc[1], *block)


# --------------------------------------------------------------------------- transfers


def _shift(
    comm: Comm,
    x: torch.Tensor,
    shape: Sequence[int],
    left: int,
    right: int,
    tag: int,
    dtype: torch.dtype | None = None,
) -> tuple[list[Any], torch.Tensor]:
    """Send `x` to the right neighbour and receive a tensor of `shape` from the left one,
    both started (wait on the works before reading what arrives)."""
    incoming = torch.empty(tuple(shape), dtype=dtype or x.dtype, device=x.device)
    works = _paired(
        comm, lambda: comm.send(x.contiguous(), right, tag), lambda: comm.recv(incoming, left, tag)
    )
    return works, incoming


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _received(comm: Comm, works: list[Any], what: str) -> None:
    """Wait for `works`, traced as the pipeline's receives are: until the message left
    its sender (which a messenger knows over a simulated link) waiting for the other
    rank, an idle span "wait for `what`"; from then on the transfer, a comm span. Over a
    real link no rank sees when a message left, and all of it is drawn as waiting."""
    start = time.perf_counter_ns()
    _wait(works)
    if comm.tracer is None:
        return
    end = time.perf_counter_ns()
    left = [w.departed for w in works if isinstance(w, Arrival) and w.departed is not None]
    split = end if not left else min(end, max(start, int(max(left) * 1e9)))
    if split > start:
        comm.tracer.add_span(f"wait for {what}", start, split, kind="idle")
    if end > split:
        comm.tracer.add_span(f"receive {what}", split, end, kind="comm")


def _span(comm: Comm, name: str, kind: SpanKind, **meta: Any) -> AbstractContextManager[Any]:
    """A span on the Comm's tracer (the ring drawn on a timeline), or nothing."""
    return comm.tracer.span(name, kind, **meta) if comm.tracer is not None else nullcontext()


def _paired(comm: Comm, send: Any, recv: Any) -> list[Any]:
    """A send and a receive, even ranks sending first and odd ranks receiving first: a
    backend whose messages run in order on one stream (NCCL) would otherwise have every
    rank's receive wait behind its own send (two ranks: each other's neighbour both
    ways). gloo does not mind either order."""
    return [send(), recv()] if comm.rank % 2 == 0 else [recv(), send()]


class _AllGather(torch.autograd.Function):
    """Every rank's x, padded to the longest along the tokens dim, stacked in rank order
    (`Comm.all_gather`); backward: each rank's gradient summed over the ranks and handed
    to its owner, a reduce-scatter (`Comm.reduce_scatter`). `name` (K or V): the spans'."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, longest: int, name: str) -> torch.Tensor:
        padded = torch.nn.functional.pad(x, (0, 0, 0, longest - x.shape[TOKENS])).contiguous()
        whole = padded.new_empty(comm.size * padded.numel())
        with _collective(comm, f"all-gather {name}", "all-gather"):
            comm.all_gather(padded.flatten(), whole)
        ctx.comm, ctx.tokens, ctx.shape, ctx.name = comm, x.shape[TOKENS], padded.shape, name
        return whole.view(comm.size, *padded.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # the ring's reduce-scatter sums in its buffer: a copy, not autograd's gradient
        with _collective(ctx.comm, f"reduce-scatter d{ctx.name}", "reduce-scatter"):
            mine = ctx.comm.reduce_scatter(grad.flatten().clone()).view(ctx.shape)
        return mine.narrow(TOKENS, 0, ctx.tokens), None, None, None


def _collective(comm: Comm, name: str, op: str) -> AbstractContextManager[Any]:
    """A comm span around one collective, with its group's ranks (a timeline draws the
    wait for the last partner to enter it as waiting)."""
    return _span(comm, name, "comm", op=op, group=comm.ranks, label=op)


# --------------------------------------------------------------------------- the methods


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    tokens: int,
    method: Method = "ring",
    layout: Layout = "contiguous",
    causal: bool = False,
    scale: float | None = None,
    comm: Comm | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys, each rank of
    `group` holding its tokens (`shard_sequence(x, rank, size, layout)`) of a sequence
    of `tokens`: this rank's rows of `scaled_dot_product_attention(q, k, v,
    is_causal=causal)` on the whole, in q's dtype. `comm`: a `Comm` over `group` that
    carries every message (the ring's sends, the all-gather's and Ulysses' collectives;
    traced, or over a simulated link); without it, one that runs the course's ring on gloo
    and torch's collectives otherwise (`algorithm="auto"`)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if q.is_meta:  # a shape only (the pipeline finding its stages' output shapes): q's,
        return torch.empty_like(q)  # and no message sent, as Comm's collectives on meta
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if not q.shape[:2] == k.shape[:2] == v.shape[:2]:
        raise ValueError(
            f"q, k and v need the same batch and heads, got {tuple(q.shape[:2])}, "
            f"{tuple(k.shape[:2])}, {tuple(v.shape[:2])} (grouped-query attention, "
            "fewer K/V heads, is not built here)"
        )
    mine = positions(tokens, rank, size, layout)
    if q.shape[TOKENS] != len(mine) or k.shape[TOKENS] != len(mine) or v.shape[TOKENS] != len(mine):
        raise ValueError(
            f"rank {rank} of {size} holds {len(mine)} of the {tokens} tokens "
            f"({layout}), got q, k, v of {q.shape[TOKENS]}, {k.shape[TOKENS]}, "
            f"{v.shape[TOKENS]}"
        )
    cut = _RingPlan(rank, size, _bounds(tokens, size, layout), layout)
    chunks = cut.chunks
    comm = comm or Comm(group, algorithm="auto")
    if method == "ulysses":
        return _ulysses(q, k, v, comm, rank, size, tokens, layout, causal, scale)
    acc: tuple[Any, Any] = (None, None)
    if method == "all-gather":
        lengths = [sum(len(p) for _, p in chunks(r)) for r in range(size)]
        keys = _AllGather.apply(k, comm, max(lengths), "K")
        values = _AllGather.apply(v, comm, max(lengths), "V")
        back = BackwardSpan(comm.tracer, "backward: attention over every rank's K/V", label="bwd")
        q, keys, values = back.enter(q, keys, values)
        for r in range(size):
            with _span(
                comm, f"attend to rank {r}'s K/V", "compute", label=f"fwd {r}", **{BLOCK_KEY: r}
            ):
                acc = _attend(
                    acc,
                    q,
                    chunks(rank),
                    keys[r].narrow(TOKENS, 0, lengths[r]),
                    values[r].narrow(TOKENS, 0, lengths[r]),
                    chunks(r),
                    causal,
                    scale,
                )
        return back.leave(acc[0].to(q.dtype))
    if k.shape != v.shape:
        raise ValueError("the ring passes K and V together: they must have one shape")
    return _Ring.apply(q, k, v, comm, cut, causal, scale)


_BACK_KV, _BACK_GRAD = 2000, 3000  # tags of backward's messages, apart from forward's


class _Ring(torch.autograd.Function):
    """Ring attention (pass-KV) with flash attention's backward over the ring (module
    docstring): forward keeps q, k, v, the output and the log-sum-exp only."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        comm: Comm,
        ring: _RingPlan,
        causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        rank, size = ring.rank, ring.size
        acc: tuple[Any, Any] = (None, None)
        kv = torch.stack([k, v])
        for step in range(size):
            source = (rank - step) % size  # whose block this rank holds now
            pending = None
            if step < size - 1:  # the next block on its way while this one is used
                pending = _shift(
                    comm, kv, ring.shape(kv, step + 1), ring.left, ring.right, tag=step
                )
            with _span(
                comm,
                f"attend to rank {source}'s K/V",
                "compute",
                label=f"fwd {source}",
                **{BLOCK_KEY: source},
            ):
                acc = _attend(
                    acc, q, ring.chunks(rank), kv[0], kv[1], ring.chunks(source), causal, scale
                )
            if pending is not None:  # waiting, whoever's block it is: no BLOCK_KEY
                _received(comm, pending[0], f"rank {ring.source(step + 1)}'s K/V")
                kv = pending[1]
        out, lse = acc
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.ring, ctx.causal, ctx.scale = comm, ring, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        comm, ring, causal = ctx.comm, ctx.ring, ctx.causal
        scale = q.shape[-1] ** -0.5 if ctx.scale is None else ctx.scale
        rank, size = ring.rank, ring.size
        d_out = grad.to(out.dtype)
        delta = (d_out * out).sum(-1)  # D = rowsum(dO * O), one per query
        dq = torch.zeros(q.shape, dtype=out.dtype, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=out.dtype, device=q.device)  # the held block's
        for step in range(size):
            source = ring.source(step)
            pending = None
            if step < size - 1:  # K and V again, the next block on its way meanwhile
                pending = _shift(
                    comm, kv, ring.shape(kv, step + 1), ring.left, ring.right, tag=_BACK_KV + step
                )
            with _span(
                comm,
                f"back through rank {source}'s K/V",
                "compute",
                label=f"bwd {source}",
                **{BLOCK_KEY: source},
            ):
                _block_gradients(
                    q,
                    ring.chunks(rank),
                    kv,
                    ring.chunks(source),
                    d_out,
                    lse,
                    delta,
                    causal,
                    scale,
                    dq,
                    dkv,
                )
            if size > 1:  # the block's gradient goes on with it; the last hop takes it home
                works, dkv = _shift(
                    comm, dkv, ring.shape(dkv, step + 1), ring.left, ring.right, _BACK_GRAD + step
                )
                _received(comm, works, f"rank {ring.source(step + 1)}'s dK/dV")
            if pending is not None:
                _received(comm, pending[0], f"rank {ring.source(step + 1)}'s K/V")
                kv = pending[1]
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None)


class _RingPlan:
    """The cut of a sequence over a group, seen from one rank: each rank's chunks, and
    for the ring, whose block this rank holds at each step."""

    def __init__(self, rank: int, size: int, bounds: list[tuple[int, int]], layout: Layout) -> None:
        self.rank, self.size, self.bounds, self.layout = rank, size, bounds, layout
        self.left, self.right = (rank - 1) % size, (rank + 1) % size

    def source(self, step: int) -> int:
        """Whose block this rank holds at `step` (its own at 0, then the left's, ...)."""
        return (self.rank - step) % self.size

    def chunks(self, r: int) -> list[tuple[int, torch.Tensor]]:
        return [(c, torch.arange(*self.bounds[c])) for c in chunks_of(r, self.size, self.layout)]

    def shape(self, like: torch.Tensor, step: int) -> tuple[int, ...]:
        """A block like `like` (K and V stacked) of the rank held at `step`."""
        tokens = sum(len(p) for _, p in self.chunks(self.source(step)))
        return (*like.shape[: TOKENS + 1], tokens, like.shape[-1])


def _block_gradients(
    q: torch.Tensor,
    q_chunks: list[tuple[int, torch.Tensor]],
    kv: torch.Tensor,
    k_chunks: list[tuple[int, torch.Tensor]],
    d_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    causal: bool,
    scale: float,
    dq: torch.Tensor,
    dkv: torch.Tensor,
) -> None:
    """One block's part of backward, chunk pair by chunk pair (those the mask hides
    skipped): P = exp(S - lse) rebuilt from the whole row's log-sum-exp, dV += P^T dO,
    dS = P * (dO V^T - D), dQ += dS K scale, dK += dS^T Q scale; into dq and dkv."""
    acc = dq.dtype
    q_start = 0
    for qc, q_pos in q_chunks:
        n_q = len(q_pos)
        qs = q.narrow(TOKENS, q_start, n_q).to(acc)
        do = d_out.narrow(TOKENS, q_start, n_q)
        lse_q, delta_q = lse.narrow(TOKENS, q_start, n_q), delta.narrow(TOKENS, q_start, n_q)
        k_start = 0
        for kc, k_pos in k_chunks:
            n_k = len(k_pos)
            if not (causal and kc > qc):  # else every key after every query: nothing
                ks = kv[0].narrow(TOKENS, k_start, n_k).to(acc)
                vs = kv[1].narrow(TOKENS, k_start, n_k).to(acc)
                scores = (qs @ ks.transpose(-2, -1)) * scale
                if causal and kc == qc:  # the diagonal: a key after its query is hidden
                    hidden = k_pos.to(q.device)[None, :] > q_pos.to(q.device)[:, None]
                    scores = scores.masked_fill(hidden, float("-inf"))
                p = torch.exp(scores - lse_q[..., None])
                dkv[1].narrow(TOKENS, k_start, n_k).add_(p.transpose(-2, -1) @ do)
                ds = p * (do @ vs.transpose(-2, -1) - delta_q[..., None])
                dq.narrow(TOKENS, q_start, n_q).add_((ds @ ks) * scale)
                dkv[0].narrow(TOKENS, k_start, n_k).add_((ds.transpose(-2, -1) @ qs) * scale)
            k_start += n_k
        q_start += n_q


def _ulysses(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Comm,
    rank: int,
    size: int,
    tokens: int,
    layout: Layout,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    heads = q.shape[1]
    if heads % size:
        raise ValueError(
            f"Ulysses gives each of the {size} ranks whole heads: {heads} heads "
            f"do not divide by {size}"
        )
    lengths = [len(positions(tokens, r, size, layout)) for r in range(size)]
    mine = lengths[rank]

    def to_heads(x: torch.Tensor, name: str) -> torch.Tensor:
        """(B, H, mine, D) -> (B, H / P, all tokens in rank order, D)."""
        b, h, _, d = x.shape
        pieces = x.reshape(b, size, h // size, mine, d).permute(1, 3, 0, 2, 4)
        got = AllToAll.apply(
            pieces.reshape(size * mine, b, h // size, d),
            comm,
            [mine] * size,
            lengths,
            f"{name} to heads",
        )
        return got.permute(1, 2, 0, 3)

    qh, kh, vh = to_heads(q, "q"), to_heads(k, "k"), to_heads(v, "v")
    order = torch.cat([positions(tokens, r, size, layout) for r in range(size)])
    whole = f"the whole sequence, {heads // size} of {heads} heads"
    grads = BackwardSpan(comm.tracer, f"backward: attention over {whole}", label="bwd")
    qh, kh, vh = grads.enter(qh, kh, vh)
    with _span(comm, f"forward: attention over {whole}", "compute", label="fwd"):
        out, _ = block_attention(
            qh, kh, vh, order if causal else None, order if causal else None, scale
        )
    out = grads.leave(out)
    b, hs, _, d = out.shape
    back = AllToAll.apply(
        out.permute(2, 0, 1, 3).contiguous(), comm, lengths, [mine] * size, "out to tokens"
    )  # (P x mine, B, H / P, D): rank j's heads
    back = back.reshape(size, mine, b, hs, d).permute(2, 0, 3, 1, 4)
    return back.reshape(b, size * hs, mine, d).to(q.dtype)

"""Rank functions for the collectives tests (importable by name in the ranks)."""

import time

import torch
import torch.distributed as dist

from parcourse import comm as C
from parcourse._compat import reduce_scatter_single

TORCH_OP = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def make(rank, numel, dtype, seed=0, integer_valued=True):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if integer_valued:  # small integers: sums are exact in any order, in every dtype
        return torch.randint(-8, 9, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g).to(dtype)


def _torch_reference(t, op, group):
    ref = t.clone()
    if op == "avg":
        dist.all_reduce(ref, op=dist.ReduceOp.SUM, group=group)
        return ref / dist.get_world_size(group)
    dist.all_reduce(ref, op=TORCH_OP[op], group=group)
    return ref


def all_reduce_vs_torch(ctx, algo, numel, dtype, op, integer_valued=True, shape=None, **kw):
    t = make(ctx.rank, numel, dtype, integer_valued=integer_valued)
    if shape is not None:
        t = t.view(shape)
    ref = _torch_reference(t, op, ctx.group)
    fn = C.ring_all_reduce if algo == "ring" else C.naive_all_reduce
    before_ptr = t.data_ptr()
    out = fn(t, ctx.group, op, tracer=ctx.tracer, **kw)
    assert out is t and t.data_ptr() == before_ptr, "in place"
    return t, ref, ctx.tracer.total("bytes_sent")


def non_contiguous(ctx):
    base = make(ctx.rank, 6 * 5, torch.float32).view(6, 5)
    view = base.t()  # (5, 6), not contiguous
    ref = view.clone()
    dist.all_reduce(ref, group=ctx.group)
    C.ring_all_reduce(view, ctx.group)
    return view.clone(), ref, base.t().clone()


def reduce_scatter_vs_torch(ctx, numel, dtype, op, **kw):
    t = make(ctx.rank, numel, dtype)
    shard = C.ring_reduce_scatter(t, ctx.group, op, **kw)
    full = _torch_reference(t, op, ctx.group)
    start, end = C.chunk_bounds(numel, ctx.world_size)[ctx.rank]
    expected = full[start:end]
    if numel % ctx.world_size == 0 and op == "sum":
        theirs = torch.empty(numel // ctx.world_size, dtype=dtype)
        reduce_scatter_single(theirs, t, group=ctx.group)
        assert torch.equal(theirs, expected)
    return shard, expected


def all_gather_vs_torch(ctx, numel, dtype, **kw):
    full = torch.arange(numel).to(dtype)
    start, end = C.chunk_bounds(numel, ctx.world_size)[ctx.rank]
    shard = full[start:end].clone()
    even = numel % ctx.world_size == 0
    ours = C.ring_all_gather(
        shard, ctx.group, numel=None if even else numel, tracer=ctx.tracer, **kw
    )
    if even:
        theirs = [torch.empty_like(shard) for _ in range(ctx.world_size)]
        dist.all_gather(theirs, shard, group=ctx.group)
        assert torch.equal(torch.cat(theirs), ours)
    return ours, full, ctx.tracer.total("bytes_sent")


def on_subgroup(ctx):
    """Ranks 1..3 form a group; rank 0 is not in it."""
    group = dist.new_group([1, 2, 3])
    if ctx.rank == 0:
        try:
            C.ring_all_reduce(torch.ones(7), group)
        except ValueError as e:  # the clear error, and no message sent
            return str(e)
        return None
    t = torch.full((7,), float(ctx.rank))
    C.ring_all_reduce(t, group)
    return t.tolist()


def linked(ctx, algo, nbytes, latency_s, bandwidth_Bps):
    link = C.SimulatedLink(latency_s, bandwidth_Bps)
    t = torch.ones(nbytes // 4)
    fn = C.ring_all_reduce if algo == "ring" else C.naive_all_reduce
    fn(t, ctx.group, tracer=ctx.tracer, link=link)  # warm-up
    t.fill_(1.0)
    dist.barrier(group=ctx.group)
    t0 = time.perf_counter()
    fn(t, ctx.group, link=link)
    return time.perf_counter() - t0, t[0].item()


def burst(ctx, k, nbytes, latency_s, bandwidth_Bps, separate=False):
    """Rank 0 sends k messages of nbytes to rank 1 at once, through a link (one
    messenger, or with `separate` one per message, as separate calls would); returns
    (when this rank left the barrier, when it was done), on the host clock all ranks
    share: rank 1's end minus rank 0's start is the time from the first send until rank
    1 has every message (rank 1 may leave the barrier later than rank 0)."""
    link = C.SimulatedLink(latency_s, bandwidth_Bps)
    t = torch.ones(nbytes // 4)
    one = C.messenger(ctx.group, t, link=link)
    wires = [C.messenger(ctx.group, t, link=link) if separate else one for _ in range(k)]
    dist.barrier(group=ctx.group)
    t0 = time.perf_counter()
    if ctx.rank == 0:
        sends = [wire.send([t], 1, tag) for tag, wire in enumerate(wires)]
        for w in sends:
            w.wait()
        for wire in wires:
            wire.settle()
    elif ctx.rank == 1:
        arrivals = [wire.recv([torch.empty_like(t)], 0, tag) for tag, wire in enumerate(wires)]
        for a in arrivals:
            a.wait()
    return t0, time.perf_counter()


def bad_args(ctx, what):
    if what == "op":
        C.ring_all_reduce(torch.ones(4), ctx.group, "min")
    if what == "dtype":
        C.ring_all_reduce(torch.ones(4, dtype=torch.bool), ctx.group)
    if what == "avg-int":
        C.ring_all_reduce(torch.ones(4, dtype=torch.int64), ctx.group, "avg")
    if what == "root":
        C.naive_all_reduce(torch.ones(4), ctx.group, root=5)


def fast_vs_readable(ctx, numel, dtype, op, segment_bytes=C.SEGMENT_BYTES):
    """The fast ring and the readable one (ring.py) on the same random input: all-reduce,
    reduce-scatter and all-gather from each, and the bytes each sent."""
    t = make(ctx.rank, numel, dtype, integer_valued=False)
    seg = {"segment_bytes": segment_bytes}
    rings = {
        "fast": (
            lambda x, **kw: C.ring_all_reduce(x, ctx.group, op, **seg, **kw),
            lambda x: C.ring_reduce_scatter(x, ctx.group, op, **seg),
        ),
        "readable": (
            lambda x, **kw: C.ring.all_reduce(x, ctx.group, op, **kw),
            lambda x: C.ring.reduce_scatter(x, ctx.group, op),
        ),
    }
    out = {}
    for name, (all_reduce, reduce_scatter) in rings.items():
        before = ctx.tracer.total("bytes_sent")
        reduced = all_reduce(t.clone(), tracer=ctx.tracer)
        sent = ctx.tracer.total("bytes_sent") - before
        out[name] = (reduced, reduce_scatter(t.clone()), sent)
    start, end = C.chunk_bounds(numel, ctx.world_size)[ctx.rank]
    out["fast"] += (
        C.ring_all_gather(
            t[start:end].clone(), ctx.group, numel=numel, segment_bytes=segment_bytes
        ),
    )
    out["readable"] += (C.ring.all_gather(t[start:end].clone(), numel, ctx.group),)
    return out


def comm_vs_torch(ctx, algorithm, link=None):
    """A Comm's collectives, sync and async, and its send/recv, against torch's."""
    comm = C.Comm(ctx.group, tracer=ctx.tracer, link=link, algorithm=algorithm)
    n, rank = ctx.world_size, ctx.rank
    t = make(rank, 12 * n, torch.float32)
    want_sum = _torch_reference(t, "sum", ctx.group)
    want_max = _torch_reference(t, "max", ctx.group)
    got = {
        "sum": comm.all_reduce(t.clone()),
        "max": comm.all_reduce(t.clone(), "max"),
        "avg": comm.all_reduce(t.clone(), "avg"),
        "async sum": comm.all_reduce(t.clone(), async_op=True).result(),
        "reduce_scatter": comm.reduce_scatter(t.clone()),
        "async reduce_scatter": comm.reduce_scatter(t.clone(), async_op=True).result(),
    }
    part = want_sum[12 * rank : 12 * (rank + 1)]
    whole = torch.empty(12 * n)
    got["all_gather"] = comm.all_gather(part.clone(), whole)
    pending = comm.all_gather(part.clone(), torch.empty(12 * n), async_op=True)
    got["async all_gather"] = pending.result()
    assert pending.finished_ns > 0
    want = {
        "sum": want_sum,
        "max": want_max,
        "avg": want_sum / n,
        "async sum": want_sum,
        "reduce_scatter": part,
        "async reduce_scatter": part,
        "all_gather": want_sum,
        "async all_gather": want_sum,
    }
    if n > 1:  # a message around the ring, through the Comm
        sent = comm.send(torch.full((3,), float(rank)), (rank + 1) % n, tag=7)
        incoming = torch.empty(3)
        comm.recv(incoming, (rank - 1) % n, tag=7).wait()
        sent.wait()
        got["recv"], want["recv"] = incoming, torch.full((3,), float((rank - 1) % n))
    return {k: torch.equal(got[k], want[k]) for k in want}, ctx.tracer.total("bytes_sent")


def paced_actions(ctx, seconds, collectives):
    """Two padded actions of `seconds`, each with `collectives` all-reduces inside; when
    each all-reduce started and each action ended, relative to the action's start, and
    the seconds blocked in them."""
    comm = C.Comm(ctx.group, algorithm="torch")
    pacer = C.Pacer(comm)
    out = []
    for _ in range(2):
        dist.barrier(group=ctx.group)
        start, blocked = time.perf_counter(), comm.blocked_s
        starts = []
        with pacer.padded(("stage 0", "F"), seconds):
            for _ in range(collectives):
                comm.before_blocking()
                starts.append(time.perf_counter() - start)
                comm.all_reduce(torch.ones(4))
        out.append(
            {
                "starts": starts,
                "end": time.perf_counter() - start,
                "blocked": comm.blocked_s - blocked,
            }
        )
    return out


def hierarchical_vs_torch(ctx, ranks_per_node, numel, dtype, op):
    """The hierarchical all-reduce against torch's, and the bytes this rank sent inside
    its node and across nodes."""
    t = make(ctx.rank, numel, dtype)
    ref = _torch_reference(t, op, ctx.group)
    out = C.hierarchical_all_reduce(t, ranks_per_node, op, tracer=ctx.tracer)
    assert out is t
    return t, ref, C.bytes_by_level(ctx.tracer.data().counters, ctx.rank, ranks_per_node)


def two_groups_one_tag(ctx):
    """Two groups of the same two ranks over a simulated link, a message on each with the
    same peer and tag: group A's posted before group B's and waited after it (a pipeline's
    early receive beside tensor parallelism's ring). Each must get its own message."""
    from parcourse.comm.messenger import messenger

    link = C.SimulatedLink.of(latency_us=50)
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    wire_a, wire_b = messenger(a, torch.ones(1), link=link), messenger(b, torch.ones(1), link=link)
    peer, tag = 1 - ctx.rank, 1
    if ctx.rank == 0:
        sent_a = wire_a.send([torch.full((64,), 1.0)], peer, tag)
        wire_b.send([torch.full((64,), 2.0)], peer, tag).wait()
        sent_a.wait()
        return None
    got_a, got_b = torch.zeros(64), torch.zeros(64)
    arrival_a = wire_a.recv([got_a], peer, tag)
    wire_b.recv([got_b], peer, tag).wait()
    arrival_a.wait()
    return got_a.unique().tolist(), got_b.unique().tolist()

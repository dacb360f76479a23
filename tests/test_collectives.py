"""Ring and parameter-server collectives against torch.distributed, bytes against theory."""

import math

import collective_fns as F
import pytest
import torch

from parcourse import Pool, RankError
from parcourse import comm as C
from parcourse import theory as T

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]


@pytest.fixture(scope="module")
def pools():
    made = {n: Pool(n, timeout=60) for n in (1, 2, 3, 4)}
    yield made
    for p in made.values():
        p.close()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("algo", ["ring", "naive"])
def test_all_reduce_equals_torch_exactly(pools, world_size, algo):
    # Integer-valued inputs make every summation order exact, so equality is exact
    # for every dtype; numel 1000 does not divide by 3 or 4 (uneven chunks); numel 2
    # is smaller than the world (empty chunks).
    for dtype in DTYPES:
        for op in ("sum", "max") + (("avg",) if dtype.is_floating_point else ()):
            for numel in (1000, 2):
                run = pools[world_size].run(F.all_reduce_vs_torch, algo, numel, dtype, op)
                for ours, ref, _ in run.results:
                    assert ours.dtype == dtype
                    assert torch.equal(ours, ref), (dtype, op, numel)


@pytest.mark.parametrize("world_size", [2, 4])
def test_random_floats_match_within_reduction_order(pools, world_size):
    run = pools[world_size].run(
        F.all_reduce_vs_torch,
        "ring",
        17 * 241,
        torch.float32,
        "sum",
        integer_valued=False,
        shape=(17, 241),
    )
    for ours, ref, _ in run.results:
        assert ours.shape == (17, 241)
        # fp32: only the order of the N additions differs from gloo's; a few ulps.
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_segmented_chunks_equal_torch_exactly(pools, world_size):
    # Segments of 12 bytes: 3 float32 or 6 fp16 elements, so chunks of 1000 / N elements
    # go as many segments of unequal sizes (and numel 2 has empty chunks).
    for dtype in (torch.float32, torch.float16, torch.int64):
        for numel in (1000, 2):
            for op in ("sum", "max"):
                for ours, ref, _ in (
                    pools[world_size]
                    .run(F.all_reduce_vs_torch, "ring", numel, dtype, op, segment_bytes=12)
                    .results
                ):
                    assert torch.equal(ours, ref), (dtype, numel, op)
            for shard, expected in (
                pools[world_size]
                .run(F.reduce_scatter_vs_torch, numel, dtype, "sum", segment_bytes=12)
                .results
            ):
                assert torch.equal(shard, expected)
            for ours, full, _ in (
                pools[world_size].run(F.all_gather_vs_torch, numel, dtype, segment_bytes=12).results
            ):
                assert torch.equal(ours, full)


def test_segments_are_traced_and_send_the_same_bytes(pools):
    # 1200 float32 over 4 ranks: chunks of 1200 bytes, in segments of at most 500: 3 each.
    run = pools[4].run(F.all_reduce_vs_torch, "ring", 1200, torch.float32, "sum", segment_bytes=500)
    for rank in range(4):
        spans = run.trace.spans_of(rank=rank, kind="comm")
        assert [(s.meta["step"], s.meta["segment"]) for s in spans] == [
            (step, j) for _ in range(2) for step in range(3) for j in range(3)
        ]
        assert run.results[rank][2] == T.bytes_sent_per_rank("ring", 4800, 4, rank)
    with pytest.raises(RankError, match="segment_bytes must be >= 1"):
        pools[2].run(F.all_reduce_vs_torch, "ring", 10, torch.float32, "sum", segment_bytes=0)


def test_non_contiguous_input_is_reduced_in_place(pools):
    for ours, ref, through_base in pools[3].run(F.non_contiguous).results:
        assert torch.equal(ours, ref) and torch.equal(through_base, ref)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reduce_scatter_and_all_gather_equal_torch(pools, world_size):
    for numel in (24, 1001):
        for dtype in DTYPES:
            for op in ("sum", "max"):
                for shard, expected in (
                    pools[world_size].run(F.reduce_scatter_vs_torch, numel, dtype, op).results
                ):
                    assert torch.equal(shard, expected)
            for ours, full, _ in pools[world_size].run(F.all_gather_vs_torch, numel, dtype).results:
                assert torch.equal(ours, full)


def test_works_on_a_subgroup(pools):
    results = pools[4].run(F.on_subgroup).results
    assert "not a member of the group" in results[0]  # rank 0 is outside it
    assert results[1:] == [[6.0] * 7] * 3


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_sent_equal_the_formulas_exactly(pools, world_size):
    numel, dtype = 1200, torch.float32  # divisible by 2, 3 and 4: chunks are equal
    size = numel * 4
    ring = pools[world_size].run(F.all_reduce_vs_torch, "ring", numel, dtype, "sum").results
    naive = pools[world_size].run(F.all_reduce_vs_torch, "naive", numel, dtype, "sum").results
    for rank in range(world_size):
        assert ring[rank][2] == T.bytes_sent_per_rank("ring", size, world_size, rank)
        assert ring[rank][2] == 2 * (world_size - 1) / world_size * size
        assert naive[rank][2] == T.bytes_sent_per_rank("naive", size, world_size, rank)
    assert naive[0][2] == (world_size - 1) * size
    gathered = pools[world_size].run(F.all_gather_vs_torch, numel, dtype).results
    assert all(g[2] == (world_size - 1) / world_size * size for g in gathered)
    # Uneven chunks (1001 float16 over 3 or 4 ranks): the chunks each rank sends, exactly.
    ring = pools[world_size].run(F.all_reduce_vs_torch, "ring", 1001, torch.float16, "sum").results
    for rank in range(world_size):
        assert ring[rank][2] == T.bytes_sent_per_rank("ring", 2002, world_size, rank, itemsize=2)


def test_trace_shows_each_ring_step_with_its_chunk(pools):
    run = pools[4].run(F.all_reduce_vs_torch, "ring", 400, torch.float32, "sum")
    for rank in range(4):
        steps = run.trace.spans_of(rank=rank, kind="comm")
        assert [s.meta["phase"] for s in steps] == ["reduce-scatter"] * 3 + ["all-gather"] * 3
        # every rank starts from a different chunk: its left neighbour's
        assert steps[0].meta["chunk"] == (rank - 1) % 4
        assert [s.meta["chunk"] for s in steps[3:]] == [(rank - k) % 4 for k in range(3)]


def test_simulated_link_time_is_at_least_the_model(pools):
    # 16 ms per 1 MB message on a link: the cost model predicts ring
    # 6 x (alpha + S/4/beta) and naive 2 x alpha + 6 x S/beta for 4 ranks. Simulated
    # time really passes, so it is a lower bound; how much more the real transfers
    # add depends on the machine's load.
    nbytes, alpha, beta = 1 << 20, 1e-3, 1 << 26
    model = T.CostModel(alpha, beta)
    ring = pools[4].run(F.linked, "ring", nbytes, alpha, beta).results
    naive = pools[4].run(F.linked, "naive", nbytes, alpha, beta).results
    assert all(r[1] == 4.0 for r in ring + naive)
    t_ring = max(r[0] for r in ring)
    t_naive = max(r[0] for r in naive)
    assert t_ring >= 0.95 * model.all_reduce_s("ring", nbytes, 4)
    assert t_naive >= 0.95 * model.all_reduce_s("naive", nbytes, 4)


def test_latency_is_a_delay_paid_once_by_messages_sent_together(pools):
    # 50 ms of latency, 8 small messages sent at once from rank 0 to rank 1: they arrive
    # about 50 ms later, not 8 x 50 ms (latency is not time the link is busy).
    alpha = 0.05

    def seconds(*args, **kwargs):  # from rank 0's first send to rank 1's last arrival,
        # the least of three runs: simulated time is a floor every run keeps, and a
        # busy machine only adds to it, while a wrong model is slow in every run
        runs = [pools[2].run(F.burst, *args, **kwargs).results for _ in range(3)]
        return min(r[1][1] - r[0][0] for r in runs)

    took = seconds(8, 64, alpha, 1e9)
    assert alpha <= took < 3 * alpha
    # Sent by separate calls (as a pipeline sends), messages still share the links: 4
    # messages of 1 MB at 50 MB/s queue on the outgoing link, 20 ms each, and the last
    # arrives 50 ms after it left: about 130 ms, not 70.
    took = seconds(4, 1 << 20, alpha, 50e6, separate=True)
    assert alpha + 4 * (1 << 20) / 50e6 <= took < alpha + 6 * (1 << 20) / 50e6
    # The parameter server waits for latency twice (gather, send back), the ring
    # once per step: 2 x 50 ms against 6 x 50 ms with 4 ranks and a tiny tensor.
    model = T.CostModel(alpha, 1e9)
    naive, ring = (
        min(
            max(r[0] for r in pools[4].run(F.linked, algo, 64, alpha, 1e9).results)
            for _ in range(3)
        )
        for algo in ("naive", "ring")
    )
    assert model.all_reduce_s("naive", 64, 4) == pytest.approx(2 * alpha, rel=1e-3)
    assert 2 * alpha <= naive < 4 * alpha
    assert 6 * alpha <= ring < 8 * alpha


def test_a_link_changes_the_time_only(pools):
    # A free link (no latency, no bandwidth limit) still stamps and stages every message:
    # odd byte counts (fp16, 1001 elements), both algorithms, twice (buffers reused).
    link = C.SimulatedLink()
    for algo in ("ring", "naive"):
        for dtype in (torch.float16, torch.int64):
            for _ in range(2):
                for ours, ref, _ in (
                    pools[3].run(F.all_reduce_vs_torch, algo, 1001, dtype, "sum", link=link).results
                ):
                    assert torch.equal(ours, ref), (algo, dtype)


def test_messages_queue_on_the_links_for_their_bytes_only():
    # No processes: the wire's own arithmetic. Three messages of 1 MB leave together on
    # a 1 GB/s link with 10 ms of latency: each occupies the outgoing link 1 ms, and
    # the last one arrives alpha after its last byte left: 10 + 3 x 1 ms.
    link = C.SimulatedLink(0.01, 1e9)
    sender, receiver = C.link.Wire(link), C.link.Wire(link)
    departed, left = zip(*(sender.depart(10**6) for _ in range(3)))
    assert [d - departed[0] for d in departed] == pytest.approx([0, 1e-3, 2e-3], abs=1e-4)
    assert [t - departed[0] for t in left] == pytest.approx([1e-3, 2e-3, 3e-3], abs=1e-4)
    arrived = [receiver.arrive(d, 10**6) for d in departed]
    assert [a - departed[0] for a in arrived] == pytest.approx([0.011, 0.012, 0.013], abs=1e-4)
    # Two senders, one receiver: both messages reach it together and queue on its
    # incoming link (the parameter server's root).
    root = C.link.Wire(link)
    assert root.arrive(0.0, 10**6) == pytest.approx(0.011)
    assert root.arrive(0.0, 10**6) == pytest.approx(0.012)
    assert link.seconds(10**6) == pytest.approx(0.011) and link.busy_s(10**6) == 1e-3


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("op", "unsupported op 'min'"),
        ("dtype", "unsupported dtype torch.bool"),
        ("avg-int", "op 'avg' needs a floating-point tensor"),
        ("root", "root must be a rank"),
    ],
)
def test_unsupported_arguments_are_clear(pools, what, message):
    with pytest.raises(RankError, match=message):
        pools[2].run(F.bad_args, what)


def test_without_a_process_group_the_error_says_so():
    # pytest's own process never joins a group; the ranks live in the pools.
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        C.ring_all_reduce(torch.ones(3))


def test_cost_model_and_fit():
    model = T.CostModel(alpha_s=50e-6, beta_Bps=2e9)
    n, s = 4, 64 << 20
    assert model.all_reduce_s("ring", s, n) == pytest.approx(6 * (50e-6 + s / 4 / 2e9))
    assert model.all_reduce_s("naive", s, n) == pytest.approx(2 * 50e-6 + 6 * s / 2e9)
    assert model.all_reduce_s("ring", s, 1) == model.all_reduce_s("naive", s, 1) == 0.0
    sizes = [1 << k for k in range(10, 27, 2)]
    for algo in ("ring", "naive"):
        times = [model.all_reduce_s(algo, x, n) for x in sizes]
        fit = T.fit_cost_model(algo, n, sizes, times)
        assert fit.alpha_s == pytest.approx(50e-6, rel=1e-6)
        assert fit.beta_Bps == pytest.approx(2e9, rel=1e-6)
    algbw, busbw = T.bus_bandwidth(s, 0.1, n)
    assert busbw == pytest.approx(algbw * 1.5)
    assert C.chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(ValueError, match="at least two distinct sizes"):
        T.fit_cost_model("ring", n, [1, 1], [1.0, 1.0])
    with pytest.raises(ValueError, match="one rank sends nothing"):
        T.fit_cost_model("ring", 1, [1, 2], [1.0, 1.0])
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        model.all_reduce_s("tree", s, n)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="latency_s must be >= 0"):
        C.SimulatedLink(-1.0)
    assert math.isinf(C.SimulatedLink.of(latency_us=5).bandwidth_Bps)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fast_ring_equals_the_readable_ring_bitwise(pools, world_size):
    # Random floats: every element is reduced in the same order by both rings (segments
    # change how the bytes travel, not the order of the additions), so the bits agree.
    for dtype in (torch.float32, torch.bfloat16):
        for numel, segment_bytes in ((1001, C.SEGMENT_BYTES), (1001, 12), (2, 12)):
            for op in ("sum", "avg", "max"):
                for r in (
                    pools[world_size]
                    .run(F.fast_vs_readable, numel, dtype, op, segment_bytes)
                    .results
                ):
                    fast, readable = r["fast"], r["readable"]
                    for a, b in zip(fast, readable):
                        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (
                            dtype,
                            numel,
                            segment_bytes,
                            op,
                        )


def test_the_readable_ring_is_short():
    import inspect

    assert len(inspect.getsource(C.ring).splitlines()) <= 110  # what lesson 01 shows


@pytest.mark.parametrize("algorithm", ["torch", "ring"])
def test_comm_collectives_and_messages_equal_torch(pools, algorithm):
    for n in (1, 3):
        for same, sent in pools[n].run(F.comm_vs_torch, algorithm).results:
            assert all(same.values()), same
            assert (sent > 0) == (n > 1)  # the ring and send/recv count their bytes
    for same, _ in pools[2].run(F.comm_vs_torch, "ring", C.SimulatedLink()).results:
        assert all(same.values()), same
    with pytest.raises(RankError, match="simulated link needs algorithm='ring'"):
        pools[2].run(F.comm_vs_torch, "torch", C.SimulatedLink())
    with pytest.raises(RankError, match="unknown algorithm 'tree'"):
        pools[2].run(F.comm_vs_torch, "tree")


def test_a_paced_action_meets_its_collectives_at_their_share(pool2):
    """`Pacer`: an action of 90 ms with two collectives inside. The first time, the pacer
    knows no collectives yet and pads at the end only; the second time it waits before
    each collective for its share (30 and 60 ms: the seconds cut evenly at the two).
    Each action lasts at least its seconds plus those blocked in its collectives. Lower
    bounds only: a busy machine can make every moment later, none earlier."""
    for first, second in pool2.run(F.paced_actions, 0.09, 2).results:
        assert second["starts"][0] >= 0.03 and second["starts"][1] >= 0.06, second
        for action in (first, second):
            assert action["end"] >= 0.09 + action["blocked"], action


def test_two_groups_messages_with_one_peer_and_tag_stay_apart(pool2):
    """Over a simulated link each message goes through a host buffer kept for its peer and
    tag; two groups (a pipeline's and tensor parallelism's) use the same small tags, so the
    buffers are kept per group too: one buffer for both gave A's receive B's bytes."""
    _, (got_a, got_b) = pool2.run(F.two_groups_one_tag).results
    assert (got_a, got_b) == ([1.0], [2.0])

"""Context parallelism: attention over a sequence cut across 2, 3 and 4 ranks equals torch's
scaled_dot_product_attention on the whole sequence in one process, outputs and gradients,
for every method, layout and mask, with sequences that divide evenly and not."""

import pytest
import torch
from cp_fns import errors_against_sdpa, ring_traffic

from parcourse import Pool, RankError
from parcourse.context_parallel import chunks_of, positions, shard_sequence, unshard_sequence


@pytest.fixture(scope="module")
def pool3():
    with Pool(3, timeout=60) as pool:
        yield pool


def test_the_cut_and_back():
    """Zigzag: 2P chunks, rank r holding chunks r and 2P - 1 - r; uneven lengths as torch
    cuts them (the first chunks a token longer); the parts put back make the whole."""
    assert [chunks_of(r, 4, "zigzag") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert positions(10, 0, 2, "zigzag").tolist() == [0, 1, 2, 8, 9]
    assert positions(10, 1, 2, "zigzag").tolist() == [3, 4, 5, 6, 7]
    x = torch.arange(2 * 13).view(1, 1, 13, 2)
    for layout in ("contiguous", "zigzag"):
        parts = [shard_sequence(x, r, 3, layout) for r in range(3)]
        assert sum(p.shape[2] for p in parts) == 13
        assert torch.equal(unshard_sequence(parts, layout), x)
    with pytest.raises(ValueError, match="cannot be cut into the 8 chunks"):
        positions(7, 0, 4, "zigzag")


@pytest.mark.parametrize("tokens", [16, 13], ids=["even", "uneven"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_method_equals_one_process(pools, pool3, world_size, tokens):
    """fp64: to 1e-10 (the same sums, merged by block: rounding of 1e-16 a step). Ulysses
    at 3 ranks needs heads that divide by 3: 12 of them."""
    pool = pool3 if world_size == 3 else pools[world_size]
    for errors in pool.run(errors_against_sdpa, tokens, torch.float64).results:
        assert len(errors) == 12
        for case, error in errors.items():
            assert error < 1e-10, (case, error)


def test_fp32_stays_within_its_rounding(pools):
    """fp32: scores and the merge in fp32, the blocks summed in another order than torch's
    single softmax: within 1e-5 of it (values and gradients of order 1)."""
    for errors in pools[4].run(errors_against_sdpa, 13, torch.float32).results:
        for case, error in errors.items():
            assert error < 1e-5, (case, error)


def test_ulysses_refuses_heads_that_do_not_divide(pool3):
    with pytest.raises(RankError, match="4 heads do not divide by 3"):
        pool3.run(errors_against_sdpa, 12, torch.float64, heads=4, methods=("ulysses",))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_rings_bytes_and_the_causal_balance(pools, layout):
    """Every message counted: P - 1 blocks of K and V forward; backward the same blocks again
    and P hops of their gradients (the last one home), the bytes
    `theory.ring_attention_bytes` says (13 tokens on 4 ranks: uneven blocks). Causal,
    the blocks the mask hides are skipped: contiguous, rank r computes r + 1 of them (rank 3
    four times rank 0's); zigzag, every rank 2P + 1 = 9 (chunk r sees r + 1 chunks, chunk
    2P - 1 - r sees 2P - r)."""
    from parcourse.theory import ring_attention_bytes

    results = pools[4].run(ring_traffic, 13, layout).results
    lengths = [r["tokens"] for r in results]
    assert sum(lengths) == 13
    for rank, r in enumerate(results):
        want = ring_attention_bytes(lengths, rank, 2 * 2 * 3 * 4 * 4)
        assert (r["forward"], r["backward"], r["messages"]) == (
            want["forward"],
            want["backward"],
            want["messages"],
        ), rank
        assert r["forward_messages"] == 3
    blocks = [r["blocks"] for r in results]
    assert blocks == ([1, 2, 3, 4] if layout == "contiguous" else [9, 9, 9, 9])


@pytest.mark.parametrize("method", ["all-gather", "ulysses"])
def test_all_gather_and_ulysses_send_the_bytes_theory_counts(pool4, method):
    """Every message of a step counted on the tracer (the course's collectives over gloo,
    built from send / recv), 13 tokens on 4 ranks (3, 3, 3 and 4, zigzag), 4 heads of 4 fp32
    numbers, batch 2: all-gather, K and V gathered padded to the longest block and their
    gradients reduce-scattered back; Ulysses, q, k, v to a head cut and the output back,
    then the same four the other way (`theory.all_gather_attention_bytes`,
    `theory.ulysses_bytes`)."""
    from parcourse.theory import all_gather_attention_bytes, ulysses_bytes

    results = pool4.run(ring_traffic, 13, "zigzag", method, heads=4).results
    lengths = [r["tokens"] for r in results]
    assert lengths == [3, 3, 3, 4]
    one = 2 * 4 * 4 * 4  # batch x heads x head dim x 4 bytes: one tensor, a token
    for rank, r in enumerate(results):
        want = (
            all_gather_attention_bytes(lengths, 2 * one)
            if method == "all-gather"
            else ulysses_bytes(lengths, rank, one)
        )
        assert (r["forward"], r["backward"], r["messages"]) == (
            want["forward"],
            want["backward"],
            want["messages"],
        ), (rank, r, want)


@pytest.mark.parametrize("method", ["ring", "all-gather", "ulysses"])
def test_each_method_traces_its_work_and_its_waits(pools, method):
    """What a timeline draws of one forward and backward on 2 ranks: attention's compute
    forward and backward; the ring's waits idle (hatched) and never under a block's rank
    (`BLOCK_KEY`, which only compute carries); all-gather's two all-gathers and two
    reduce-scatters, Ulysses' four all-to-alls each way, each with its group's ranks."""
    from parcourse.context_parallel import BLOCK_KEY
    from parcourse.experiments.context_parallel import cp_attention

    run = pools[2].run(cp_attention, 16, 4, 4, 1, method, "zigzag", True, "float32")
    for rank in range(2):
        spans = [s for s in run.trace.spans if s.rank == rank]
        assert all(s.kind == "compute" for s in spans if BLOCK_KEY in s.meta)
        compute = [s.name for s in spans if s.kind == "compute"]
        comm = [s.name for s in spans if s.kind == "comm" and s.depth == 0]
        if method == "ring":
            assert sum(n.startswith("attend to") for n in compute) == 2
            assert sum(n.startswith("back through") for n in compute) == 2
            waits = [s.name for s in spans if s.kind == "idle"]
            assert "wait for rank 1's K/V" in waits or "wait for rank 0's K/V" in waits
            assert sum("dK/dV" in n for n in waits) == 2
        elif method == "all-gather":
            assert sum(n.startswith("attend to") for n in compute) == 2
            assert sum(n.startswith("backward") for n in compute) == 1
            assert comm == [
                "all-gather K",
                "all-gather V",
                "reduce-scatter dV",
                "reduce-scatter dK",
            ]
        else:
            assert [n.split(":")[0] for n in compute] == ["forward", "backward"]
            forward = ["q to heads", "k to heads", "v to heads", "out to tokens"]
            assert comm == forward + [f"{n} grad" for n in reversed(forward)]
        grouped = [s for s in spans if s.kind == "comm" and s.depth == 0]
        assert all(s.meta.get("group") == (0, 1) for s in grouped)

"""The hierarchical all-reduce (comm/hierarchical.py) against torch's all-reduce, and the
bytes each rank sends inside its node and across nodes against the formula, at world sizes
4, 6 and 8 with 2 and 4 ranks a node; element counts that no node size divides included.
Small integers make the sums exact in any order, so "equal" is exact."""

import collective_fns as F
import pytest
import torch

from parcourse import Pool
from parcourse.theory import flat_ring_bytes_across, hierarchical_bytes

SHAPES = [(4, 2), (4, 4), (6, 2), (6, 3), (8, 2), (8, 4)]


@pytest.fixture(scope="module")
def pool_of():
    made: dict[int, Pool] = {}

    def get(n: int) -> Pool:
        if n not in made:
            made[n] = Pool(n, timeout=60)
        return made[n]

    yield get
    for pool in made.values():
        pool.close()


@pytest.mark.parametrize("numel", [1024, 1001])
@pytest.mark.parametrize(("world_size", "ranks_per_node"), SHAPES)
def test_equals_torchs_all_reduce_and_sends_the_formulas_bytes(
    pool_of, world_size, ranks_per_node, numel
):
    results = (
        pool_of(world_size)
        .run(F.hierarchical_vs_torch, ranks_per_node, numel, torch.float32, "sum")
        .results
    )
    for rank, (out, ref, (inside, across)) in enumerate(results):
        assert torch.equal(out, ref), f"rank {rank}"
        assert (inside, across) == hierarchical_bytes(
            numel * 4, world_size, ranks_per_node, rank, itemsize=4
        ), f"rank {rank}"


@pytest.mark.parametrize("op", ["max", "avg"])
def test_max_and_avg(pool_of, op):
    for out, ref, _ in pool_of(8).run(F.hierarchical_vs_torch, 4, 999, torch.float32, op).results:
        assert torch.allclose(out, ref, rtol=0, atol=1e-6)  # avg: one division, as torch


def test_a_node_size_that_does_not_divide_the_world_is_refused(pool_of):
    with pytest.raises(Exception, match="ranks_per_node=4 must be >= 1 and divide"):
        pool_of(6).run(F.hierarchical_vs_torch, 4, 16, torch.float32, "sum")


def test_fewer_bytes_cross_each_link_than_in_the_flat_ring():
    """What a node sends across nodes is about the same; each link carries an n-th of it."""
    S, N, n = 64 * 2**20, 8, 4
    across = [hierarchical_bytes(S, N, n, r)[1] for r in range(N)]
    flat = [flat_ring_bytes_across(S, N, n, r) for r in range(N)]
    assert max(across) == 2 * (N // n - 1) / (N // n) * S / n  # every rank: S/4 here
    assert max(flat) == 2 * (N - 1) / N * S  # one rank a node: 7/4 S
    assert sum(across[:n]) == pytest.approx(S) and sum(flat[:n]) == pytest.approx(1.75 * S)

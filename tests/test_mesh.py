"""The device mesh: a pure layout (no processes) checked against torch's row-major
DeviceMesh layout for every factorisation of 8 and 12, then the process groups on real
ranks."""

import itertools

import pytest
import torch
from mesh_fns import a_group_made_again, groups_on_ranks, wrong_product

from parcourse import Pool, RankError
from parcourse.mesh import ORDERS, Layout, nodes_of


def factorisations(n):
    return [
        (dp, tp, n // (dp * tp))
        for dp in range(1, n + 1)
        for tp in range(1, n + 1)
        if n % (dp * tp) == 0
    ]


def torch_groups(layout, axis):
    """How torch's DeviceMesh groups one dimension: the ranks arange(n).view(sizes) along it."""
    mesh = torch.arange(layout.world_size).view(*layout.sizes)
    dim = layout.axes.index(axis)
    return mesh.movedim(dim, -1).reshape(-1, layout.sizes[dim]).tolist()


@pytest.mark.parametrize("n", [8, 12])
@pytest.mark.parametrize("order", list(ORDERS))
def test_layout_is_torchs_for_every_factorisation(n, order):
    for dp, tp, pp in factorisations(n):
        layout = Layout.of({"dp": dp, "tp": tp, "pp": pp}, order)
        assert layout.world_size == n
        everyone = list(range(n))
        for axis in ("dp", "tp", "pp"):
            groups = layout.groups(axis)
            assert groups == torch_groups(layout, axis)
            assert sorted(r for g in groups for r in g) == everyone  # a partition of the ranks
        for a, b in itertools.combinations(("dp", "tp", "pp"), 2):
            for ga in layout.groups(a):  # two axes' groups share at most one rank ...
                assert all(len(set(ga) & set(gb)) <= 1 for gb in layout.groups(b))
            for rank in everyone:  # ... and a rank's two groups meet in it alone
                assert set(layout.group_of(rank, a)) & set(layout.group_of(rank, b)) == {rank}
        for rank in everyone:
            coords = layout.coordinates(rank)
            assert layout.rank(coords) == rank
            assert layout.group_of(rank, "tp")[coords["tp"]] == rank


def test_the_two_orders_megatron_and_llama3():
    shape = {"tp": 2, "dp": 2, "pp": 2}
    megatron = Layout.of(shape, "megatron")  # pp outermost, then dp, tp innermost
    assert megatron.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert megatron.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert megatron.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    llama3 = Layout.of(shape, "llama3")  # dp outermost, then pp, tp innermost
    assert llama3.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert llama3.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert llama3.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Flattened axes: the ranks that differ only in dp and pp.
    assert megatron.groups("dp", "pp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # With 4 ranks a node, tp stays inside one; pp crosses nodes.
    assert all(len(nodes_of(g, 4)) == 1 for g in megatron.groups("tp"))
    assert all(len(nodes_of(g, 4)) == 2 for g in megatron.groups("pp"))


def test_bad_shapes_name_the_numbers():
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        Layout.of({"xp": 2})
    with pytest.raises(ValueError, match="dp given more than once"):
        Layout(("dp", "dp"), (2, 2))
    with pytest.raises(ValueError, match="size of tp must be an int >= 1, got 0"):
        Layout.of({"tp": 0, "dp": 2})
    with pytest.raises(ValueError, match="unknown order 'zigzag'"):
        Layout.of({"dp": 2}, "zigzag")
    with pytest.raises(ValueError, match="rank 8 is not in a mesh of 8 ranks"):
        Layout.of({"dp": 8}).coordinates(8)


def test_groups_on_eight_ranks():
    shape = {"pp": 2, "dp": 2, "tp": 2}
    with Pool(8, timeout=120) as pool:
        results = pool.run(groups_on_ranks, shape, "megatron").results
    layout = Layout.of(shape)
    for rank, r in enumerate(results):
        assert r["same"]
        assert r["coords"] == {a: layout.coordinates(rank)[a] for a in shape}
        for axis in shape:
            members = layout.group_of(rank, axis)
            assert r[axis] == (float(sum(members)), members)
        pipeline = layout.group_of(rank, "pp")
        first, last = pipeline[0], pipeline[-1]
        assert r["embedding"] == (float(first + last), [first, last])
        stage = pipeline.index(rank)
        assert r["prev"] == (pipeline[stage - 1] if stage else None)
        assert r["next"] == (pipeline[stage + 1] if stage < len(pipeline) - 1 else None)
        mesh, names, groups = r["device_mesh"]
        assert mesh == layout.as_tensor().tolist() and names == layout.axes
        assert groups == {a: layout.group_of(rank, a) for a in shape}


def test_a_mesh_that_does_not_fill_the_group_says_so(pool2):
    with pytest.raises(RankError, match="the mesh dp 2 x tp 2 holds 4 ranks, the group has 2"):
        pool2.run(wrong_product)


def test_a_group_made_again_under_its_old_name_gets_its_own_groups(pool2):
    # A mesh's groups are kept per parent group's name; a destroyed group's must not be
    # handed to a new group of the same name (they raised "not initialized").
    assert pool2.run(a_group_made_again, 3).results == [[(True, 1.0)] * 3] * 2


def test_cli_prints_the_grid_and_marks_groups_across_nodes(capsys):
    from parcourse.cli import main

    assert main(["mesh", "--shape", "pp=2,dp=2,tp=2", "--ranks-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "pp 2 x dp 2 x tp 2 = 8 ranks, order megatron" in out
    assert "  pp        [0, 4]* [1, 5]* [2, 6]* [3, 7]*" in out
    assert "  tp        [0, 1] [2, 3] [4, 5] [6, 7]" in out
    assert main(["mesh", "--shape", "dp=3,tp=2", "--order", "llama3"]) == 0
    assert "  dp        [0, 2, 4] [1, 3, 5]" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["mesh", "--shape", "dp=3,tp=2", "--ranks-per-node", "4"])
    assert "ranks_per_node (4) must divide the world size (6)" in capsys.readouterr().err


def test_a_ring_across_nodes_pays_the_slow_hop(pool4):
    """2 ranks a node: the world's ring 0 -> 1 -> 2 -> 3 -> 0 crosses nodes on every other
    hop, and a chunk goes 2(N-1) = 6 hops one after the other, so the all-reduce waits at
    least 3 x 50 ms for the slow link, from the first rank's start to the last one's end
    (a rank that leaves the barrier late sees less of it); each node's own ring (2 ranks)
    pays nothing."""
    from mesh_fns import ring_times_over_a_topology

    results = pool4.run(ring_times_over_a_topology, 0.05).results
    assert max(r["span"][1] for r in results) - min(r["span"][0] for r in results) >= 3 * 0.05
    for r in results:
        assert r["node"] < 0.1  # a free link: only this machine's own time

"""Rank functions for the mesh tests (importable by name in the ranks)."""

import math

import torch
import torch.distributed as dist

from parcourse.mesh import Mesh


def groups_on_ranks(ctx, shape, order):
    """Each axis' group, as the ranks see it: the sum of their ranks over the group, the
    members torch reports, pipeline neighbours, the embedding group and the DeviceMesh."""
    mesh = Mesh(shape, ctx.group, order=order)
    again = Mesh(shape, ctx.group, order=order)  # the same groups, not new ones
    out = {
        "coords": {a: mesh.coordinate(a) for a in shape},
        "same": again.group("tp") is mesh.group("tp"),
        "prev": mesh.previous_rank,
        "next": mesh.next_rank,
    }
    for axis in (*shape, "embedding"):
        group = mesh.embedding_group if axis == "embedding" else mesh.group(axis)
        t = torch.tensor([float(ctx.rank)])
        dist.all_reduce(t, group=group)
        out[axis] = (t.item(), sorted(dist.get_process_group_ranks(group)))
    dm = mesh.device_mesh
    out["device_mesh"] = (
        dm.mesh.tolist(),
        tuple(dm.mesh_dim_names),
        {a: sorted(dist.get_process_group_ranks(dm.get_group(a))) for a in shape},
    )
    return out


def wrong_product(ctx):
    Mesh({"dp": 2, "tp": 2}, ctx.group)


def a_group_made_again(ctx, times=2):
    """A group of this rank alone made, meshed, used and destroyed `times` times: local
    synchronisation names it by its ranks, so each is a new group under the same name.
    Whether the mesh's group is the new one, and the sum its all-reduce gave, come back."""
    sums = []
    for _ in range(times):
        own = dist.new_group([ctx.rank], use_local_synchronization=True)
        mesh = Mesh({"dp": 1, "tp": 1, "pp": 1}, own)
        x = torch.ones(1)
        dist.all_reduce(x, group=mesh.group("tp"))
        dist.get_backend(mesh.group("dp"))  # raises for a destroyed group
        sums.append((mesh.group("pp") is own, x.item()))
        dist.destroy_process_group(own)
    return sums


def ring_times_over_a_topology(ctx, between_latency_s):
    """Seconds of one ring all-reduce over the world (its ring crosses nodes: 2 ranks a
    node) and over this rank's node alone, on a topology whose inside link is free; and
    when the world's started and ended here (perf_counter: one clock for every process
    on a machine), since a rank that leaves the barrier late sees less of the ring. The
    node's ring the least of three: a busy machine only adds to it."""
    import time

    from parcourse.comm import Comm, SimulatedLink, Topology

    topology = Topology(2, SimulatedLink(), SimulatedLink(latency_s=between_latency_s))
    node = dist.new_group([0, 1]), dist.new_group([2, 3])
    t = torch.ones(64)
    out = {}
    for name, group, rounds in (("world", ctx.group, 1), ("node", node[ctx.rank // 2], 3)):
        comm = Comm(group, link=topology, algorithm="ring")
        for _ in range(rounds):
            dist.barrier(group=ctx.group)
            start = time.perf_counter()
            comm.all_reduce(t)
            end = time.perf_counter()
            out[name] = min(out.get(name, math.inf), end - start)
        if name == "world":
            out["span"] = (start, end)
    return out


def nodes_crossed(ctx, shape, per_node):
    """Whether this rank's group of each axis spans more than one node."""
    mesh = Mesh(shape, ctx.group, ranks_per_node=per_node)
    return {axis: mesh.crosses_nodes(axis) for axis in shape}

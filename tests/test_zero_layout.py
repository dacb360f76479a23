"""ZeRO's flat units without ranks: the row split, packing and unpacking, each rank's part.

Every check here is exact (torch.equal): the layout only copies, it never computes.
"""

import math

import pytest
import torch
from torch import nn

from parcourse.zero.layout import FlatUnit, row_chunk

SHAPES = [(13, 7), (13,), (5, 13), (5,), (1, 3), (2, 3, 4)]  # rows no world size divides


def params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 7, 13, 16])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
def test_row_chunks_cover_the_rows_exactly_once(rows, world_size):
    bounds = [row_chunk(rows, r, world_size) for r in range(world_size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    for (_, end), (start, _) in zip(bounds, bounds[1:]):
        assert end == start  # contiguous, in rank order: no gap, no overlap
    sizes = [end - start for start, end in bounds]
    assert all(0 <= s <= math.ceil(rows / world_size) for s in sizes)
    assert sizes == sorted(sizes, reverse=True)  # the last ranks get fewer, or none


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_pack_then_unpack_gives_the_tensors_back(world_size):
    ps = params(SHAPES)
    unit = FlatUnit(0, ps, 0, world_size)
    tensors = [t.detach().clone() for t in params(SHAPES, seed=1)]
    parts = torch.full((world_size, unit.part_numel), float("nan"))
    unit.pack(tensors, parts)
    assert not parts.isnan().any()  # padding written too (zeros)
    assert unit.padded == parts.numel()
    out = torch.empty(unit.numel)
    unit.unpack(parts, into=out)
    for t, offset, size in zip(tensors, unit.full_offsets, unit.numels):
        assert torch.equal(out[offset : offset + size].view(t.shape), t)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_rank_part_holds_its_rows_and_zero_padding(world_size):
    tensors = [t.detach().clone() for t in params(SHAPES)]
    full = torch.cat([t.reshape(-1) for t in tensors])
    layout = FlatUnit(0, params(SHAPES), 0, world_size)
    parts = torch.empty(world_size, layout.part_numel)
    layout.pack(tensors, parts)
    for rank in range(world_size):
        unit = FlatUnit(0, params(SHAPES), rank, world_size)
        part = torch.full((unit.part_numel,), float("nan"))
        unit.pack_part(full, part)
        for i, t in enumerate(tensors):
            start, end = row_chunk(t.shape[0], rank, world_size)
            assert torch.equal(unit.shard_of(part, i), t[start:end])
            assert torch.equal(unit.shard_of(parts[rank], i), t[start:end])
        # master_part: the same rows, padding rows zero: exactly the packed part
        assert torch.equal(unit.master_part(), parts[rank])


@pytest.mark.parametrize("world_size", [1, 3])
def test_module_parameters_and_shards_are_views(world_size):
    ps = params(SHAPES)
    values = [p.detach().clone() for p in ps]
    unit = FlatUnit(0, ps, world_size - 1, world_size)
    for p, v, offset in zip(ps, values, unit.full_offsets):
        assert torch.equal(p, v)
        assert p.data_ptr() == unit.full[offset:].data_ptr()  # a view into `full`
    assert unit.master is unit.full  # fp32, weights whole: the master is `full` itself
    for sp, v in zip(unit.shard_params, values):
        start, end = row_chunk(v.shape[0], unit.rank, world_size)
        assert torch.equal(sp.detach(), v[start:end])
    with torch.no_grad():  # stepping a shard changes the module's parameter
        unit.shard_params[0].add_(1.0)
    start, end = row_chunk(SHAPES[0][0], unit.rank, world_size)
    assert torch.equal(ps[0][start:end], values[0][start:end] + 1)
    assert unit.stepped()


def test_sharded_weights_keep_a_master_of_their_own_and_free():
    ps = params(SHAPES)
    values = [p.detach().clone() for p in ps]
    unit = FlatUnit(0, ps, 1, 3, sharded_weights=True)
    assert unit.master is not unit.full and unit.master.numel() == unit.part_numel
    assert unit.compute_shard is unit.master  # fp32: nothing to cast
    for i, v in enumerate(values):
        start, end = row_chunk(v.shape[0], 1, 3)
        assert torch.equal(unit.shard_params[i].detach(), v[start:end])
    assert unit.gathered()
    unit.free()
    assert not unit.gathered()


def test_mixed_precision_full_is_16_bit_and_masters_fp32():
    ps = params(SHAPES)
    unit = FlatUnit(0, ps, 0, 2, compute_dtype=torch.bfloat16)
    assert unit.full.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in ps)
    assert unit.master.dtype == torch.float32
    assert all(sp.dtype == torch.float32 for sp in unit.shard_params)
    assert unit.nbytes == unit.padded * 2

"""CUDA paths: skipped without a GPU (CI has none); run them on a GPU machine."""

import pytest
import torch

from parcourse import launch
from parcourse import comm as C

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _on_gpu(ctx):
    import torch.distributed as dist

    t = torch.full((1000,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(t, group=ctx.group)
    ring = torch.full((1001,), float(ctx.rank + 1), device=ctx.device)
    C.ring_all_reduce(ring, ctx.group)  # gloo stages CUDA tensors through host memory
    sample = ctx.tracer.memory("after", other=[t, ring])
    return str(ctx.device), ctx.backend, t[0].item(), ring[-1].item(), sample.cuda is not None


def test_ranks_share_one_gpu_or_get_their_own():
    n_gpu = torch.cuda.device_count()
    run = launch(_on_gpu, 2)
    expected_backend = "nccl" if n_gpu >= 2 else "gloo"
    for rank, (device, backend, total, ring_total, has_cuda) in enumerate(run.results):
        assert device == f"cuda:{rank % n_gpu}"
        assert backend == expected_backend
        assert total == ring_total == 3.0
        assert has_cuda, "memory samples carry torch.cuda figures on a GPU"


def test_ranks_sharing_a_gpu_use_gloo():
    run = launch(_on_gpu, torch.cuda.device_count() + 1)
    assert all(r[1] == "gloo" for r in run.results)

"""CUDA paths: skipped without a GPU (CI has none); run them on a GPU machine."""

import math

import pytest
import torch

from parcourse import comm as C
from parcourse import launch

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


def _beyond_stage_3_on_gpu(ctx, options):
    """ZeRO-3 in bf16 on CUDA with these options: where each tensor lives, and the loss."""
    from torch import nn

    from parcourse import zero
    from parcourse.zero.offload import host_tensors

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256)).to(ctx.device)
    zmodel, opt = zero.shard(
        net,
        lambda ps: torch.optim.Adam(ps, lr=1e-3),
        3,
        ctx.group,
        mixed_precision=torch.bfloat16,
        **options,
    )
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(16, 256, generator=g).to(ctx.device)
    losses = []
    for _ in range(3):
        loss = zmodel(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    torch.cuda.synchronize()
    inner = getattr(opt, "optimizer", opt)
    on_host = host_tensors(zmodel, inner)
    return {
        "placement": zero.bytes_by_placement(zmodel, opt),
        "host_on_cpu": all(not t.is_cuda for t in on_host) and bool(on_host),
        "device_on_gpu": all(u.full.is_cuda for u in zmodel.units),
        "allocated": torch.cuda.memory_allocated(ctx.device),
        "losses": losses,
    }


def test_offload_puts_each_byte_where_it_says():
    """The placement counts, checked against where the tensors are: everything counted on
    the host is a CPU tensor, and with the weights offloaded too the device holds none of
    the model's bytes between steps (only what forward and backward leave: the input)."""
    plain = launch(_beyond_stage_3_on_gpu, 2, {}).results
    offloaded = launch(
        _beyond_stage_3_on_gpu, 2, {"offload_optimizer": "cpu", "offload_params": True}
    ).results
    for p, o in zip(plain, offloaded):
        assert o["host_on_cpu"] and o["device_on_gpu"]
        assert sum(o["placement"]["device"].values()) == 0
        assert o["allocated"] < p["allocated"]
        for a, b in zip(p["losses"], o["losses"]):
            assert abs(a - b) <= 1e-2 * abs(a)  # bf16 forward; CPU and GPU Adam round alike


def test_zero_pp_runs_on_gpu():
    """qwZ, hpZ and qgZ on CUDA ranks (NCCL when each rank has a GPU, else gloo staging
    through the host): the loss within 1% of plain ZeRO-3's."""
    plain = launch(_beyond_stage_3_on_gpu, 2, {}).results
    plus = launch(
        _beyond_stage_3_on_gpu,
        2,
        {
            "quantized_weights": True,
            "hpz_partition_size": 1,
            "quantized_gradients": True,
            "ranks_per_node": 1,
        },
    ).results
    for p, q in zip(plain, plus):
        for a, b in zip(p["losses"], q["losses"]):
            assert abs(a - b) <= 1e-2 * abs(a)


def test_lesson_04s_runs_beyond_stage_3_put_each_byte_on_the_gpu_or_the_host():
    """Lesson 04's runs (Offload, and Infinity with the weights offloaded) on CUDA ranks:
    the bytes on the device and on the host are the formula's, but Adam's step counters
    (4 bytes a parameter tensor on the host, which the formula leaves out); on a CPU the
    device is the host, so only a GPU shows the split."""
    from parcourse.experiments.zero_beyond import Beyond, beyond_run

    for settings in (
        Beyond(offload="cpu", dtype="bfloat16"),
        Beyond(offload="nvme", offload_params=True, dtype="bfloat16"),
    ):
        for r in launch(beyond_run, 2, settings, 200_000, 2, 2).results:
            tensors = sum(n for _, n in r["units"])  # parameter tensors
            for where in ("device", "host"):
                got = sum(r["placement"][where].values())
                want = sum(r["formula"][where].values())
                assert 0 <= got - want <= 4 * tensors, (settings.label(), where, got, want)
            assert (sum(r["placement"]["disk"].values()) > 0) == (settings.offload == "nvme")
            assert all(math.isfinite(x) for x in r["losses"])


def _tensor_parallel_on(ctx, device, checkpointed):
    """Three Adam steps of the tensor-parallel GPT (dropout on) with the model on `device`:
    the generators of its dropout are made on the weights' device and replayed when
    checkpointed blocks recompute."""
    from parcourse.checkpointing import checkpoint
    from parcourse.experiments.tensor_parallel.training import batch_for
    from parcourse.models import GPTConfig, gpt
    from parcourse.tensor_parallel import (
        GPT_PLAN,
        apply_tensor_parallel,
        vocab_parallel_cross_entropy,
    )

    config = GPTConfig(dropout=0.1)
    model = gpt(config, seed=0).to(device)
    apply_tensor_parallel(model, GPT_PLAN, ctx.group, seed=0)
    if checkpointed:
        for block in model.blocks:
            block.forward = (lambda f: lambda x: checkpoint(f, x))(block.forward)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(3):
        x, y = (t.to(device) for t in batch_for(step, 8, config))
        loss = vocab_parallel_cross_entropy(
            model(x), y, ctx.group, config.vocab, comm=model.head.comm
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_tensor_parallel_trains_on_gpu_ranks():
    """The tensor-parallel GPT trains on CUDA ranks, dropout on (its generators are made on
    the weights' device), and checkpointed blocks replay those generators when they
    recompute: the same losses as without checkpointing, bitwise."""
    plain = launch(_tensor_parallel_on, 2, "cuda", False).results
    checked = launch(_tensor_parallel_on, 2, "cuda", True).results
    assert plain == checked  # recomputation replays the dropout generators
    assert all(torch.isfinite(torch.tensor(r)).all() for r in plain)
    assert plain[0][-1] < plain[0][0]


def _reduce_on_both(ctx):
    import torch.distributed as dist

    on_cpu, on_gpu = torch.ones(3), torch.ones(3, device=ctx.device)
    dist.all_reduce(on_cpu, group=ctx.group)
    dist.all_reduce(on_gpu, group=ctx.group)
    return ctx.backend, on_cpu.tolist(), on_gpu.tolist()


def test_a_run_on_its_own_gpus_reduces_cpu_tensors_too():
    """One GPU per rank gives NCCL, with gloo beside it for CPU tensors: a loss or a count
    kept on the CPU reduces as on the GPU (NCCL alone refused them at world size 1)."""
    n = torch.cuda.device_count()
    for r in launch(_reduce_on_both, n).results:
        assert r == ("nccl", [float(n)] * 3, [float(n)] * 3)


def test_context_parallel_attention_on_gpu_ranks_equals_one_process():
    """Ring, all-gather and Ulysses attention on CUDA tensors (the blocks computed on the
    GPU, the messages through the rank's Comm): fp64, within 1e-10 of torch's
    scaled_dot_product_attention on the whole sequence, values and gradients, at 2 ranks
    with 13 tokens (uneven: 7 and 6)."""
    from cp_fns import errors_against_sdpa

    for errors in launch(errors_against_sdpa, 2, 13, torch.float64, on="rank").results:
        assert len(errors) == 12
        for case, error in errors.items():
            assert error < 1e-10, (case, error)


def _experts_on(ctx):
    """The expert-parallel layer on this rank's GPU (8 experts, top 2, 13 tokens a rank)
    against the whole layer in this process on the same GPU: the largest difference of the
    output and the input's gradient, and where the output lives."""
    from parcourse.comm import Comm
    from parcourse.experts import MoE, expert_parallel

    def layer():
        torch.manual_seed(0)
        return MoE(8, 8, 2, capacity_factor=1.0, aux_loss=0.01).to(ctx.device)

    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(13, 8, generator=g).to(ctx.device)
    whole, mine = layer(), expert_parallel(layer(), Comm(ctx.group, algorithm="auto"))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_whole, y_mine = whole(a), mine(b)
    y_whole.sum().backward()
    y_mine.sum().backward()
    return (
        float((y_whole - y_mine).abs().max()),
        float((a.grad - b.grad).abs().max()),
        str(y_mine.device),
    )


def test_expert_parallelism_on_gpu_ranks_equals_one_process():
    """Dispatch and combine of CUDA tensors (staged through the host where the ranks talk
    gloo), the experts batched on the GPU: within fp32's rounding of the whole layer."""
    for out, grad, device in launch(_experts_on, 2).results:
        assert device.startswith("cuda")
        assert out < 1e-5 and grad < 1e-5


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
def test_the_allocators_replay_of_a_gpu_step_reserves_what_torch_reserved(expandable):
    """The GPT's steps on a GPU, recorded by torch.cuda.memory._record_memory_history and
    replayed through parcourse.allocator: the most bytes the replay reserves is within 5%
    of torch.cuda.max_memory_reserved() over the same steps (the model has one stream,
    no events, addresses of its own), and its allocated peak within 5% of torch's."""
    from parcourse.allocator import replay
    from parcourse.experiments.allocator import cuda_step_trace

    step = launch(cuda_step_trace, 1, expandable_segments=expandable).results[0]
    assert step.expandable_segments == expandable and len(step.trace) > 100
    run = replay(step.trace, expandable_segments=expandable)
    assert run.at_peak().max_reserved == pytest.approx(step.max_reserved, rel=0.05)
    assert run.at_peak().allocated == pytest.approx(step.max_allocated, rel=0.05)


def _matmul_on_gpu(ctx):
    a = torch.randn(2048, 2048, device=ctx.device)
    with ctx.tracer.span("matmul"):
        a @ a
        torch.cuda.synchronize()  # the kernel has run when the span ends
    return str(ctx.device)


def test_a_profiled_gpu_run_puts_its_kernels_inside_the_course_spans(tmp_path):
    """CUDA activity on a GPU rank: torch.profiler's kernels (CUPTI's clock, which kineto
    converts to the host's wall clock) land inside the course span that launched and
    waited for them, and the merged file gives the GPU a process of its own."""
    import json

    run = launch(_matmul_on_gpu, 2, profile=True)
    for p in run.profiles:
        (span,) = run.trace.spans_of(rank=p.rank, name="matmul")
        kernels = [o for o in p.ops if o.category == "kernel"]
        assert kernels, "CUDA activity recorded"
        assert any(span.start_ns < k.start_ns and k.end_ns < span.end_ns for k in kernels)
    events = json.loads(run.to_chrome(tmp_path / "gpu.json").read_text())["traceEvents"]
    names = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    assert "rank 0" in names and any(n.startswith("rank 0: ") for n in names), names

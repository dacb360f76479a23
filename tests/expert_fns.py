"""Rank functions for the expert-parallelism tests."""

import torch
import torch.nn.functional as F

from parcourse.comm import Comm
from parcourse.data import progressions
from parcourse.experts import (
    MoE,
    Routing,
    expert_groups,
    expert_parallel,
    reduce_gradients,
    run_expert_parallel,
    set_aux_scale,
    update_bias,
)
from parcourse.models import GPTConfig, gpt
from parcourse.trace import Tracer

D = 8


def _layer(experts, top_k, score, capacity_factor, starved):
    torch.manual_seed(0)
    m = MoE(
        D,
        experts,
        top_k,
        hidden=12,
        score=score,
        capacity_factor=capacity_factor,
        aux_loss=0.05,
        z_loss=0.01,
    )
    if starved is not None:
        m.router.bias[starved] = -1e4  # never chosen: that expert receives no token
    return m


def _tokens(rank):
    """Rank r's tokens and upstream gradient: 5 + 3 r of them (uneven)."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 5 + 3 * rank
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def layer_against_one_process(ctx, experts, top_k, score, capacity_factor, starved=None):
    """The largest differences between the expert-parallel layer on this rank's tokens and
    the whole layer in one process run on every rank's tokens in turn: this rank's output,
    its input gradient, the router's gradient (summed over ranks) and the held experts'
    gradients; and the drops each saw."""
    whole = _layer(experts, top_k, score, capacity_factor, starved)
    ref_out, ref_dx, ref_drops = [], [], []
    for r in range(ctx.world_size):
        x, up = _tokens(r)
        x.requires_grad_()
        y = whole(x)
        y.backward(up)
        ref_out.append(y.detach())
        ref_dx.append(x.grad)
        ref_drops.append(whole.last.dropped)
    mine = expert_parallel(
        _layer(experts, top_k, score, capacity_factor, starved), Comm(ctx.group, algorithm="auto")
    )
    x, up = _tokens(ctx.rank)
    x.requires_grad_()
    y = mine(x)
    y.backward(up)
    router = mine.router.gate.weight.grad.clone()
    torch.distributed.all_reduce(router, group=ctx.group)
    held = slice(mine.first, mine.first + mine.local_experts)
    errors = {
        "output": float((y - ref_out[ctx.rank]).abs().max()),
        "input grad": float((x.grad - ref_dx[ctx.rank]).abs().max()),
        "router grad": float((router - whole.router.gate.weight.grad).abs().max()),
    }
    for name in ("up_weight", "up_bias", "down_weight", "down_bias"):
        errors[name] = float(
            (getattr(mine, name).grad - getattr(whole, name).grad[held]).abs().max()
        )
    return errors, mine.last.dropped, ref_drops[ctx.rank], mine.last.counts.tolist()


def _even_routing(n, experts, top_k, weight):
    """Token t to experts t, t + 1, ... (mod E): every expert chosen n k / E times."""
    chosen = (torch.arange(n)[:, None] + torch.arange(top_k)) % experts
    kept = torch.ones(n, top_k, dtype=torch.bool)
    weights = torch.full((n, top_k), weight)
    counts = torch.bincount(chosen.flatten(), minlength=experts)
    return Routing(chosen, weights, kept, counts, torch.zeros(()), torch.zeros(()))


def dispatch_then_combine(ctx, experts, top_k, tokens):
    """Dispatch and combine around experts that return their input, every weight 1/k:
    the tokens come back, exactly."""
    m = expert_parallel(MoE(D, experts, top_k), Comm(ctx.group, algorithm="auto"))
    m.experts_batched = lambda x, counts: x  # identity experts
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(tokens, D, generator=g)
    routing = _even_routing(tokens, experts, top_k, 1 / top_k)
    routing.experts = torch.randint(0, experts, (tokens, top_k), generator=g)
    out = run_expert_parallel(m, x, routing)
    return torch.equal(out, x)


def counted_bytes(ctx, experts, top_k, tokens):
    """Bytes this rank sends in one MoE layer's forward and backward (every message
    counted by the tracer), tokens routed evenly."""
    tracer = Tracer(ctx.rank)
    m = expert_parallel(MoE(D, experts, top_k), Comm(ctx.group, tracer=tracer, algorithm="ring"))
    x = torch.randn(tokens, D, requires_grad=True)
    routing = _even_routing(tokens, experts, top_k, 0.5)

    def sent():
        return sum(c.value for c in tracer.data().counters if c.name == "bytes_sent")

    out = run_expert_parallel(m, x, routing)
    forward = sent()
    out.sum().backward()
    return forward, sent() - forward


CONFIG = dict(vocab=30, block_size=8, n_layers=2, n_heads=2, d_model=16, experts=4, top_k=2)
BATCH = 8


def _batch(config):
    return progressions(BATCH, config.block_size, config.vocab)


def train_dp_ep(ctx, ep, steps=2, **changes):
    """`steps` Adam steps of a GPT with experts, data parallel over every rank, experts
    cut over ep: each rank's slice of the batch, its loss a mean over its tokens. Returns
    the whole model's weights after (experts gathered from their ep group), the losses."""
    config = GPTConfig(**{**CONFIG, **changes})
    ep_group, edp_group = expert_groups(ep, ctx.group)
    data = Comm(ctx.group, algorithm="auto")
    experts = Comm(edp_group, algorithm="auto")
    model = expert_parallel(gpt(config), Comm(ep_group, algorithm="auto"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _batch(config)
    rows = BATCH // ctx.world_size
    x, y = x[ctx.rank * rows : (ctx.rank + 1) * rows], y[ctx.rank * rows : (ctx.rank + 1) * rows]
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        reduce_gradients(model, data, experts)
        update_bias(model, data)
        opt.step()
        opt.zero_grad()
        summed = loss.detach().clone()
        torch.distributed.all_reduce(summed, group=ctx.group)
        losses.append(float(summed) / ctx.world_size)
    return _gathered(model, ep_group), losses


def _gathered(model, ep_group):
    state = {}
    size = torch.distributed.get_world_size(ep_group)
    for name, p in model.named_parameters():
        t = p.detach()
        if name.endswith(("up_weight", "up_bias", "down_weight", "down_bias")):
            parts = [torch.empty_like(t) for _ in range(size)]
            torch.distributed.all_gather(parts, t.contiguous(), group=ep_group)
            t = torch.cat(parts)
        state[name] = t
    for name, b in model.named_buffers():
        state[name] = b.clone()
    return state


def one_process(world_size, steps=2, **changes):
    """The same training in one process: each replica's slice run in turn (the routing,
    capacity and balancing losses are per slice), the loss their mean."""
    config = GPTConfig(**{**CONFIG, **changes})
    model = gpt(config)
    set_aux_scale(model, 1 / world_size)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _batch(config)
    rows = BATCH // world_size
    losses = []
    for _ in range(steps):
        total = 0.0
        for r in range(world_size):
            part = slice(r * rows, (r + 1) * rows)
            loss = F.cross_entropy(model(x[part]).flatten(0, 1), y[part].flatten())
            (loss / world_size).backward()
            total += loss.item()
        update_bias(model)
        opt.step()
        opt.zero_grad()
        losses.append(total / world_size)
    state = {n: p.detach() for n, p in model.named_parameters()}
    state.update({n: b.clone() for n, b in model.named_buffers()})
    return state, losses


def experts_that_receive_nothing(ctx):
    """Every token of every rank routed to rank 0's experts: the other ranks' experts get
    no row, and backward must still run both all-to-alls on every rank (a rank whose
    experts got nothing keeps them in the graph): finishes, the input gradient right."""
    m = expert_parallel(MoE(D, 4, 1), Comm(ctx.group, algorithm="auto"))
    m.router.bias[0] = 1e4  # expert 0 (rank 0's) chosen by every token
    x = torch.randn(6, D, requires_grad=True)
    m(x).sum().backward()
    return m.last.counts.tolist(), x.grad is not None

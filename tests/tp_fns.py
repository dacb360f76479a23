"""Rank functions for the tensor-parallel tests: each builds the single-process module
and its split copy from the same weights, runs both, and compares on the rank."""

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parcourse.comm import Comm
from parcourse.data import progressions
from parcourse.models import GPT, MLP, Block, CausalSelfAttention, GPTConfig, gpt
from parcourse.tensor_parallel import (
    ATTENTION_PLAN,
    BLOCK_PLAN,
    GPT_PLAN,
    MLP_PLAN,
    ColumnParallelLinear,
    RowParallelLinear,
    TPComm,
    TrackedDropout,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    count_collectives,
    vocab_parallel_cross_entropy,
    vocab_range,
)
from parcourse.trace import Tracer

# fp32 on gloo: a split matrix multiply adds its partial sums in another order than one
# process does, and the all-reduce adds the ranks' parts in another order again, so
# results differ in the last bits (about 1e-7 relative); atol covers values near zero.
TOL = {"rtol": 1e-5, "atol": 1e-6}
# Tiny, and every size split evenly by 2 and 4 ranks except the vocabulary (61, prime):
# shards of 31 and 16 rows, the last ones padded.
CONFIG = GPTConfig(vocab=61, block_size=8, n_layers=2, n_heads=4, d_model=16)
B, T, C = 3, CONFIG.block_size, CONFIG.d_model


def seq_chunk(t, ctx):
    """This rank's chunk of the sequence (dim 1), as sequence parallelism keeps it."""
    return t.chunk(ctx.world_size, dim=1)[ctx.rank]


def leaf(t):
    return t.detach().clone().requires_grad_()


def shard_like(module, param_name, full, rank, world_size):
    """The part of a single-process tensor (a weight or its gradient) that `module` holds."""
    vocab = isinstance(module, VocabParallelEmbedding) or (
        isinstance(module, ColumnParallelLinear) and module.vocab
    )
    if vocab:
        start, end = vocab_range(full.shape[0], rank, world_size)
        out = full.new_zeros(math.ceil(full.shape[0] / world_size), *full.shape[1:])
        out[: end - start] = full[start:end]
        return out
    if isinstance(module, ColumnParallelLinear):
        return full.chunk(world_size, 0)[rank]
    if isinstance(module, RowParallelLinear) and param_name == "weight":
        return full.chunk(world_size, 1)[rank]
    return full


def check_params(ctx, split, reference, grads=True):
    """Every parameter of the split module (and its gradient) equals its part of the
    single-process one; names stay the single-process names."""
    full = dict(reference.named_parameters())
    checked = set()
    for module_name, m in split.named_modules():
        for p_name, p in m.named_parameters(recurse=False):
            name = f"{module_name}.{p_name}" if module_name else p_name
            if id(p) in checked:
                continue
            checked.add(id(p))
            ref = full[name]
            pairs = [("value", p.detach(), ref.detach())]
            if grads:
                pairs.append(("grad", p.grad, ref.grad))
            for what, got, want in pairs:
                expected = shard_like(m, p_name, want, ctx.rank, ctx.world_size)
                torch.testing.assert_close(
                    got, expected, **TOL, msg=lambda e, n=name, w=what: f"{n} ({w}): {e}"
                )
    assert len(checked) == len({id(p) for p in reference.parameters()}), "parameters missing"


def upstream(shape, seed=1):
    """A fixed random gradient for an output, the same on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- layers


def column(ctx, gather_output, sequence_parallel):
    torch.manual_seed(0)
    linear = nn.Linear(C, 24)
    split = ColumnParallelLinear(
        copy.deepcopy(linear),
        TPComm(Comm(ctx.group)),
        gather_output=gather_output,
        sequence_parallel=sequence_parallel,
    )
    x = torch.randn(B, T, C, requires_grad=True)
    x_in = leaf(seq_chunk(x, ctx) if sequence_parallel else x)
    out, out_split = linear(x), split(x_in)
    g = upstream(out.shape)
    want_out = out if gather_output else out.chunk(ctx.world_size, -1)[ctx.rank]
    want_g = g if gather_output else g.chunk(ctx.world_size, -1)[ctx.rank]
    torch.testing.assert_close(out_split, want_out, **TOL)
    (out * g).sum().backward()
    (out_split * want_g).sum().backward()
    torch.testing.assert_close(
        x_in.grad, seq_chunk(x.grad, ctx) if sequence_parallel else x.grad, **TOL
    )
    check_params(ctx, _wrap(split), _wrap(linear))


def row(ctx, input_is_parallel, sequence_parallel):
    torch.manual_seed(0)
    linear = nn.Linear(24, C)
    split = RowParallelLinear(
        copy.deepcopy(linear),
        TPComm(Comm(ctx.group)),
        input_is_parallel=input_is_parallel,
        sequence_parallel=sequence_parallel,
    )
    x = torch.randn(B, T, 24, requires_grad=True)
    x_in = leaf(x.chunk(ctx.world_size, -1)[ctx.rank] if input_is_parallel else x)
    out, out_split = linear(x), split(x_in)
    g = upstream(out.shape)
    want_out, want_g = (seq_chunk(out, ctx), seq_chunk(g, ctx)) if sequence_parallel else (out, g)
    torch.testing.assert_close(out_split, want_out, **TOL)
    (out * g).sum().backward()
    (out_split * want_g).sum().backward()
    want_x = x.grad.chunk(ctx.world_size, -1)[ctx.rank] if input_is_parallel else x.grad
    torch.testing.assert_close(x_in.grad, want_x, **TOL)
    if sequence_parallel:  # the bias saw this rank's tokens only (apply_tensor_parallel sums it)
        dist.all_reduce(split.bias.grad, group=ctx.group)
    check_params(ctx, _wrap(split), _wrap(linear))


def vocab_embedding(ctx, sequence_parallel):
    torch.manual_seed(0)
    embedding = nn.Embedding(CONFIG.vocab, C)
    split = VocabParallelEmbedding(
        copy.deepcopy(embedding), TPComm(Comm(ctx.group)), sequence_parallel=sequence_parallel
    )
    idx = torch.randint(CONFIG.vocab, (B, T))
    out, out_split = embedding(idx), split(idx)
    g = upstream(out.shape)
    want_out, want_g = (seq_chunk(out, ctx), seq_chunk(g, ctx)) if sequence_parallel else (out, g)
    torch.testing.assert_close(out_split, want_out, **TOL)
    (out * g).sum().backward()
    (out_split * want_g).sum().backward()
    check_params(ctx, _wrap(split), _wrap(embedding))


def _wrap(m):
    """A container, so that check_params sees the layer under the name "0"."""
    return nn.Sequential(m)


# --------------------------------------------------------------------------- modules by plan

MODULES = {
    "mlp": (MLP, MLP_PLAN),
    "attention": (CausalSelfAttention, ATTENTION_PLAN),
    "block": (Block, BLOCK_PLAN),
}


def module(ctx, what, sequence_parallel):
    """The MLP, attention or a block split by its plan vs one process: output, input
    gradient, every weight and weight gradient."""
    make, plan = MODULES[what]
    torch.manual_seed(0)
    reference = make(CONFIG)
    split = apply_tensor_parallel(
        copy.deepcopy(reference), plan, ctx.group, sequence_parallel=sequence_parallel
    )
    x = torch.randn(B, T, C, requires_grad=True)
    x_in = leaf(seq_chunk(x, ctx) if sequence_parallel else x)
    out, out_split = reference(x), split(x_in)
    g = upstream(out.shape)
    want_out, want_g = (seq_chunk(out, ctx), seq_chunk(g, ctx)) if sequence_parallel else (out, g)
    torch.testing.assert_close(out_split, want_out, **TOL)
    (out * g).sum().backward()
    (out_split * want_g).sum().backward()
    torch.testing.assert_close(
        x_in.grad, seq_chunk(x.grad, ctx) if sequence_parallel else x.grad, **TOL
    )
    check_params(ctx, split, reference)


def whole_gpt(ctx, sequence_parallel, tie_weights=True):
    """The GPT to its loss: logits (this rank's vocabulary), loss, every weight gradient."""
    config = GPTConfig(**{**CONFIG.__dict__, "tie_weights": tie_weights})
    reference = gpt(config)
    split = apply_tensor_parallel(
        gpt(config), GPT_PLAN, ctx.group, sequence_parallel=sequence_parallel
    )
    x, y = progressions(B, T, config.vocab)
    logits = reference(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    logits_split = split(x)
    loss_split = vocab_parallel_cross_entropy(logits_split, y, ctx.group, config.vocab)
    start, end = vocab_range(config.vocab, ctx.rank, ctx.world_size)
    torch.testing.assert_close(logits_split[..., : end - start], logits[..., start:end], **TOL)
    torch.testing.assert_close(loss_split, loss, **TOL)
    loss.backward()
    loss_split.backward()
    check_params(ctx, split, reference)
    assert (split.head.weight is split.tok_emb.weight) == tie_weights


def accumulated(ctx, sequence_parallel, microbatches=3):
    """Gradients accumulated over microbatches (loss / m each) equal one process's on the
    whole batch: the replicated gradients of sequence parallelism are summed over ranks
    once per backward, only what that backward added."""
    reference = gpt(CONFIG)
    split = apply_tensor_parallel(
        gpt(CONFIG), GPT_PLAN, ctx.group, sequence_parallel=sequence_parallel
    )
    x, y = progressions(B * microbatches, T, CONFIG.vocab)
    F.cross_entropy(reference(x).flatten(0, 1), y.flatten()).backward()
    for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
        loss = vocab_parallel_cross_entropy(split(xm), ym, ctx.group, CONFIG.vocab)
        (loss / microbatches).backward()
    check_params(ctx, split, reference)


def adam_steps(ctx, sequence_parallel, dtype, steps=3):
    """`steps` Adam steps of the split GPT and of one process: the losses, and (when
    `dtype` is float64) the same weights.

    Why the weights in fp64: Adam divides each gradient by its own running size. The
    key projection's bias has a gradient of exactly zero (softmax does not change when
    a constant is added to a row of scores), which fp32 rounding turns into noise of
    about 1e-10, a different noise in each run, and Adam into steps of up to
    lr x noise / eps = 1e-4 x lr. In fp64 the noise is 1e-19 and the weights agree.
    """
    reference = gpt(CONFIG).to(dtype)
    split = apply_tensor_parallel(
        gpt(CONFIG).to(dtype), GPT_PLAN, ctx.group, sequence_parallel=sequence_parallel
    )
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-2)
    opt = torch.optim.Adam(split.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = progressions(B, T, CONFIG.vocab, seed=step)
        loss = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
        loss_split = vocab_parallel_cross_entropy(split(x), y, ctx.group, CONFIG.vocab)
        loss.backward()
        loss_split.backward()
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
        losses.append((loss.item(), loss_split.item()))
    if dtype == torch.float64:
        check_params(ctx, split, reference, grads=False)
    return losses


# --------------------------------------------------------------------------- cross-entropy


def cross_entropy(ctx, reduction, scale, ignore_index=-100):
    """vocab_parallel_cross_entropy on this rank's shard of random logits vs
    F.cross_entropy on all of them: value, gradient, and only three all-reduces."""
    g = torch.Generator().manual_seed(0)
    vocab, n = CONFIG.vocab, 2 * 5
    logits = (torch.randn(2, 5, vocab, generator=g) * scale).requires_grad_()
    target = torch.randint(vocab, (2, 5), generator=g)
    target[0, 1] = target[1, 3] = ignore_index
    start, end = vocab_range(vocab, ctx.rank, ctx.world_size)
    shard = logits.detach().new_zeros(2, 5, math.ceil(vocab / ctx.world_size))
    shard[..., : end - start] = logits.detach()[..., start:end]
    shard.requires_grad_()
    tracer = Tracer(ctx.rank)
    loss = F.cross_entropy(
        logits.transpose(1, 2), target, ignore_index=ignore_index, reduction=reduction
    )
    loss_split = vocab_parallel_cross_entropy(
        shard,
        target,
        ctx.group,
        vocab,
        ignore_index=ignore_index,
        reduction=reduction,
        tracer=tracer,
    )
    assert torch.isfinite(loss_split).all()
    torch.testing.assert_close(loss_split, loss, **TOL)
    w = upstream(loss.shape)
    (loss * w).sum().backward()
    (loss_split * w).sum().backward()
    torch.testing.assert_close(shard.grad[..., : end - start], logits.grad[..., start:end], **TOL)
    assert (shard.grad[..., end - start :] == 0).all(), "padding columns get no gradient"
    # Never the logits themselves: three all-reduces of one number per token.
    assert count_collectives(tracer.data().counters) == {("all_reduce", "forward"): (3, 3 * 4 * n)}


# --------------------------------------------------------------------------- dropout


def dropout(ctx, sequence_parallel):
    """With dropout on, the activations that should be whole and identical on every rank
    stay identical; the regions each dropout draws from."""
    config = GPTConfig(**{**CONFIG.__dict__, "dropout": 0.5})
    model = apply_tensor_parallel(
        gpt(config), GPT_PLAN, ctx.group, sequence_parallel=sequence_parallel, seed=3
    )
    regions = {name: m.region for name, m in model.named_modules() if isinstance(m, TrackedDropout)}
    outputs = []
    for b in model.blocks:
        b.register_forward_hook(lambda m, i, out: outputs.append(out.detach()))
    x, _ = progressions(B, T, config.vocab)
    model(x)
    # Does each replicated output agree with rank 0's? (Under sequence parallelism each
    # rank holds different tokens, so there is nothing to agree on.)
    same = []
    for out in outputs:
        first = out.clone()
        dist.broadcast(first, src=0, group=ctx.group)
        same.append(torch.equal(first, out))
    # A draw from each region's generator, from every rank.
    draws = {}
    for region in ("replicated", "sharded"):
        m = (
            next(m for m in model.modules() if isinstance(m, TrackedDropout) and m.region == region)
            if region in regions.values()
            else None
        )
        if m is not None:
            draw = torch.rand(4, generator=m.generator)
            gathered = [torch.empty(4) for _ in range(ctx.world_size)]
            dist.all_gather(gathered, draw, group=ctx.group)
            draws[region] = all(torch.equal(gathered[0], d) for d in gathered[1:])
    return regions, same, draws


# --------------------------------------------------------------------------- misuse


def bad_plan(ctx, case):
    """The ValueError a bad plan raises, and whether the model was left as it was."""
    if case == "indivisible hidden":
        model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4))
        plan = {"0": "column", "2": "row"}
    elif case == "indivisible heads":
        model = GPT(GPTConfig(vocab=16, block_size=8, n_layers=1, n_heads=3, d_model=12))
        plan = GPT_PLAN
    else:
        model = gpt(CONFIG)
        plan = {
            "no match": {**GPT_PLAN, "blocks.*.mlp.gate": "column"},
            "unknown style": {"blocks.*.mlp.up": "colum"},
            "wrong module": {"blocks.0.ln1": "column"},
            "two styles": {"blocks.0.mlp.up": "column", "blocks.*.mlp.up": "row"},
            "tied split one way": {"tok_emb": "vocab"},
            "not a plan": ["blocks.0.mlp.up"],
        }[case]
    before = [(n, type(m)) for n, m in model.named_modules()]
    try:
        apply_tensor_parallel(model, plan, ctx.group)
    except ValueError as e:
        return str(e), before == [(n, type(m)) for n, m in model.named_modules()]
    return None, False


def uneven_sequence(ctx):
    model = apply_tensor_parallel(gpt(CONFIG), GPT_PLAN, ctx.group, sequence_parallel=True)
    x, _ = progressions(B, T - 1, CONFIG.vocab)  # 7 tokens over 2 or 4 ranks
    try:
        model(x)
    except ValueError as e:
        return str(e)
    return None


# Lesson 05's exercise, g as an autograd Function: the right answer and wrong ones that the
# check must reject (it pickles them by name, so they live here).
class GoodG(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AllReduceBothWaysG(torch.autograd.Function):
    """Sums the gradient too: N times one process's."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class IdentityG(torch.autograd.Function):
    """f, not g: forward leaves the partial sums apart."""

    @staticmethod
    def forward(ctx, x, group):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class StubG(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


def frozen_before_splitting(ctx, sequence_parallel):
    """Weights of each kind of split layer (column, row, vocab embedding and its tied
    head) frozen before apply_tensor_parallel: which require a gradient after."""
    model = gpt(CONFIG)
    names = (
        "blocks.0.mlp.up.weight",
        "blocks.0.mlp.up.bias",
        "blocks.0.attn.proj.weight",
        "tok_emb.weight",
    )
    for name in names:
        model.get_parameter(name).requires_grad_(False)
    split = apply_tensor_parallel(model, GPT_PLAN, ctx.group, sequence_parallel=sequence_parallel)
    return {name: split.get_parameter(name).requires_grad for name in (*names, "head.weight")}


def after_a_failed_backward(ctx):
    """Sequence parallelism: a backward that raises half way (a hook on the embedding's
    output), then an ordinary one: its gradients against one process's."""
    reference = gpt(CONFIG)
    split = apply_tensor_parallel(gpt(CONFIG), GPT_PLAN, ctx.group, sequence_parallel=True)
    x, y = progressions(B, T, CONFIG.vocab)

    def boom(grad):
        raise RuntimeError("boom")

    def on_output(module, inputs, out):
        out.register_hook(boom)

    hook = split.tok_emb.register_forward_hook(on_output)
    try:
        vocab_parallel_cross_entropy(split(x), y, ctx.group, CONFIG.vocab).backward()
    except RuntimeError as e:
        assert "boom" in str(e)
    else:
        raise AssertionError("the backward did not raise")
    hook.remove()
    split.zero_grad(set_to_none=True)
    F.cross_entropy(reference(x).flatten(0, 1), y.flatten()).backward()
    vocab_parallel_cross_entropy(split(x), y, ctx.group, CONFIG.vocab).backward()
    check_params(ctx, split, reference)


def one_sum_over_two_backwards(ctx):
    """Sequence parallelism: two backward calls (two halves of a batch) inside `one_sum`,
    as a split backward's W makes: the replicated gradients still this rank's part
    between them, summed once at the end; then one raising inside, whose part is
    dropped, and an ordinary backward after it. Each time against one process."""
    from parcourse.tensor_parallel.replicated import one_sum

    reference = gpt(CONFIG)
    split = apply_tensor_parallel(gpt(CONFIG), GPT_PLAN, ctx.group, sequence_parallel=True)
    x, y = progressions(2 * B, T, CONFIG.vocab)
    halves = [(x[:B], y[:B]), (x[B:], y[B:])]
    for xs, ys in halves:
        F.cross_entropy(reference(xs).flatten(0, 1), ys.flatten()).backward()
    losses = [
        vocab_parallel_cross_entropy(split(xs), ys, ctx.group, CONFIG.vocab) for xs, ys in halves
    ]
    with one_sum():
        losses[0].backward()
        mine = split.ln_f.weight.grad.clone()
        every = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(every, mine, group=ctx.group)
        assert not torch.equal(every[0], every[1]), "summed before the end of one_sum"
        losses[1].backward()
    check_params(ctx, split, reference)
    split.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    try:
        with one_sum():
            vocab_parallel_cross_entropy(split(x), y, ctx.group, CONFIG.vocab).backward()
            raise RuntimeError("boom")
    except RuntimeError as e:
        assert "boom" in str(e)
    split.zero_grad(set_to_none=True)
    F.cross_entropy(reference(x).flatten(0, 1), y.flatten()).backward()
    vocab_parallel_cross_entropy(split(x), y, ctx.group, CONFIG.vocab).backward()
    check_params(ctx, split, reference)


def autograd_grad_refused(ctx):
    """Sequence parallelism: torch.autograd.grad of a replicated weight. Its error."""
    split = apply_tensor_parallel(gpt(CONFIG), GPT_PLAN, ctx.group, sequence_parallel=True)
    x, y = progressions(B, T, CONFIG.vocab)
    loss = vocab_parallel_cross_entropy(split(x), y, ctx.group, CONFIG.vocab)
    try:
        torch.autograd.grad(loss, [split.ln_f.weight])
    except RuntimeError as e:
        return str(e)
    return None


def thawed_after_splitting(ctx):
    """Sequence parallelism: ln_f frozen at the split, unfrozen after, then a forward."""
    model = gpt(CONFIG)
    model.ln_f.requires_grad_(False)
    split = apply_tensor_parallel(model, GPT_PLAN, ctx.group, sequence_parallel=True)
    split.ln_f.requires_grad_(True)
    split(progressions(B, T, CONFIG.vocab)[0])


# --------------------------------------------------------------------------- waiting drawn apart


def late_partner(ctx, late_s):
    """Two all-reduces through tensor parallelism's comm, rank 1 arriving `late_s` late to
    the first: traced, for trace.with_collective_waits."""
    import time

    from parcourse.comm import Comm
    from parcourse.tensor_parallel.comm import TPComm

    tp = TPComm(Comm(ctx.group, tracer=ctx.tracer))
    x = torch.ones(1024)
    if ctx.rank == 1:
        time.sleep(late_s)
    tp.all_reduce(x, "forward", "late")
    tp.all_reduce(x, "forward", "on time")
    return None

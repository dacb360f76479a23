"""What lesson 11 (long context) runs: attention's memory against the sequence's length,
attention over a sequence cut across ranks (`parcourse.context_parallel`) measured beside
one process's and beside the theory's bytes, the log-sum-exp merge exercise, and the
GPT trained with its sequence cut over cp."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from parcourse.comm import Comm
from parcourse.context_parallel import (
    METHODS,
    block_attention,
    context_attention,
    positions,
    shard_sequence,
)
from parcourse.context_parallel.attention import Layout, Method
from parcourse.experiments.exercises import ask
from parcourse.launch import RankContext
from parcourse.memory import PeakSavedBytes
from parcourse.models import CausalSelfAttention, GPTConfig

DTYPES = {"float64": torch.float64, "float32": torch.float32}
# How far the weights of a run over ranks may be from one process's after a few Adam steps
# (lr 1e-2), in fp64: the order of the additions differs (1e-16 relative), and Adam's
# division by sqrt(v) + 1e-8 can magnify a near-zero gradient's rounding by lr / 1e-8;
# measured below 1e-12 at 1 to 4 ranks, so 1e-9 leaves room and still catches any
# mistake (a wrong scale or a missing reduction moves weights by 1e-3 and more).
WEIGHTS_TOLERANCE = 1e-9


def attention_memory(
    tokens: Sequence[int], heads: int = 4, head_dim: int = 16, batch: int = 2
) -> list[dict[str, int]]:
    """One process, the course's GPT attention (`CausalSelfAttention.attend`, fp32): the
    bytes autograd keeps for backward over sequences of each length, and what the scores'
    softmax keeps of them (batch x heads x T x T x 4 bytes): the part that grows with T
    squared. The rest (q, k and v, 3 x batch x T x width x 4) grows with T."""
    config = GPTConfig(block_size=max(tokens), n_heads=heads, d_model=heads * head_dim)
    attention = CausalSelfAttention(config)
    rows = []
    for t in tokens:
        qkv = torch.randn(batch, t, 3 * config.d_model, requires_grad=True)
        with PeakSavedBytes(exclude=[qkv]) as saved:
            attention.attend(qkv).sum().backward()
        rows.append(
            {"tokens": t, "saved": saved.peak + qkv.nbytes, "scores": batch * heads * t * t * 4}
        )
    return rows


def cp_attention(
    ctx: RankContext,
    tokens: int,
    heads: int = 4,
    head_dim: int = 16,
    batch: int = 2,
    method: Method = "ring",
    layout: Layout = "zigzag",
    causal: bool = True,
    dtype: str = "float64",
) -> dict[str, Any]:
    """One forward and backward of attention over a sequence of `tokens` cut over these
    ranks (`context_attention`), every message through a traced `Comm` (the ring's spans
    on the run's timeline). This rank's largest difference from one process's
    `scaled_dot_product_attention` (output and the gradients of its q, k, v), the bytes it
    sent forward and backward and its messages, the activations autograd kept for it at
    the peak, its tokens, the seconds (wall clock) its ring spent attending, and the CPU
    seconds this rank's thread spent in forward (`forward_cpu_s`, `time.thread_time`: the
    attention's compute; a wait for a message costs none, nor does time spent waiting for
    a core that other work holds)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(0)
    whole = [
        torch.randn(batch, heads, tokens, head_dim, generator=g, dtype=dt, requires_grad=True)
        for _ in range(4)
    ]
    q, k, v, d_out = whole
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ref.backward(d_out)
    rank, size = ctx.rank, ctx.world_size

    def mine(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t.detach(), rank, size, layout)

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    q_mine, k_mine, v_mine = local
    comm = Comm(ctx.group, tracer=ctx.tracer, algorithm="auto")
    counted = len(ctx.tracer.data().counters)
    spans = len(ctx.tracer.data().spans)
    ctx.tracer.set_status(f"{method} attention over {tokens} tokens")
    dist.barrier(group=ctx.group)
    with PeakSavedBytes(exclude=local) as saved:
        cpu = time.thread_time_ns()
        out = context_attention(
            q_mine,
            k_mine,
            v_mine,
            ctx.group,
            tokens=tokens,
            method=method,
            layout=layout,
            causal=causal,
            comm=comm,
        )
        cpu = time.thread_time_ns() - cpu
        sent = [c.value for c in ctx.tracer.data().counters[counted:] if c.name == "bytes_sent"]
        out.backward(mine(d_out))
    every = [c.value for c in ctx.tracer.data().counters[counted:] if c.name == "bytes_sent"]
    with torch.no_grad():
        errors = [(out - mine(ref)).abs().max()]
        for a, b in zip(local, (q, k, v)):
            assert a.grad is not None and b.grad is not None  # both backwards reached them
            errors.append((a.grad - mine(b.grad)).abs().max())
    attend = [s for s in ctx.tracer.data().spans[spans:] if s.name.startswith("attend")]
    return {
        "error": float(max(errors)),
        "forward": sum(sent),
        "backward": sum(every) - sum(sent),
        "messages": len(every),
        "saved": saved.peak,
        "tokens": out.shape[2],
        "attend_s": sum(s.end_ns - s.start_ns for s in attend) / 1e9,
        "forward_cpu_s": cpu / 1e9,
        "blocks": len(attend),
    }


def causal_work(ranks: int, layout: Layout) -> list[int]:
    """Each rank's share of causal attention's work, in score blocks of (T / 2P)^2
    computed (a block on the diagonal costs a whole one): cut contiguously, rank r's
    queries see r whole slices and its own, 4 (r + 1); zigzag, chunk r sees r + 1 chunks
    and chunk 2P - 1 - r sees 2P - r, 2P + 1 on every rank."""
    if layout == "contiguous":
        return [4 * (r + 1) for r in range(ranks)]
    return [2 * ranks + 1] * ranks


# --------------------------------------------------------------------------- exercise

MergeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Any]


def _blocks(scale: float, seed: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Two blocks of keys for the same queries: (out_a, lse_a, out_b, lse_b), and what
    attention over both at once gives, (out, lse)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 5, 4, generator=g) * scale
    k, v = torch.randn(1, 2, 7, 4, generator=g), torch.randn(1, 2, 7, 4, generator=g)
    a = block_attention(q, k[:, :, :3], v[:, :, :3])
    b = block_attention(q, k[:, :, 3:], v[:, :, 3:])
    return (*a, *b), block_attention(q, k, v)


def check_merge(fn: MergeFn) -> bool:
    """Lesson 11's exercise: `fn(out_a, lse_a, out_b, lse_b)` merges two blocks' attention
    over the same queries into (out, lse) of both. Checked against attention over both
    blocks at once, on ordinary scores and on scores large enough that exp(lse) overflows
    fp32. Prints one short verdict, naming the mistake when it is a common one."""
    for scale, what in ((1.0, ""), (60.0, " on scores near 1000, where exp(lse) overflows")):
        given, want = _blocks(scale, seed=1)
        ok, got = ask(fn, *(t.clone() for t in given), hint=_merge_error_hint)
        if not ok:
            return False
        if problem := _merge_shape_problem(got, *want):
            print(f"Not yet: {problem}")
            return False
        out, lse = got
        if _near(out, want[0]) and _near(lse, want[1]):
            continue
        print(f"Not yet: {_merge_mistake(out, lse, given, want, what)}.")
        return False
    print(
        "Right: the two blocks merge into attention over all their keys, also where "
        "exp(lse) alone would overflow."
    )
    return True


def _near(x: torch.Tensor, y: torch.Tensor) -> bool:
    return bool(torch.allclose(x.to(y.dtype), y, rtol=1e-4, atol=1e-5))


def _merge_shape_problem(got: object, want_out: torch.Tensor, want_lse: torch.Tensor) -> str | None:
    """What is wrong with a merge's result before its values: not two tensors, or not
    the shapes of out_a and lse_a."""
    if not (
        isinstance(got, tuple | list)
        and len(got) == 2
        and all(isinstance(t, torch.Tensor) for t in got)
    ):
        return f"return two tensors, (out, lse); got {type(got).__name__}." + (
            " Hint: a missing `return`?" if got is None else ""
        )
    out, lse = got
    if out.shape != want_out.shape or lse.shape != want_lse.shape:
        return (
            f"out should keep out_a's shape {tuple(want_out.shape)} and lse "
            f"lse_a's {tuple(want_lse.shape)}; got {tuple(out.shape)} and "
            f"{tuple(lse.shape)}."
        )
    return None


def _merge_mistake(
    out: torch.Tensor,
    lse: torch.Tensor,
    given: tuple[torch.Tensor, ...],
    want: tuple[torch.Tensor, ...],
    what: str,
) -> str:
    """The common mistake a wrong merge's values show, in one sentence."""
    out_a, lse_a, out_b, lse_b = given
    want_out, want_lse = want
    finite = bool(torch.isfinite(out).all() and torch.isfinite(lse).all())
    if not finite and what:
        return (
            f"the result has inf or nan{what} fp32. Weigh each block by "
            "exp(lse_a - lse), where lse = torch.logaddexp(lse_a, lse_b): neither "
            "exponent is then above 0"
        )
    if not finite:
        return (
            "the result has inf or nan on ordinary scores, where nothing overflows: "
            "look for a log of a negative number or a division by zero. lse = "
            "torch.logaddexp(lse_a, lse_b); each block's weight exp(lse_a - lse)"
        )
    if _near(out, out_a + out_b):
        return (
            "you added the outputs without rescaling: each block's output is "
            "normalised over its own keys only; weigh it by its share of both "
            "softmax sums, exp(lse_a - lse)"
        )
    if _near(out, (out_a + out_b) / 2):
        return (
            "you averaged the outputs: a block's weight is its share of both softmax "
            "sums, exp(lse_a - lse), not one half"
        )
    if _near(out, want_out) and _near(lse, lse_a + lse_b):
        return (
            "the output is right; the lse of both is log(exp(lse_a) + exp(lse_b)), "
            "torch.logaddexp(lse_a, lse_b), not lse_a + lse_b"
        )
    if _near(out, want_out) and _near(lse, torch.maximum(lse_a, lse_b)):
        return (
            "the output is right; the lse of both is torch.logaddexp(lse_a, lse_b): "
            "the larger one alone drops the other block's sum"
        )
    if _near(out, want_out):
        return "the output is right, the lse is not: torch.logaddexp(lse_a, lse_b)"
    diff = float((out.to(want_out.dtype) - want_out).abs().max())
    return (
        f"the merged output differs from attention over both blocks by {diff:.3g}"
        f"{what}. Hint: lse = torch.logaddexp(lse_a, lse_b); out = out_a x "
        "exp(lse_a - lse) + out_b x exp(lse_b - lse), the weights per query "
        "(unsqueeze them over the head dim)"
    )


def _merge_error_hint(error: Exception) -> str | None:
    """What a merge that raised most likely forgot: the weights are one number per
    query, the outputs have one more dim."""
    if isinstance(error, RuntimeError) and "must match the size" in str(error):
        return (
            "the weights exp(lse_a - lse) have one number per query, (batch, heads, "
            "queries), the outputs one more dim (head_dim): weigh with weight[..., None]"
        )
    return None


# --------------------------------------------------------------------------- the GPT


def cp_training(
    ctx: RankContext,
    method: Method = "ring",
    steps: int = 3,
    tokens: int = 32,
    dtype: str = "float64",
) -> dict[str, Any]:
    """The course's GPT in `dtype` trained `steps` Adam steps with each sequence cut over
    these ranks (a mesh of cp = world size, `Hybrid`), and the same in one process: both
    runs' losses and the largest difference of their weights. fp64 by default: the two
    runs add the same numbers in another order, and Adam divides each step by
    sqrt(v) + 1e-8, so a weight whose gradient is near zero moves by up to lr whatever
    that gradient's rounding; fp32's rounding (1e-7 relative) then shows in the weights
    at 1e-5 to 1e-4, fp64's (1e-16) below 1e-10 (`WEIGHTS_TOLERANCE`)."""
    import torch.nn.functional as F

    from parcourse.data import progressions
    from parcourse.hybrid import Hybrid
    from parcourse.mesh import Mesh
    from parcourse.models import gpt

    config = GPTConfig(vocab=64, block_size=tokens, n_layers=2, n_heads=4, d_model=32)
    model = Hybrid(
        gpt(config).to(DTYPES[dtype]),
        Mesh({"cp": ctx.world_size}, ctx.group),
        cp_method=method,
        microbatches=1,
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
    )
    one = gpt(config).to(DTYPES[dtype])
    opt = torch.optim.Adam(one.parameters(), lr=1e-2)
    x, y = progressions(8, tokens, config.vocab)
    ours, theirs = [], []
    for step in range(steps):
        ctx.tracer.set_status(f"step {step + 1} of {steps}")
        ours.append(model.step(x, y))
        loss = F.cross_entropy(one(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        theirs.append(loss.item())
    whole = model.full_state_dict()
    diff = max(float((whole[k] - v).abs().max()) for k, v in one.state_dict().items())
    return {
        "losses": ours,
        "one_process": theirs,
        "weights_diff": diff,
        "tokens": len(positions(tokens, ctx.rank, ctx.world_size, "zigzag")),
    }

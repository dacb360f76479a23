"""Lesson 11, long context: the bytes a rank sends in one step of ring attention, of
all-gather attention (Llama 3's) and of Ulysses attention, and what ring attention keeps
for backward.
"""

from __future__ import annotations


def ring_attention_bytes(
    lengths: list[int], rank: int, bytes_per_token: int, grad_bytes_per_token: int | None = None
) -> dict[str, int]:
    """Theory: bytes `rank` sends in one step of ring attention (pass-KV, with flash
    attention's backward over the ring), its ring holding `lengths` tokens on each rank, K
    and V together `bytes_per_token` a token (2 x batch x heads x head dim x element size;
    their gradients `grad_bytes_per_token`, in the dtype they are summed in: the same by
    default). Forward: P - 1 messages, the blocks of ranks rank, rank - 1, ...,
    rank - P + 2 passed on (each the one received the step before). Backward: the same
    P - 1 blocks again, and P messages of the gradient of the block held at each step,
    the last one taking each block's gradient home."""
    p = len(lengths)
    grad = bytes_per_token if grad_bytes_per_token is None else grad_bytes_per_token
    passed = sum(lengths[(rank - s) % p] for s in range(p - 1))
    gradients = sum(lengths[(rank - s) % p] for s in range(p)) if p > 1 else 0
    return {
        "forward": passed * bytes_per_token,
        "backward": passed * bytes_per_token + gradients * grad,
        "messages": 2 * (p - 1) + (p if p > 1 else 0),
    }


def all_gather_attention_bytes(lengths: list[int], bytes_per_token: int) -> dict[str, int]:
    """Theory: bytes each rank sends in one step of all-gather attention (Llama 3's), its
    group holding `lengths` tokens on each rank, K and V together `bytes_per_token` a token.
    Forward: K and V each gathered by a ring, every block padded to the longest: P - 1
    messages of it each. Backward: their gradients summed back to their owners, a
    reduce-scatter of the same sizes. The same on every rank, whatever its own share."""
    p = len(lengths)
    moved = (p - 1) * max(lengths) * bytes_per_token
    return {"forward": moved, "backward": moved, "messages": 4 * (p - 1)}


def ulysses_bytes(lengths: list[int], rank: int, bytes_per_token: int) -> dict[str, int]:
    """Theory: bytes `rank` sends in one step of Ulysses attention, its group holding
    `lengths` tokens on each rank; `bytes_per_token`: one of q, k, v or the output, a token
    (batch x heads x head dim x element size). Forward: q, k and v each go from a sequence
    cut to a head cut (this rank's tokens, 1/P of the heads, to each of the P - 1 others),
    then the output back (the others' tokens, this rank's heads); backward the same four
    the other way. Per link 4 N h / P against sequence parallelism's 4 N h (Jacobs et al.)."""
    p = len(lengths)
    mine = (p - 1) * lengths[rank] * bytes_per_token // p  # a sequence cut, sent
    theirs = (sum(lengths) - lengths[rank]) * bytes_per_token // p  # a head cut, sent
    return {"forward": 3 * mine + theirs, "backward": 3 * theirs + mine, "messages": 8 * (p - 1)}


def ring_attention_kept(
    tokens_here: int, batch: int, heads: int, head_dim: int, element_size: int = 4
) -> dict[str, int]:
    """Theory: bytes ring attention keeps for backward on a rank holding `tokens_here`
    tokens, beyond its q, k and v (which the layer before keeps anyway): its output and
    one log-sum-exp per query and head, in the dtype the blocks are summed in
    (`element_size`: 4 for fp32 and 16-bit inputs, 8 for fp64). No scores, no other rank's
    block: flash attention's backward over the ring rebuilds them."""
    rows = batch * heads * tokens_here
    return {
        "output": rows * head_dim * element_size,
        "lse": rows * element_size,
        "total": rows * (head_dim + 1) * element_size,
    }

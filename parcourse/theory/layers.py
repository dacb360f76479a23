"""What one layer of the GPT computes and moves, layer by layer as the pipeline cuts it (0
the embeddings, 1..L the blocks, L + 1 the head): its forward FLOPs, the bytes its
memory-bound work reads and writes, and the bytes it holds (parameters, and the activations
it keeps for backward: fp32 as the course runs it, 16-bit as Korthikanti et al. count them).
The planner (`parcourse.planner`, lesson 09) prices each stage from them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from parcourse.theory.experts import expert_bytes, moe_activation_bytes
from parcourse.theory.tensor_parallel import tp_activation_bytes

if TYPE_CHECKING:
    from parcourse.models import GPTConfig


# -- what a layer computes


def gpt_layer_flops(config: GPTConfig, layer: int, tokens: int) -> float:
    """Theory: forward FLOPs of one layer of the GPT (0 the embeddings, 1..n the blocks,
    n + 1 the head) for `tokens` tokens (2 per multiply-add; attention's
    two matrix products over the whole sequence; with experts, each token's top_k
    experts and the router, `moe_flops`)."""
    c, t = config.d_model, config.block_size
    if layer == 0:
        return 0.0
    if layer <= config.n_layers and config.experts:  # attention, and `moe_flops`
        return tokens * (2 * 4 * c * c + 2 * 2 * t * c) + moe_flops(config, layer, tokens)
    if layer <= config.n_layers:
        return tokens * (2 * 12 * c * c + 2 * 2 * t * c)
    return tokens * 2 * c * config.vocab


def moe_flops(config: GPTConfig, layer: int, tokens: int) -> float:
    """Theory: of `gpt_layer_flops`, a MoE block's router and experts (forward, `tokens`
    tokens each through top_k experts): 2 C E + top_k x 16 C^2 a token; what tensor
    parallelism does not cut (each tp rank runs the experts whole)."""
    if not config.experts or not 1 <= layer <= config.n_layers:
        return 0.0
    c = config.d_model
    return tokens * (2 * c * config.experts + config.top_k * 2 * 8 * c * c)


def attention_flops(config: GPTConfig, layer: int, tokens: int) -> float:
    """Theory: attention's core (scores and their weighted sum): what selective recompute redoes."""
    return (
        tokens * 2 * 2 * config.block_size * config.d_model
        if 1 <= layer <= config.n_layers
        else 0.0
    )


# -- what its memory-bound work reads and writes


def gpt_layer_traffic(
    config: GPTConfig, layer: int, tokens: int, tp: int, sequence_parallel: bool, number: int
) -> float:
    """Theory: bytes one layer's memory-bound work reads and writes in its forward, on one
    of `tp` ranks, for `tokens` tokens of `number` bytes a number (a dropout mask: 1 a number),
    counted as Megatron-LM runs it, its elementwise kernels fused: in a block, two layer
    norms (read the stream, write it), two bias + dropout + residual adds (read the
    branch and the stream, write the stream, and the mask), bias + GeLU (read and write
    the MLP's 4h), and attention's scale + mask + softmax (read and write the a x s
    scores a token) and their dropout (read, write, the mask); the embeddings' sum (read
    two, write one) and dropout; the head's final layer norm and its loss over the
    logits, in fp32 as Megatron-LM's default computes it (the logits cast: read, write
    4 bytes; then its vocabulary-parallel cross-entropy, unfused: the max, minus it,
    exp, sum, divide: 8 reads and writes a logit). The tp-cut parts (MLP, heads,
    logits) a `tp`-th, and the stream's too under sequence parallelism. The matrix
    products' own reads are theirs (`achievable`)."""
    h = config.d_model
    mask = 1 if config.dropout > 0 else 0
    stream = 1 / tp if sequence_parallel else 1.0
    if layer == 0:
        return tokens * stream * h * (3 * number + mask * (2 * number + 1))
    if layer <= config.n_layers:
        norms = 2 * 2 * h * number
        adds = 2 * (3 * h * number + mask * h)
        return tokens * (stream * (norms + adds) + 8 * h * number / tp) + attention_traffic(
            config, layer, tokens, tp, number
        )
    return tokens * (stream * 2 * h * number + (number + 4 + 8 * 4) * config.vocab / tp)


def attention_traffic(config: GPTConfig, layer: int, tokens: int, tp: int, number: int) -> float:
    """Of `gpt_layer_traffic`, attention's core (softmax and its dropout, over the a x s
    scores a token): what selective recompute runs again."""
    if not 1 <= layer <= config.n_layers:
        return 0.0
    mask = 1 if config.dropout > 0 else 0
    return tokens * config.n_heads * config.block_size * (2 * number + mask * (2 * number + 1)) / tp


# -- what it holds


def gpt_layer_bytes(
    config: GPTConfig,
    layer: int,
    tp: int = 1,
    *,
    batch: int = 1,
    sequence_parallel: bool = False,
    pipelined: bool = False,
    seq: int | None = None,
    ring: bool = False,
    ep: int = 1,
) -> dict[str, int]:
    """Theory, layer by layer: fp32 bytes of one layer of the course's GPT on a rank of a
    tp group, as the pipeline cuts it (`gpt_layers`: layer 0 the embeddings, 1..L the
    blocks, L + 1 ln_f, the head and the loss): its parameters, and what autograd keeps
    for backward for one microbatch of `batch` sequences (`tp_activation_bytes`' count,
    layer by layer, plus the loss's own).

    The loss keeps the softmax (or log-softmax) of this rank's logits, the targets
    (int64) and, vocabulary-parallel (tp > 1), the target masks and the count the mean
    divides by. `pipelined`: the head is on another stage than the embedding, so a tied
    head holds its own copy of the weight (Megatron-LM's embedding group). "loss": the
    part of "activations" the loss keeps (0 but on the last layer), which a stage
    recomputed in backward still holds: the loss runs after the checkpointed stage.
    `seq`: the tokens a rank holds of each sequence (the block size by default; fewer
    when context parallelism cuts it), `ring`: its attention the ring's
    (`tp_activation_bytes`). With experts (`config.experts`), a block's MLP is a mixture
    of experts, whole on every tp rank: its router and experts / `ep` experts, and what
    it keeps routed evenly (`moe_activation_bytes`) in place of the MLP's GeLU input and
    output."""
    if not 0 <= layer <= config.n_layers + 1:
        raise ValueError(f"layer {layer} is not one of the GPT's {config.n_layers + 2}")
    c, n, t, b = config.d_model, tp, config.block_size if seq is None else seq, batch
    vocab_rows = math.ceil(config.vocab / n) * c
    per_block_params = ((3 * c * c + 3 * c) + c * c + (4 * c * c + 4 * c) + 4 * c * c) // n + (
        2 * 2 * c + c + c
    )  # split; LayerNorms and the row-parallel layers' biases
    acts = tp_activation_bytes(
        dataclasses.replace(config, n_layers=1), b, t, n, sequence_parallel, ring
    )
    block_acts = acts["total"] - acts["embeddings, ln_f, head"]
    if config.experts:  # attention split, the norms and proj's bias, router, experts
        per_block_params = (
            (3 * c * c + 3 * c + c * c) // n
            + 2 * 2 * c
            + c
            + c * config.experts
            + expert_bytes(config, ep, 1)["params"] // config.n_layers
        )
        block_acts += moe_activation_bytes(config, b * t, ep) - 4 * b * t * (c // n) * 8
    cut = n if sequence_parallel else 1
    stream = b * (t // cut) * c
    drop = config.dropout > 0
    layer_norm = 4 * stream + 2 * 4 * b * (t // cut)
    tokens = b * t
    loss = 0
    if layer == 0:
        params = vocab_rows + config.block_size * c  # the position embedding: every position
        held = tokens * (8 + 1) + 8 * t + (stream if drop else 0)
    elif layer <= config.n_layers:
        params, held = per_block_params, block_acts
    else:
        head = vocab_rows if (not config.tie_weights or pipelined) else 0
        params = 2 * c + head
        loss = 4 * tokens * math.ceil(config.vocab / n) + 8 * tokens
        loss += 2 * tokens + 8 if n > 1 else 4  # masks and the count; nll's total weight
        held = layer_norm + 4 * tokens * c + loss
    return {"params": 4 * params, "activations": held, "loss": loss}


def korthikanti_layer_bytes(
    config: GPTConfig,
    layer: int,
    tp: int = 1,
    *,
    batch: int = 1,
    sequence_parallel: bool = False,
    pipelined: bool = False,
    selective: bool = False,
) -> dict[str, float]:
    """Theory for 16-bit training, layer by layer as `gpt_layer_bytes` (whose "params",
    fp32 bytes of the layer's numbers, it shares): the activations one microbatch keeps,
    from Korthikanti et al. 2022 (arXiv:2205.05198, Table 2) with s the sequence, b the
    microbatch, h the width, a the heads, t the tensor-parallel size. A block keeps
    sbh(10 + 24/t + 5as/(ht)) bytes, sbh(34/t + 5as/(ht)) under sequence parallelism (the
    paper's 34sbh + 5as^2b without parallelism, 10sbh of it not split by tp); the
    embeddings their dropout mask (sbh, / t under sequence parallelism) when dropout is
    on; the last layer ln_f's input and the head's (4sbh, / t under sequence parallelism)
    and the loss's fp32 logits (4sbv / t, sec. 4.3). `selective`: attention's core is
    recomputed in backward, so its 5as^2b term is not kept (sec. 5). "loss": the logits'
    part, as in `gpt_layer_bytes`."""
    s, b, h, a, t = config.block_size, batch, config.d_model, config.n_heads, tp
    params = gpt_layer_bytes(config, layer, tp, pipelined=pipelined)["params"]
    cut = t if sequence_parallel else 1
    loss = 0.0
    if layer == 0:
        held = s * b * h / cut if config.dropout > 0 else 0.0
    elif layer <= config.n_layers:
        attention = 0.0 if selective else 5 * a * s * s * b / t
        held = (34 * s * b * h / t if sequence_parallel else s * b * h * (10 + 24 / t)) + attention
    else:
        loss = 4 * s * b * config.vocab / t
        held = 4 * s * b * h / cut + loss
    return {"params": params, "activations": held, "loss": loss}

"""Small models for the lessons: an MLP and a small GPT. Nothing here knows about
distribution."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

# parcourse.experts imports torch.distributed: a model imports it only when it has experts.
if TYPE_CHECKING:
    from parcourse.experts.routing import Score


def mlp(
    d_in: int, d_hidden: int, d_out: int, depth: int = 2, seed: int | None = 0
) -> nn.Sequential:
    """Linear -> ReLU -> ... -> Linear with `depth` linear layers.

    `seed` gives every rank the same initial weights (None: drawn from the global RNG).
    It seeds this model only: the caller's random state is the same afterwards.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    if seed is None:
        return _layers(d_in, d_hidden, d_out, depth)
    # nn.Linear initialises from torch's global CPU generator, so seed that one inside
    # fork_rng, which puts the caller's state back afterwards (devices=[]: CPU only,
    # never initialising CUDA).
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return _layers(d_in, d_hidden, d_out, depth)


def _layers(d_in: int, d_hidden: int, d_out: int, depth: int) -> nn.Sequential:
    dims = [d_in] + [d_hidden] * (depth - 1) + [d_out]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers.append(nn.Linear(a, b))
        if i < depth - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- a small GPT


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT-2-style decoder (Radford et al. 2019; nanoGPT's layout).

    `dropout` applies to the embeddings, the attention probabilities and each
    residual branch; `tie_weights` shares the token embedding with the LM head,
    as GPT-2 does.

    `experts` > 0 makes every block's MLP a mixture of experts (parcourse.experts.MoE):
    each token through its `top_k` of `experts` MLPs of the dense one's shape, chosen by
    a `router` ("softmax" or "sigmoid"), at most `capacity_factor` x its share of tokens
    an expert (None: dropless), trained with `aux_loss` x Switch's balancing loss and
    `z_loss` x the router z-loss, and balanced without a loss by a bias moved by
    `bias_rate` (0: off).
    """

    vocab: int = 64
    block_size: int = 32
    n_layers: int = 2
    n_heads: int = 4
    d_model: int = 64
    dropout: float = 0.0
    tie_weights: bool = True
    experts: int = 0
    top_k: int = 2
    router: Score = "softmax"
    capacity_factor: float | None = None
    aux_loss: float = 0.01
    z_loss: float = 0.0
    bias_rate: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab", "block_size", "n_layers", "n_heads", "d_model"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.experts, bool) or not isinstance(self.experts, int) or self.experts < 0:
            raise ValueError(f"experts must be an int >= 0 (0: a dense MLP), got {self.experts!r}")
        if self.experts:
            from parcourse.experts.routing import check_routing

            check_routing(
                self.experts, self.top_k, self.router, self.capacity_factor, self.bias_rate
            )
            if self.aux_loss < 0 or self.z_loss < 0:
                raise ValueError(
                    f"aux_loss and z_loss must be >= 0, got {self.aux_loss}, {self.z_loss}"
                )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# Trains in a few seconds on one laptop core: 0.1 M parameters.
TINY = GPTConfig()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention, written out (no fused kernel) so that each
    tensor autograd keeps for backward can be counted.

    `qkv` is one Linear whose output rows go head by head, [q k v] of head 0, then of
    head 1, ... (Megatron's layout, arXiv:1909.08053 sec. 3): a contiguous block of
    its rows is whole heads, so splitting them by rows splits the heads. The forward
    counts heads from the tensor (`-1`), not from the config, so it runs unchanged
    on a rank's share of them (torchtitan's attention does the same).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.attn_drop = nn.Dropout(config.dropout)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.attend(self.qkv(x)))

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """The core, from q, k and v (B, T, 3 C) to the heads' outputs (B, T, C): what
        Megatron's selective recomputation checkpoints (its saved tensors grow with T^2)."""
        B, T, _ = qkv.shape  # the shapes of what attention works on: the projection's output
        hd = self.head_dim
        q, k, v = qkv.view(B, T, -1, 3 * hd).split(hd, dim=-1)  # each (B, T, h, hd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, T, hd)
        att = (q @ k.transpose(-2, -1)) * hd**-0.5  # (B, h, T, T)
        # Adding -inf above the diagonal saves nothing for backward (masked_fill keeps its mask).
        causal = torch.full((T, T), float("-inf"), device=qkv.device, dtype=qkv.dtype).triu(1)
        att = self.attn_drop((att + causal).softmax(dim=-1))
        return (att @ v).transpose(1, 2).reshape(B, T, -1)  # (B, T, h * hd)


class MLP(nn.Module):
    """Linear up to 4 x d_model, GELU, Linear down."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, 4 * config.d_model)
        self.down = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


def _moe(config: GPTConfig) -> nn.Module:
    from parcourse.experts.layer import MoE

    return MoE(
        config.d_model,
        config.experts,
        config.top_k,
        4 * config.d_model,
        config.router,
        config.capacity_factor,
        config.aux_loss,
        config.z_loss,
        config.bias_rate,
    )


class Block(nn.Module):
    """Pre-LayerNorm transformer block. The residual branches' dropout lives here, not
    inside attention or the MLP, so that everything inside those two runs between
    their first and last Linear (what tensor parallelism splits)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config) if not config.experts else _moe(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Token + position embedding, `n_layers` blocks, final LayerNorm, LM head.

    `model(idx)` maps token ids (B, T) to logits (B, T, vocab).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok_emb.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2: N(0, 0.02) everywhere, the residual projections scaled by 1/sqrt(2 L)
        # so that the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = (
                    0.02 / (2 * self.config.n_layers) ** 0.5
                    if name.endswith(("attn.proj.weight", "mlp.down.weight", "mlp.down_weight"))
                    else 0.02
                )
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        if length > self.config.block_size:
            raise ValueError(
                f"sequence of {length} tokens, longer than block_size {self.config.block_size}"
            )
        positions = torch.arange(length, device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def gpt(config: GPTConfig = TINY, seed: int | None = 0) -> GPT:
    """A GPT with GPT-2's initialisation; `seed` as for `mlp` (the caller's RNG is left
    as it was)."""
    if seed is None:
        return GPT(config)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return GPT(config)


class GPTEmbedding(nn.Module):
    """A GPT's first layer as a module of its own: token and position embeddings (the
    model's own modules, shared), then dropout. Token ids (B, T) -> (B, T, C).

    `positions(idx)`, if set, gives the positions of `idx`'s tokens in the whole
    sequence (context parallelism: this rank holds some of them); by default 0..T-1."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.block_size = model.config.block_size
        self.positions: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[1] > self.block_size:
            raise ValueError(
                f"sequence of {idx.shape[1]} tokens, longer than block_size {self.block_size}"
            )
        positions = (
            torch.arange(idx.shape[1], device=idx.device)
            if self.positions is None
            else self.positions(idx)
        )
        return self.drop(self.tok_emb(idx) + self.pos_emb(positions))


class GPTHead(nn.Module):
    """A GPT's last layer: final LayerNorm and LM head. (B, T, C) -> logits."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def gpt_layers(model: GPT) -> list[nn.Module]:
    """The GPT as a chain of layers that compute what `model` computes, sharing its
    parameters: embedding, each block, head. What a pipeline cuts into stages; with
    tied weights, the embedding's and the head's are one Parameter."""
    return [GPTEmbedding(model), *model.blocks, GPTHead(model)]

"""Linear layers and embeddings split over a tensor-parallel group (Megatron-LM,
Shoeybi et al., arXiv:1909.08053, sec. 3).

Y = X A with A split by columns, A = [A_1 ... A_N]: rank r computes Y_r = X A_r,
some of the output features, from the whole input (column-parallel). Split by
rows instead, A = [A_1; ...; A_N], and X by columns to match: rank r computes
X_r A_r, a partial sum of the whole output, and the ranks add theirs
(row-parallel). A column-parallel layer followed by a row-parallel one needs no
communication in between: the column layer's output features are exactly the
row layer's input rows. That is Megatron's MLP and attention.

Each layer is built from the full single-process module and keeps only this
rank's part of its weights, so the split model starts from exactly the
single-process weights. nn.Linear keeps its weight as (out_features, in_features):
column-parallel keeps a block of its rows, row-parallel a block of its columns.
Parameter names stay those of the module replaced (`weight`, `bias`), so a
state_dict has the single-process keys, with this rank's shards as values.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from parcourse.comm import chunk_bounds
from parcourse.tensor_parallel.comm import (
    TPComm,
    copy_to_tp,
    gather_last_dim,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    split_last_dim,
)


def _chunk(t: torch.Tensor, dim: int, comm: TPComm) -> torch.Tensor:
    return t.detach().chunk(comm.size, dim)[comm.rank].clone()


def vocab_range(vocab: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rank `rank` holds: ceil(vocab / N) rows each, the
    last ranks fewer (their shards are padded to the same size), as Megatron's
    VocabUtility cuts a vocabulary padded to a multiple of N."""
    return chunk_bounds(vocab, world_size, "chunk")[rank]


def _vocab_shard(weight: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """This rank's rows of a (vocab, C) weight, padded with zero rows to ceil(vocab / N)."""
    vocab = weight.shape[0]
    start, end = vocab_range(vocab, comm.rank, comm.size)
    shard = weight.new_zeros(math.ceil(vocab / comm.size), *weight.shape[1:])
    shard[: end - start] = weight.detach()[start:end]
    return shard


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r: this rank's block of output features, from the whole input.

    Input: (..., in_features), whole on every rank; under sequence parallelism
    (B, T / N, in_features), this rank's chunk of the sequence. Output:
    (..., out_features / N), or (..., out_features) with `gather_output`.

    `vocab=True` (an LM head over a vocabulary that N need not divide): shards of
    ceil(out_features / N) rows, padded with zero rows (see `vocab_range`).
    """

    def __init__(
        self,
        linear: nn.Linear,
        comm: TPComm,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        vocab: bool = False,
        name: str = "",
    ) -> None:
        super().__init__()
        out_features = linear.out_features
        if not vocab and out_features % comm.size:
            raise ValueError(
                f"{name or 'ColumnParallelLinear'}: {out_features} output features "
                f"cannot be split over {comm.size} ranks"
            )
        self.in_features, self.out_features = linear.in_features, out_features
        self.comm, self.name = comm, name
        self.gather_output, self.sequence_parallel, self.vocab = (
            gather_output,
            sequence_parallel,
            vocab,
        )
        shard = _vocab_shard(linear.weight, comm) if vocab else _chunk(linear.weight, 0, comm)
        # A frozen weight stays frozen once split (as torch's parallelize_module keeps it).
        self.weight = nn.Parameter(shard, requires_grad=linear.weight.requires_grad)
        self.bias = None
        if linear.bias is not None:
            bias = _vocab_shard(linear.bias, comm) if vocab else _chunk(linear.bias, 0, comm)
            self.bias = nn.Parameter(bias, requires_grad=linear.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_sequence(x, self.comm, self.name)  # (B, T, in): all-gather the sequence
        else:
            x = copy_to_tp(x, self.comm, self.name)  # f: identity; all-reduce in backward
        y = F.linear(x, self.weight, self.bias)  # (..., out / N)
        if self.gather_output:
            y = gather_last_dim(y, self.comm, self.name)[..., : self.out_features]
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.weight.shape[0]} on this rank), gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """X_r A_r: this rank's partial sum of the whole output; the ranks' sums are added.

    Input: (..., in_features / N) with `input_is_parallel` (the output of a
    column-parallel layer), else (..., in_features), whole, of which this rank
    keeps its chunk. Output: (..., out_features), whole on every rank; under
    sequence parallelism (B, T / N, out_features), this rank's chunk of the
    sequence. The bias is added once, after the sum (not N times).
    """

    def __init__(
        self,
        linear: nn.Linear,
        comm: TPComm,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        name: str = "",
    ) -> None:
        super().__init__()
        if linear.in_features % comm.size:
            raise ValueError(
                f"{name or 'RowParallelLinear'}: {linear.in_features} input features "
                f"cannot be split over {comm.size} ranks"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.comm, self.name = comm, name
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(
            _chunk(linear.weight, 1, comm), requires_grad=linear.weight.requires_grad
        )
        # Replicated: the same on every rank (its gradient too, except under sequence
        # parallelism; see `apply_tensor_parallel`).
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_last_dim(x, self.comm, self.name)  # (..., in / N)
        y = F.linear(x, self.weight)  # (..., out): this rank's partial sum
        if self.sequence_parallel:
            y = reduce_scatter_sequence(y, self.comm, self.name)  # (B, T / N, out)
        else:
            y = reduce_from_tp(y, self.comm, self.name)  # g: all-reduce; identity in backward
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.weight.shape[1]} on this rank), "
            f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over ranks (Megatron, sec. 3).

    Each rank looks up the tokens in its range and writes zeros for the others;
    summing over ranks (g) then gives every token its row. Under sequence
    parallelism the sum is a reduce-scatter: each rank keeps its chunk of the
    sequence. (B, T) ids -> (B, T, C), or (B, T / N, C).
    """

    def __init__(
        self,
        embedding: nn.Embedding,
        comm: TPComm,
        *,
        sequence_parallel: bool = False,
        name: str = "",
    ) -> None:
        super().__init__()
        _check_plain(embedding, name)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.comm, self.name, self.sequence_parallel = comm, name, sequence_parallel
        self.start, self.end = vocab_range(self.num_embeddings, comm.rank, comm.size)
        self.weight = nn.Parameter(
            _vocab_shard(embedding.weight, comm), requires_grad=embedding.weight.requires_grad
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)  # (B, T) tokens another rank holds
        local = (idx - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(out, self.comm, self.name)  # (B, T / N, C)
        return reduce_from_tp(out, self.comm, self.name)  # (B, T, C)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.start}, {self.end}) "
            f"on this rank, sequence_parallel={self.sequence_parallel}"
        )


class SequenceChunkEmbedding(nn.Module):
    """A replicated embedding under sequence parallelism (GPT's position embedding): the
    whole table on every rank, looked up for this rank's chunk of the sequence only
    (the last dim of its input, positions (T,) or ids (B, T)), so that its output
    lines up with the rest of the sequence-parallel activations."""

    def __init__(self, embedding: nn.Embedding, comm: TPComm, name: str = "") -> None:
        super().__init__()
        _check_plain(embedding, name)
        self.weight = embedding.weight  # the same parameter: replicated, not copied
        self.comm, self.name = comm, name

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.comm.split(idx, -1, self.name), self.weight)  # (T / N, C)


def _check_plain(embedding: nn.Embedding, name: str) -> None:
    if (
        embedding.padding_idx is not None
        or embedding.max_norm is not None
        or embedding.sparse
        or embedding.scale_grad_by_freq
    ):
        raise ValueError(
            f"{name or 'embedding'}: only a plain nn.Embedding can be split "
            "(no padding_idx, max_norm, sparse or scale_grad_by_freq)"
        )

"""Tensor parallelism (Megatron-LM, arXiv:1909.08053) and sequence parallelism
(arXiv:2205.05198): layers split over the ranks of a group, applied by a plan."""

from parcourse.tensor_parallel.comm import (
    TPComm,
    copy_to_tp,
    count_collectives,
    gather_last_dim,
    gather_sequence,
    reduce_from_tp,
    reduce_scatter_sequence,
    split_last_dim,
)
from parcourse.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from parcourse.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceChunkEmbedding,
    VocabParallelEmbedding,
    vocab_range,
)
from parcourse.tensor_parallel.plan import (
    ATTENTION_PLAN,
    BLOCK_PLAN,
    GPT_PLAN,
    MLP_PLAN,
    apply_tensor_parallel,
    gpt_plan,
    prefixed,
    sharded_parameters,
)
from parcourse.tensor_parallel.random import RNGTracker, TrackedDropout
from parcourse.tensor_parallel.replicated import ReplicatedGradSync

__all__ = [
    "ATTENTION_PLAN",
    "BLOCK_PLAN",
    "ColumnParallelLinear",
    "GPT_PLAN",
    "MLP_PLAN",
    "RNGTracker",
    "ReplicatedGradSync",
    "RowParallelLinear",
    "SequenceChunkEmbedding",
    "TPComm",
    "TrackedDropout",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "copy_to_tp",
    "count_collectives",
    "gather_last_dim",
    "gpt_plan",
    "gather_sequence",
    "prefixed",
    "reduce_from_tp",
    "reduce_scatter_sequence",
    "sharded_parameters",
    "split_last_dim",
    "vocab_range",
    "vocab_parallel_cross_entropy",
]

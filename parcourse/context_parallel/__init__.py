"""Context parallelism: attention over a sequence cut across the ranks of a group.

Each rank holds its slice of the sequence (`shard_sequence`); everything but attention is
per token and runs on the slice as it is. Attention needs every key for every query, and
three methods bring them together (`context_attention`, the method a parameter):

- "ring" (pass-KV; Liu et al. 2023, Ring Attention): K and V travel the ring, P - 1 hops,
  each rank attending to the block it holds while the next one is on its way; the blocks'
  results merge exactly by their log-sum-exp (`merge`, the online softmax).
- "all-gather": every rank gathers all of K and V at once (Llama 3's choice: simpler with
  document masks and grouped-query attention, at the price of the whole K and V on each).
- "ulysses" (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns the sequence cut
  into a head cut, each rank attends over the whole sequence for H / P heads, and a second
  all-to-all turns it back. The heads must divide by P.

Causal masks, balanced (`layout="zigzag"`): with the sequence cut in P contiguous slices the
last rank's queries see every key and the first rank's only its own, P times less work.
Cut in 2P chunks, rank r holding chunks r and 2P - 1 - r (the head-tail order of
Megatron-LM, Llama 3 and torch), every rank does the same work. Blocks that the mask
hides entirely are skipped.

In the course's GPT (`context_parallel`, `SequenceShard`): every layer but attention runs on
this rank's tokens as it is; the position embedding takes their whole-sequence positions.
The 3D step (`Hybrid`) runs it as the mesh's `cp` axis.
"""

from parcourse.context_parallel.attention import (
    BLOCK_KEY,
    LAYOUTS,
    METHODS,
    block_attention,
    chunks_of,
    context_attention,
    merge,
    positions,
    shard_sequence,
    unshard_sequence,
)
from parcourse.context_parallel.model import SequenceShard, context_parallel

__all__ = [
    "BLOCK_KEY",
    "LAYOUTS",
    "METHODS",
    "SequenceShard",
    "block_attention",
    "chunks_of",
    "context_attention",
    "context_parallel",
    "merge",
    "positions",
    "shard_sequence",
    "unshard_sequence",
]

"""ZeRO: shard optimizer state (stage 1), gradients (2) and parameters (3) over ranks."""

from parcourse.zero.optimizer import ZeroOptimizer
from parcourse.zero.sharded import FlatUnit, ShardedOptimizer, ZeroModel, shard

__all__ = ["FlatUnit", "ShardedOptimizer", "ZeroModel", "ZeroOptimizer", "shard"]

"""ZeRO: shard optimizer state (stage 1), gradients (2) and parameters (3) over ranks.

Read in this order: layout.py (which rows each rank keeps), stage1.py, stage2.py,
stage3.py (each adds to the one before), then mixed_precision.py, state_dict.py,
clip.py; model.py holds the entry points, sharded_optimizer.py the optimizer's half.
Beyond stage 3: offload.py (ZeRO-Offload), infinity.py (ZeRO-Infinity), zeropp.py
(ZeRO++); config.py reads a DeepSpeed config, loss_scale.py its fp16 section.
For the 3D step: stages.py (ZeRO driven by a pipeline's schedule), step_precision.py
(its compute dtype and torch's ShardedGradScaler at the step's moments).
"""

from parcourse.zero.config import ZeroEngine, check_config, from_config
from parcourse.zero.infinity import InfinityOptimizer
from parcourse.zero.layout import FlatUnit, row_chunk
from parcourse.zero.loss_scale import LossScale
from parcourse.zero.model import ShardedOptimizer, ZeroModel, shard
from parcourse.zero.offload import bytes_by_placement
from parcourse.zero.optimizer import ZeroOptimizer
from parcourse.zero.stage1 import ZeroStage1
from parcourse.zero.stage2 import ZeroStage2
from parcourse.zero.stage3 import ZeroStage3

__all__ = [
    "FlatUnit",
    "InfinityOptimizer",
    "LossScale",
    "ShardedOptimizer",
    "ZeroEngine",
    "ZeroModel",
    "ZeroOptimizer",
    "ZeroStage1",
    "ZeroStage2",
    "ZeroStage3",
    "bytes_by_placement",
    "check_config",
    "from_config",
    "row_chunk",
    "shard",
]

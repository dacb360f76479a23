"""When ranks fail: per-step fault tolerance over data-parallel replicas (a quorum each
step, a lost replica dropped, a new one healed from a live peer).

- quorum.py: `Lighthouse`, the coordinator, and `Quorum`, one round's decision.
- replica.py: `FaultTolerant`, a replica's side (ask, join, heal, average, commit).
- run.py: `run_replicas`, the processes, the coordinator's thread, replacements.
- training.py: `train_replica`, the training loop of one replica for any model.
- gpt.py: `train_gpt_replica`, the course's GPT on lesson 10's corpus that way.
- local_sgd.py: `LocalSGD` and `DiLoCo`, replicas that meet every H steps.
"""

from parcourse.fault.local_sgd import DiLoCo, LocalSGD
from parcourse.fault.quorum import Lighthouse, Quorum
from parcourse.fault.replica import FaultTolerant, Healed, NotInQuorum
from parcourse.fault.run import Event, FaultRun, ReplicaContext, run_replicas
from parcourse.fault.training import train_replica

__all__ = [
    "DiLoCo",
    "Event",
    "FaultRun",
    "FaultTolerant",
    "Healed",
    "Lighthouse",
    "LocalSGD",
    "NotInQuorum",
    "Quorum",
    "ReplicaContext",
    "run_replicas",
    "train_replica",
]

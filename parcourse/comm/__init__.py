"""Communication: one object for every strategy, and the collectives it is built from.

- alltoall.py: `all_to_all` with a count per peer from send / recv, and `AllToAll`
  under autograd (its backward the other way): Ulysses' head cut, experts' dispatch.
- `Comm` (communicator.py): a group, a tracer, a link and an algorithm (torch's
  collectives or the course's ring); all-reduce / reduce-scatter / all-gather, sync
  or async (one future type, `Pending`), and send / recv.
- ring.py: the ring all-reduce, readable (what lesson 01 shows);
  ring_fast.py: the same ring with segments, cached plans and kept buffers,
  tested equal to it: `ring_all_reduce`, `ring_reduce_scatter`, `ring_all_gather`.
- naive.py: the parameter server's all-reduce (`naive_all_reduce`).
- hierarchical.py: `hierarchical_all_reduce`, inside each node, across nodes, inside
  again (Horovod's hierarchical all-reduce), from the readable ring.
- messenger.py: send / recv that count bytes, stage CUDA tensors over gloo and
  apply the simulated link (link.py: `SimulatedLink`, and `Topology`, fast inside a
  node and slow between nodes).
- turns.py: `Turns`, one device's compute taken in turns by two threads of a rank, each
  handing it on while it waits for a message (DualPipe's overlapped pair), and the
  record of what that hid.
- pacing.py: `Pacer`, simulated compute beside real collectives: an action padded to
  its simulated seconds, the seconds blocked in collectives (`Comm.blocked_s`) on top.
- common.py: argument checks, `group_info`, `global_rank`, `backend_for`; `chunk_bounds` (how a
  range is cut into n parts) is parcourse.ranges', shared with the data.
"""

from parcourse.comm import ring
from parcourse.comm.alltoall import AllToAll, all_to_all
from parcourse.comm.common import (
    DTYPES,
    OPS,
    Op,
    backend_for,
    check_args,
    global_rank,
    group_info,
)
from parcourse.comm.communicator import ALGORITHMS, Algorithm, Comm, Pending
from parcourse.comm.hierarchical import bytes_by_level, hierarchical_all_reduce, node_groups
from parcourse.comm.link import Network, SimulatedLink, Topology, link_between, simulated_link
from parcourse.comm.messenger import Arrival, Messenger, messenger
from parcourse.comm.naive import naive_all_reduce
from parcourse.comm.pacing import Pacer
from parcourse.comm.ring import RingPhase, ring_steps
from parcourse.comm.ring_fast import (
    SEGMENT_BYTES,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from parcourse.comm.turns import Turns, in_lane, lane
from parcourse.ranges import Cut, chunk_bounds

__all__ = [
    "ALGORITHMS",
    "AllToAll",
    "Algorithm",
    "Arrival",
    "Comm",
    "Cut",
    "DTYPES",
    "Messenger",
    "bytes_by_level",
    "hierarchical_all_reduce",
    "node_groups",
    "OPS",
    "Op",
    "Pacer",
    "Pending",
    "RingPhase",
    "SEGMENT_BYTES",
    "Network",
    "SimulatedLink",
    "all_to_all",
    "Topology",
    "Turns",
    "in_lane",
    "lane",
    "link_between",
    "backend_for",
    "check_args",
    "chunk_bounds",
    "global_rank",
    "group_info",
    "messenger",
    "naive_all_reduce",
    "ring",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_steps",
    "simulated_link",
]

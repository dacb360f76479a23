"""When the runtime posts each receive: the policy for gloo, apart from the runtime.

The runtime asks `early_receives` once per schedule and rank; with gloo it gets, for
each of this rank's actions (by index), the receives to post before running it
(`receives_to_post`), and with any other backend none (each receive is posted when its
action needs it).
"""

from __future__ import annotations

import bisect

from parcourse.pipeline.actions import Action, Schedule, incoming, sender
from parcourse.pipeline.simulate import Costs, simulate


def early_receives(schedule: Schedule, rank: int, backend: str) -> dict[int, list[Action]]:
    """`receives_to_post` with gloo, nothing early with any other backend.

    NCCL matches the messages between two ranks in the order they were issued, on one
    stream: a receive posted early would hold up this rank's later sends to that peer,
    and two ranks doing so wait for each other. So early only with gloo."""
    return receives_to_post(schedule, rank) if backend == "gloo" else {}


def receives_to_post(schedule: Schedule, rank: int) -> dict[int, list[Action]]:
    """The receives `rank` posts before each of its actions (by index in its list), for
    gloo: every action that waits for a message from another rank appears once, at or
    before its own index.

    A receive is posted before the action that this rank runs, on the simulator's
    timeline (default costs, B = 2F), when the action sending its message starts: so
    up to one action before the send, and the message finds its receive waiting.
    That matters with gloo: a message sent before its receive is posted waits for a
    handshake (the receiver says it is ready, then the sender's I/O thread writes the
    data), and on a few busy cores that thread may wait for a time slice.
    torch.distributed.pipelining's runtime posts receives early too (`_add_send_recv`).
    Measured on 2 cores (benchmarks/pipeline.py, ours against torch's, paired runs):
    posting each receive when its action starts made DualPipeV and GPipe about
    0.05-0.1 of torch's step slower; posting every receive of the step at its start
    made 1F1B 0.1 slower (the data then lands while both ranks compute, and the
    receiving thread competes with them)."""
    timeline = simulate(schedule, Costs())
    starts = {s.action: s.start for s in timeline.spans}
    ends = [s.end for s in timeline.spans if s.rank == rank]  # in this rank's order
    posts: dict[int, list[Action]] = {}
    for j, a in enumerate(schedule.actions[rank]):
        message = incoming(a, schedule)
        if message is None or schedule.stage_rank[message.stage] == rank:
            continue  # nothing to wait for, or a stage on this rank: handed over in memory
        sent = starts[sender(schedule, message)]
        # The action running at `sent`: the first whose end comes after it.
        posts.setdefault(min(bisect.bisect_right(ends, sent), j), []).append(a)
    return posts

"""Pipeline parallelism: consecutive layers on different ranks, microbatches flowing
through them. Schedules are values (`actions`: the action type and the rule of what
waits for what; `schedule`: the builders and the registry by name), a simulator
predicts their timelines (`simulate`), and one runtime runs any of them on real ranks.
Imports go one way: actions <- schedule; actions <- simulate <- posting <- runtime."""

from parcourse.pipeline.schedule import (
    SCHEDULES,
    Action,
    Op,
    Schedule,
    check,
    dualpipe,
    dualpipe_v,
    gpipe,
    happens_before,
    interleaved_1f1b,
    naive,
    one_f_one_b,
    schedule_by_name,
    zbv,
    zero_bubble_h1,
)
from parcourse.pipeline.simulate import Costs, Deadlock, Timeline, simulate

__all__ = [
    "SCHEDULES",
    "Action",
    "Costs",
    "Deadlock",
    "Op",
    "Schedule",
    "Timeline",
    "check",
    "dualpipe",
    "dualpipe_v",
    "gpipe",
    "happens_before",
    "interleaved_1f1b",
    "naive",
    "one_f_one_b",
    "schedule_by_name",
    "simulate",
    "zbv",
    "zero_bubble_h1",
]

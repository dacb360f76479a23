"""Pipeline parallelism: consecutive layers on different ranks, microbatches flowing
through them. Schedules are values (`schedule`), a simulator predicts their timelines
(`simulate`), and one runtime runs any of them on real ranks."""

from parcourse.pipeline.schedule import (Action, Op, Schedule, check, dualpipe_v, gpipe,
                                         happens_before, interleaved_1f1b, naive, one_f_one_b,
                                         zero_bubble_h1)
from parcourse.pipeline.simulate import Costs, Deadlock, Timeline, simulate

__all__ = ["Action", "Costs", "Deadlock", "Op", "Schedule", "Timeline", "check", "dualpipe_v",
           "gpipe", "happens_before", "interleaved_1f1b", "naive", "one_f_one_b", "simulate",
           "zero_bubble_h1"]

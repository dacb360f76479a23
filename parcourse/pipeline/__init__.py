"""Pipeline parallelism: consecutive layers on different ranks, microbatches flowing
through them. Schedules are values (`schedule`), a simulator predicts their timelines
(`simulate`), and one runtime runs any of them on real ranks."""

from parcourse.pipeline.schedule import (Action, Op, Schedule, check, gpipe, happens_before,
                                         naive, one_f_one_b)
from parcourse.pipeline.simulate import Costs, Deadlock, Timeline, simulate

__all__ = ["Action", "Costs", "Deadlock", "Op", "Schedule", "Timeline", "check", "gpipe",
           "happens_before", "naive", "one_f_one_b", "simulate"]

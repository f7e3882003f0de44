"""Pipeline parallelism: schedules as action lists, a validator that
simulates them, and an executor that runs any of them over clawcomm's
point-to-point operations.

    from clawcomm.pipeline import build_schedule, validate, simulate
    sched = build_schedule("1f1b", pp=4, microbatches=8)
    validate(sched, pp=4, num_stages=4, microbatches=8)
    simulate(sched, costs={"F": 1, "B": 2}).bubble     # 3/11
"""

from clawcomm.pipeline.actions import Action, format_schedule, format_table, parse_schedule
from clawcomm.pipeline.schedules import SCHEDULES
from clawcomm.pipeline.schedules import build as build_schedule
from clawcomm.pipeline.validate import ScheduleError, Simulation, simulate, validate

__all__ = [
    "SCHEDULES",
    "Action",
    "build_schedule",
    "format_schedule",
    "format_table",
    "parse_schedule",
    "ScheduleError",
    "Simulation",
    "simulate",
    "validate",
]

"""Pipeline parallelism: schedules as action lists, a validator, a clock
that plays them with given action costs, and an executor that runs any of
them over clawcomm's point-to-point operations.

    from clawcomm.pipeline import build_schedule, validate, timing
    sched = build_schedule("1f1b", pp=4, microbatches=8)
    validate(sched, pp=4, num_stages=4, microbatches=8)
    timing(sched, costs={"F": 1, "B": 2}).bubble     # 3/11
"""

from clawcomm.pipeline.actions import Action, format_schedule, format_table, parse_schedule
from clawcomm.pipeline.clock import Timing, timing
from clawcomm.pipeline.dependencies import ScheduleError
from clawcomm.pipeline.schedules import SCHEDULES
from clawcomm.pipeline.schedules import build as build_schedule
from clawcomm.pipeline.validate import validate

__all__ = [
    "SCHEDULES",
    "Action",
    "build_schedule",
    "format_schedule",
    "format_table",
    "parse_schedule",
    "ScheduleError",
    "Timing",
    "timing",
    "validate",
]

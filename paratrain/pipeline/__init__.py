"""Pipeline parallelism: schedules as data, their simulator, stages and the executor.

Only the pure-Python parts are imported here (config validation uses them); the stage model and
the executor live in paratrain.pipeline.stages and paratrain.pipeline.runtime.
"""

from paratrain.config.parallel import SCHEDULES, ScheduleError, check_schedule
from paratrain.pipeline.schedules import Action, compute_order, program
from paratrain.pipeline.simulate import Simulation, simulate

__all__ = ["SCHEDULES", "Action", "ScheduleError", "Simulation", "check_schedule", "compute_order", "program",
           "simulate"]

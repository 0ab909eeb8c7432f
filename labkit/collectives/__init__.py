"""All-reduce algorithms as schedules: simulated, executed over torch.distributed, animated, priced.

    from labkit.collectives import ALGORITHMS, all_reduce, get_schedule, simulate
    get_schedule("ring", 4).steps[0]      # who sends which chunk to whom in step 1
    simulate(get_schedule("tree", 5))     # apply it to 5 vectors in one process, check the sum
    all_reduce(grad, "ring")              # run it for real inside a process group
"""
from labkit.collectives.execute import StepRecord, Trace, all_reduce, run_schedule, traced_run
from labkit.collectives.parameter_server import parameter_server, push_pull
from labkit.collectives.registry import ALGORITHMS, SCHEDULES, get_schedule, parse_algorithms
from labkit.collectives.schedule import Op, Schedule, ScheduleError, Step, Transfer, from_steps
from labkit.collectives.simulate import Counts, SimResult, count, coverage, simulate

__all__ = [
    "ALGORITHMS", "SCHEDULES", "Counts", "Op", "Schedule", "ScheduleError", "SimResult", "Step", "StepRecord",
    "Trace", "Transfer", "all_reduce", "count", "coverage", "from_steps", "get_schedule", "parameter_server",
    "parse_algorithms", "push_pull", "run_schedule", "simulate", "traced_run",
]

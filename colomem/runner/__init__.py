"""The colocated GRPO runner: phases in a guarded order, bounded waits, timeline, memory table, metrics.

    from colomem.runner import train
    result = train("path/to/model", reward_funcs=[my_reward], train_dataset=rows, max_new_tokens=256)

    from colomem.runner import run_job
    from colomem.runner.config import load_run_config
    result = run_job(load_run_config(["--steps", "5"]))

`python runners/grpo_colocated.py --help` lists every option; docs/colocated-training.md explains them.
"""
from .api import train
from .job import run_job
from .loop import ColocatedRunner, RunResult
from .phases import CYCLE, PhaseMachine, PhaseTimeoutError, Watchdog
from .ranks import BarrierTimeoutError, Ranks

__all__ = ["BarrierTimeoutError", "CYCLE", "ColocatedRunner", "PhaseMachine", "PhaseTimeoutError", "Ranks",
           "RunResult", "Watchdog", "run_job", "train"]

"""Benchmark evaluation: suites of tasks on local data, run with InspectAI against `mimir serve`
(or any OpenAI-compatible server), tables in the paper's layout, schedule sweeps, MLflow.

Imports the model and inference halves, never the trainer; the trainer calls
:func:`run_suite_on_engine` for evaluation during training.
"""

from .runner import SuiteResult, TaskResult, run_suite, run_suite_on_engine
from .suite import SuiteSpec, TaskSpec, load_suite

__all__ = ["SuiteResult", "SuiteSpec", "TaskResult", "TaskSpec", "load_suite", "run_suite",
           "run_suite_on_engine"]

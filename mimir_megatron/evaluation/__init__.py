"""Benchmark evaluation: suites of tasks on local data, run with InspectAI against `mimir serve`
(or any OpenAI-compatible server), tables in the paper's layout, schedule sweeps, MLflow.

Imports the model and inference halves, never the trainer; the trainer calls
:func:`run_suite_on_engine` for evaluation during training.
"""

from mimir_megatron.lazy import lazy_exports

# Imported on first use: the CLI imports this package to register its commands.
__getattr__ = lazy_exports(__name__, {
    "SuiteResult": ".runner", "TaskResult": ".runner", "run_suite": ".runner",
    "run_suite_on_engine": ".runner",
    "SuiteSpec": ".suite", "TaskSpec": ".suite", "load_suite": ".suite",
})
__all__ = ["SuiteResult", "SuiteSpec", "TaskResult", "TaskSpec", "load_suite", "run_suite",
           "run_suite_on_engine"]

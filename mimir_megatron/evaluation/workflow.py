"""`mimir eval` as a function: a suite run on a server, its tables, its MLflow run; and the
contamination metrics `mimir eval` and `mimir sweep` log."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mimir_megatron.inference.api_keys import Endpoint

from .contamination import BenchmarkMark
from .runner import SuiteResult
from .scoring_client import ScoreClient
from .suite import SuiteSpec
from .tracking import TrackingTarget

Marks = dict[str, BenchmarkMark | None]


@dataclass(frozen=True)
class EvalRunResult:
    """What :func:`run_eval` did: the suite's result, the model's name the server answered to,
    the tables written, how long it took (server start-up included) and the MLflow run (None:
    the store failed; the files are the record)."""

    result: SuiteResult
    model_name: str
    tables: list[Path]
    seconds: float
    run_id: str | None


def contamination_metrics(marks: Marks | None, result: SuiteResult | None = None) -> dict[str, float]:
    """``contamination/<task>`` (the share of items contaminated) and, with an evaluation's
    ``result``, ``eval/clean/<task>`` and ``eval/contaminated/<task>`` (the score split)."""
    from .tables import score_split

    metrics = {f"contamination/{name}": mark.fraction for name, mark in (marks or {}).items()
               if mark is not None and not mark.stale}
    if result is None or marks is None:
        return metrics
    for task in result.tasks:
        split = score_split(task, marks.get(task.spec.name))
        if split is None:
            continue
        for part, score in (("clean", split.clean), ("contaminated", split.contaminated)):
            if score is not None:
                metrics[f"eval/{part}/{task.spec.name}"] = score
    return metrics


def run_eval(suite: SuiteSpec, output: Path, server: AbstractContextManager[Endpoint | str],
             tracking: TrackingTarget, *, model_name: str | None = None,
             score_client: Callable[[Endpoint, str], ScoreClient] | None = None,
             h_cycles: int | None = None, l_cycles: int | None = None, marks: Marks | None = None,
             params: Mapping[str, Any] | None = None, data_dir: str | Path | None = None,
             limit: int | None = None, allow_code_execution: bool = False,
             mc_scoring: str | None = None) -> EvalRunResult:
    """`mimir eval`: ``suite`` on the server ``server`` yields the endpoint (or URL) of (started on entry,
    stopped after the run), asking for ``model_name`` (default: the first the server lists;
    ``score_client(endpoint, name)`` makes the log-likelihood client), under ``h_cycles``/``l_cycles``
    (default: the model's own). Writes ``results.md/.csv/.json``, ``items.jsonl`` and InspectAI's
    logs to ``output`` (``marks``: a contamination report's, :func:`.contamination.benchmark_marks`),
    then logs one MLflow run to ``tracking`` with ``params`` (the model's name added as ``model``,
    the schedule as ``h_cycles``/``l_cycles``), the metrics, the tables and the logs."""
    from .tables import write_tables
    from .runner import run_suite, server_model_name
    from .tracking import EvalRun

    started = time.perf_counter()
    with server as served:
        endpoint = Endpoint.of(served)
        model_name = model_name or server_model_name(endpoint)
        result = run_suite(suite, endpoint, data_dir=data_dir, limit=limit, h_cycles=h_cycles,
                           l_cycles=l_cycles, log_dir=output / "logs", model_name=model_name,
                           score_client=score_client(endpoint, model_name) if score_client else None,
                           allow_code_execution=allow_code_execution, mc_scoring=mc_scoring)
    seconds = time.perf_counter() - started
    tables = write_tables(result, output, model_name, marks)
    step = tracking.checkpoint_step
    run = EvalRun(tracking, f"eval {suite.name}" + (f" step {step}" if step is not None else ""),
                  {**(params or {}), "model": model_name, "h_cycles": h_cycles, "l_cycles": l_cycles})
    run.log_metrics({**result.metrics(), **contamination_metrics(marks, result), "eval/seconds": seconds},
                    step=step or 0)
    for path in tables:
        run.log_artifact(path, "tables")
    if (output / "logs").is_dir():
        run.log_artifacts(output / "logs", "inspect_logs")
    run.end()
    return EvalRunResult(result, model_name, tables, seconds, run.run_id)

"""Test-time schedule sweep (paper §6, Table 5): one checkpoint, weights fixed, each (H, L).

Writes the Table 5 layout (D = H(L+1), H, L, the schedule string, one column per task, the
trained schedule marked, collapsed cells marked with a dagger), a heatmap, and exact McNemar
tests on paired per-item outcomes for the suite's chosen pairs of schedules.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mimir_megatron.errors import UserError
from mimir_megatron.inference.api_keys import Endpoint

from .contamination import BenchmarkMark
from .results import SweepResults
from .runner import SuiteResult, TaskResult
from .scoring_client import ScoreClient
from .stats import McNemar, mcnemar_exact
from .suite import SuiteSpec, TaskSpec
from .tracking import TrackingTarget

log = logging.getLogger("mimir")

Schedule = tuple[int, int]
DAGGER = "†"


def parse_schedules(text: str) -> list[Schedule]:
    """'1x3,2x1' -> [(1, 3), (2, 1)]; UserError naming a malformed entry."""
    schedules = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            h, l_ = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise UserError(f"schedule {part!r} is not HxL (e.g. 2x3)") from None
        if h < 1 or l_ < 1:
            raise UserError(f"schedule {part!r}: H and L must be >= 1")
        schedules.append((h, l_))
    if not schedules:
        raise UserError("no schedules given (e.g. --schedules 1x3,2x3)")
    return schedules


def schedule_name(s: Schedule) -> str:
    return f"{s[0]}x{s[1]}"


def schedule_string(s: Schedule) -> str:
    return ("L" * s[1] + "H") * s[0]


def collapse_threshold(spec: TaskSpec, task: TaskResult) -> float:
    """Below this a cell is collapsed: chance for multiple choice, 0.02 for free generation."""
    if spec.collapse_below >= 0:
        return spec.collapse_below
    return task.chance if spec.format == "multiple_choice" else 0.02


@dataclass
class SweepResult:
    suite: SuiteSpec
    results: dict[Schedule, SuiteResult]
    trained: Schedule | None
    marks: dict[str, BenchmarkMark | None] | None = None
    """Per task, from a contamination report (None: no report)."""

    def header(self, task: TaskSpec) -> str:
        from .tables import marked_name

        return marked_name(task.header, self.marks, task.name)

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for schedule, result in self.results.items():
            row: dict[str, Any] = {"D": schedule[0] * (schedule[1] + 1), "H": schedule[0],
                                   "L": schedule[1], "schedule": schedule_string(schedule),
                                   "trained": schedule == self.trained}
            for task in result.tasks:
                score = task.score
                row[task.spec.name] = None if score is None else round(100 * score, 2)
                row[f"{task.spec.name}_collapsed"] = score is not None and score < collapse_threshold(
                    task.spec, task)
            rows.append(row)
        return sorted(rows, key=lambda r: (r["D"], r["H"]))

    def mcnemar(self) -> list[dict[str, Any]]:
        """One entry per (suite pair of schedules present, binary task)."""
        out = []
        for a_name, b_name in self.suite.mcnemar:
            a, b = (tuple(parse_schedules(n)[0]) for n in (a_name, b_name))
            if a not in self.results or b not in self.results:
                continue
            for ta, tb in zip(self.results[a].tasks, self.results[b].tasks):
                if not ta.spec.binary or not ta.outcomes or not tb.outcomes:
                    continue
                test: McNemar = mcnemar_exact(_correct(ta), _correct(tb))
                out.append({"task": ta.spec.name, "a": schedule_name(a), "b": schedule_name(b),
                            **asdict(test)})
        return out


def _correct(task: TaskResult) -> dict[str, bool]:
    return {o.id: bool(o.correct) for o in task.outcomes}


def markdown(sweep: SweepResult) -> str:
    tasks = sweep.suite.tasks
    lines = ["| D | H | L | schedule | " + " | ".join(sweep.header(t) for t in tasks) + " |",
             "| ---: | ---: | ---: | --- | " + " | ".join("---:" for _ in tasks) + " |"]
    for row in sweep.rows():
        cells = []
        for t in tasks:
            score = row.get(t.name)
            mark = DAGGER if row[f"{t.name}_collapsed"] else ""
            cells.append("n/a" if score is None else f"{score:.2f}{mark}")
        name = row["schedule"] + (" (trained)" if row["trained"] else "")
        lines.append(f"| {row['D']} | {row['H']} | {row['L']} | {name} | " + " | ".join(cells) + " |")
    from .tables import contamination_note

    lines += ["", f"{DAGGER} collapsed: below chance (multiple choice) or under 2 points (generation).",
              *contamination_note(sweep.marks)]
    tests = sweep.mcnemar()
    if tests:
        lines += ["", "| task | A | B | n | right only under A | right only under B | p (exact McNemar) |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| {t['task']} | {t['a']} | {t['b']} | {t['n']} | {t['only_a']} | {t['only_b']} | "
                  f"{t['p_value']:.3g} |" for t in tests]
    return "\n".join(lines) + "\n"


def heatmap(sweep: SweepResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = sweep.rows()
    tasks = sweep.suite.tasks
    values = np.array([[np.nan if r.get(t.name) is None else r[t.name] for t in tasks] for r in rows])
    fig, ax = plt.subplots(figsize=(1.4 * len(tasks) + 3, 0.55 * len(rows) + 1.5))
    image = ax.imshow(values, cmap="viridis", vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(tasks)), [sweep.header(t) for t in tasks], rotation=30, ha="right")
    ax.set_yticks(range(len(rows)),
                  [f"{r['H']}x{r['L']} {r['schedule']}" + (" *" if r["trained"] else "") for r in rows])
    for i, r in enumerate(rows):
        for j, t in enumerate(tasks):
            if r.get(t.name) is not None:
                ax.text(j, i, f"{r[t.name]:.1f}" + (DAGGER if r[f"{t.name}_collapsed"] else ""),
                        ha="center", va="center", color="white" if r[t.name] < 60 else "black", fontsize=8)
    fig.colorbar(image, ax=ax, label="score")
    ax.set_title(f"{sweep.suite.name}: score by schedule (* trained)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_sweep(sweep: SweepResult, output: Path) -> list[Path]:
    output.mkdir(parents=True, exist_ok=True)
    rows = sweep.rows()
    paths = [output / "table5.md", output / "table5.csv", output / "table5.json", output / "heatmap.png"]
    paths[0].write_text(markdown(sweep))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    paths[1].write_text(buffer.getvalue())
    contamination = None if sweep.marks is None else {
        name: (mark.as_dict() if mark is not None else None) for name, mark in sweep.marks.items()}
    trained = tuple(sweep.trained) if sweep.trained else None
    SweepResults(suite=sweep.suite.name, rows=tuple(rows), trained=trained, mcnemar=tuple(sweep.mcnemar()),
                 contamination=contamination).write(output)
    heatmap(sweep, paths[3])
    return paths


@dataclass(frozen=True)
class SweepRun:
    """What :func:`run_sweep` did: the sweep, the files it wrote (``sweep/`` artifacts of its
    MLflow run), how long it took (server start-up included) and its MLflow run (None: the store
    failed; the files are the record)."""

    sweep: SweepResult
    files: list[Path]
    seconds: float
    run_id: str | None


def run_sweep(suite: SuiteSpec, schedules: list[Schedule], output: Path,
              server: AbstractContextManager[Endpoint | str],
              tracking: TrackingTarget, *, model_name: str | None = None,
              score_client: Callable[[Endpoint, str], ScoreClient] | None = None,
              trained: Schedule | None = None,
              marks: dict[str, BenchmarkMark | None] | None = None, params: Mapping[str, Any] | None = None,
              data_dir: str | Path | None = None, limit: int | None = None,
              allow_code_execution: bool = False, mc_scoring: str | None = None,
              metrics: Mapping[str, float] | None = None) -> SweepRun:
    """`mimir sweep`: ``suite`` under each of ``schedules`` on the server ``server`` yields the URL
    of (started on entry, stopped once every schedule ran), asking for ``model_name`` (default:
    the first the server lists; ``score_client(endpoint, name)`` makes the log-likelihood client).
    Writes Table 5 (:func:`write_sweep`) and every item's outcome (``items.jsonl``) to ``output``
    and logs to ``tracking`` one run with ``params`` (the model's name added as ``model``), a child
    run per schedule, the McNemar tests, ``metrics`` and the files."""
    from .runner import run_suite, server_model_name
    from .tracking import EvalRun

    results: dict[Schedule, SuiteResult] = {}
    started = time.perf_counter()
    with server as served:
        endpoint = Endpoint.of(served)
        model_name = model_name or server_model_name(endpoint)
        client = score_client(endpoint, model_name) if score_client else None
        parent = EvalRun(tracking, f"sweep {suite.name}", {**(params or {}), "model": model_name})
        for schedule in schedules:
            name = schedule_name(schedule)
            log.info("schedule %s (H=%d, L=%d)", name, *schedule)
            result = run_suite(suite, endpoint, data_dir=data_dir, limit=limit,
                               h_cycles=schedule[0], l_cycles=schedule[1], log_dir=output / "logs" / name,
                               model_name=model_name, score_client=client,
                               allow_code_execution=allow_code_execution, mc_scoring=mc_scoring)
            results[schedule] = result
            child = EvalRun(tracking, f"sweep {suite.name} {name}",
                            {"h_cycles": schedule[0], "l_cycles": schedule[1], "suite": suite.name},
                            parent_run_id=parent.run_id)
            child.log_metrics(result.metrics())
            child.end()
            parent.log_metrics({f"{name}/{k}": v for k, v in result.metrics("").items()})
    if not any(r.scores() for r in results.values()):
        raise UserError("no task produced a score under any schedule (see the messages above)")
    sweep = SweepResult(suite, results, trained, marks)
    files = [*write_sweep(sweep, output), output / "items.jsonl"]
    files[-1].write_text("".join(
        json.dumps({"schedule": schedule_name(s), "task": t.spec.name, "id": o.id, "correct": o.correct,
                    "value": o.value, "prediction": o.prediction}, ensure_ascii=False) + "\n"
        for s, r in results.items() for t in r.tasks for o in t.outcomes))
    seconds = time.perf_counter() - started
    for test in sweep.mcnemar():
        prefix = f"mcnemar/{test['task']}/{test['a']}_vs_{test['b']}"
        parent.log_metrics({f"{prefix}/p_value": test["p_value"], f"{prefix}/only_a": test["only_a"],
                            f"{prefix}/only_b": test["only_b"]})
    parent.log_metrics({"sweep/seconds": seconds, **(metrics or {})})
    for path in files:
        parent.log_artifact(path, "sweep")
    parent.log_artifacts(output / "logs", "inspect_logs")
    parent.end()
    return SweepRun(sweep, files, seconds, parent.run_id)

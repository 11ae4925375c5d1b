"""Result tables in the layout of the paper's Tables 2-4: one row per task, grouped by category,
each category closed by its average; scores x100. Written as Markdown, CSV and JSON. With a
contamination report (:mod:`.contamination`) every row says how many of the benchmark's items
share text with the training data, and a contaminated benchmark's name carries a mark; where the
report lists which items and checked every item scored, the score is split into the clean items'
and the contaminated items' (what contamination bought)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .contamination import MARK, BenchmarkMark
from .metrics import aggregate
from .results import EvalResults, TaskScore
from .runner import SuiteResult, TaskResult

Marks = dict[str, BenchmarkMark | None]

METRIC_NAMES = {"accuracy": "acc", "exact_match": "EM", "f1": "F1", "macro_f1": "F1",
                "rouge1": "ROUGE-1", "chrf": "chrF", "ifeval": "acc", "pass_at_1": "pass@1"}


@dataclass(frozen=True)
class ScoreSplit:
    """A task's score on its clean items and on its contaminated items (None: no such items)."""

    clean: float | None
    clean_n: int
    contaminated: float | None
    contaminated_n: int


def score_split(task: TaskResult, mark: BenchmarkMark | None) -> ScoreSplit | None:
    """The task's score split by the report's contaminated items; None when the report does not
    say which of the scored items are contaminated (not checked, stale, fewer items checked)."""
    if mark is None or task.score is None or not mark.covers(len(task.outcomes)):
        return None
    dirty = set(mark.contaminated_items or ())
    clean = [o for o in task.outcomes if o.id not in dirty]
    touched = [o for o in task.outcomes if o.id in dirty]
    return ScoreSplit(aggregate(task.spec.metric, clean) if clean else None, len(clean),
                      aggregate(task.spec.metric, touched) if touched else None, len(touched))


def _split_cell(score: float | None, n: int) -> str:
    return "—" if score is None else f"{100 * score:.1f} ({n})"


def _contamination_cell(marks: Marks, task: str) -> str:
    mark = marks.get(task)
    return "not checked" if mark is None else mark.label()


def marked_name(name: str, marks: Marks | None, task: str) -> str:
    """The benchmark's name, with :data:`MARK` when the report found contaminated items."""
    mark = (marks or {}).get(task)
    return name + MARK if mark is not None and mark.flagged else name


def contamination_note(marks: Marks | None) -> list[str]:
    """The legend under a table with marks (nothing without a report)."""
    known = [m for m in (marks or {}).values() if m is not None]
    if not known:
        return []
    return [f"{MARK} contaminated: items share {known[0].ngram} consecutive tokens with the training data "
            f"(report {known[0].report}); score clean / contaminated: on those items alone (their count), "
            "n/a where the report does not say which scored items are contaminated"]


def table_rows(result: SuiteResult, marks: Marks | None = None) -> list[dict[str, Any]]:
    """Rows of the table: tasks in suite order within categories (first-seen order), then the
    category's average; with ``marks`` a ``contaminated`` column."""
    rows: list[dict[str, Any]] = []
    averages = result.category_averages()
    categories = list(dict.fromkeys(t.spec.category for t in result.tasks))
    for category in categories:
        for t in (t for t in result.tasks if t.spec.category == category):
            rows.append({"category": category, "benchmark": marked_name(t.spec.header, marks, t.spec.name),
                         "task": t.spec.name, "metric": METRIC_NAMES[t.spec.metric],
                         "score": None if t.score is None else round(100 * t.score, 2),
                         "n": len(t.outcomes), "note": t.error or ""})
            if marks is not None:
                split = score_split(t, marks.get(t.spec.name))
                rows[-1].update({
                    "contaminated": _contamination_cell(marks, t.spec.name),
                    "score clean": _split_cell(split.clean, split.clean_n) if split else "n/a",
                    "score contaminated": (_split_cell(split.contaminated, split.contaminated_n)
                                           if split else "n/a")})
        if category in averages:
            rows.append({"category": category, "benchmark": "Average", "task": "", "metric": "",
                         "score": round(100 * averages[category], 2), "n": "", "note": ""})
            if marks is not None:
                rows[-1].update({"contaminated": "", "score clean": "", "score contaminated": ""})
    return rows


def markdown(result: SuiteResult, title: str = "", marks: Marks | None = None) -> str:
    lines = [f"### {title}", ""] if title else []
    extra = marks is not None
    lines += ["| category | benchmark | metric | score | n |"
              + (" contaminated | score clean | score contaminated |" if extra else ""),
              "| --- | --- | --- | ---: | ---: |" + (" ---: | ---: | ---: |" if extra else "")]
    for row in table_rows(result, marks):
        score = "n/a" if row["score"] is None else f"{row['score']:.1f}"
        name = f"**{row['benchmark']}**" if row["benchmark"] == "Average" else row["benchmark"]
        lines.append(f"| {row['category']} | {name} | {row['metric']} | {score} | {row['n']} |"
                     + (f" {row['contaminated']} | {row['score clean']} | {row['score contaminated']} |"
                        if extra else ""))
    notes = [f"- {r['note']}" for r in table_rows(result) if r["note"]] + contamination_note(marks)
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["category"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def summary(result: SuiteResult, model: str = "", marks: Marks | None = None) -> EvalResults:
    """The ``results.json`` record of a suite's result."""
    tasks = {}
    for t in result.tasks:
        mark = marks.get(t.spec.name) if marks is not None else None
        split = score_split(t, mark) if marks is not None else None
        tasks[t.spec.name] = TaskScore(
            score=t.score, n=len(t.outcomes), metric=t.spec.metric, category=t.spec.category, chance=t.chance,
            error=t.error, contamination=mark.as_dict() if mark is not None else None,
            score_split=asdict(split) if split else None, marked=marks is not None)
    return EvalResults(suite=result.suite.name, model=model, tasks=tasks,
                       category_averages=result.category_averages(),
                       schedule=tuple(result.schedule) if result.schedule else None)


def write_tables(result: SuiteResult, output: str | Path, model: str = "",
                 marks: Marks | None = None) -> list[Path]:
    """results.md, results.csv, results.json and items.jsonl (every scored item) in ``output``;
    ``marks`` from a contamination report (:func:`.contamination.benchmark_marks`)."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    paths = {name: output / name for name in ("results.md", "results.csv", "results.json", "items.jsonl")}
    paths["results.md"].write_text(markdown(result, f"{result.suite.name} — {model}".strip(" —"), marks))
    paths["results.csv"].write_text(to_csv(table_rows(result, marks)))
    summary(result, model, marks).write(output)
    with paths["items.jsonl"].open("w", encoding="utf-8") as f:
        for t in result.tasks:
            for o in t.outcomes:
                f.write(json.dumps({"task": t.spec.name, "id": o.id, "prediction": o.prediction,
                                    "references": list(o.references), "value": o.value,
                                    "correct": o.correct, "choice_logprobs": o.choice_logprobs},
                                   ensure_ascii=False) + "\n")
    return list(paths.values())

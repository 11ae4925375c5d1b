"""Result tables in the layout of the paper's Tables 2-4: one row per task, grouped by category,
each category closed by its average; scores x100. Written as Markdown, CSV and JSON."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from .runner import SuiteResult

METRIC_NAMES = {"accuracy": "acc", "exact_match": "EM", "f1": "F1", "macro_f1": "F1",
                "rouge1": "ROUGE-1", "chrf": "chrF", "ifeval": "acc", "pass_at_1": "pass@1"}


def table_rows(result: SuiteResult) -> list[dict[str, Any]]:
    """Rows of the table: tasks in suite order within categories (first-seen order), then the
    category's average."""
    rows: list[dict[str, Any]] = []
    averages = result.category_averages()
    categories = list(dict.fromkeys(t.spec.category for t in result.tasks))
    for category in categories:
        for t in (t for t in result.tasks if t.spec.category == category):
            rows.append({"category": category, "benchmark": t.spec.header, "task": t.spec.name,
                         "metric": METRIC_NAMES[t.spec.metric],
                         "score": None if t.score is None else round(100 * t.score, 2),
                         "n": len(t.outcomes), "note": t.error or ""})
        if category in averages:
            rows.append({"category": category, "benchmark": "Average", "task": "", "metric": "",
                         "score": round(100 * averages[category], 2), "n": "", "note": ""})
    return rows


def markdown(result: SuiteResult, title: str = "") -> str:
    lines = [f"### {title}", ""] if title else []
    lines += ["| category | benchmark | metric | score | n |", "| --- | --- | --- | ---: | ---: |"]
    for row in table_rows(result):
        score = "n/a" if row["score"] is None else f"{row['score']:.1f}"
        name = f"**{row['benchmark']}**" if row["benchmark"] == "Average" else row["benchmark"]
        lines.append(f"| {row['category']} | {name} | {row['metric']} | {score} | {row['n']} |")
    notes = [r["note"] for r in table_rows(result) if r["note"]]
    if notes:
        lines += ["", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["category"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def summary(result: SuiteResult, model: str = "") -> dict[str, Any]:
    return {
        "suite": result.suite.name, "model": model,
        "schedule": list(result.schedule) if result.schedule else None,
        "tasks": {t.spec.name: {"score": t.score, "n": len(t.outcomes), "metric": t.spec.metric,
                                "category": t.spec.category, "chance": t.chance, "error": t.error}
                  for t in result.tasks},
        "category_averages": result.category_averages(),
    }


def write_tables(result: SuiteResult, output: str | Path, model: str = "") -> list[Path]:
    """results.md, results.csv, results.json and items.jsonl (every scored item) in ``output``."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    paths = {name: output / name for name in ("results.md", "results.csv", "results.json", "items.jsonl")}
    paths["results.md"].write_text(markdown(result, f"{result.suite.name} — {model}".strip(" —")))
    paths["results.csv"].write_text(to_csv(table_rows(result)))
    paths["results.json"].write_text(json.dumps(summary(result, model), indent=2) + "\n")
    with paths["items.jsonl"].open("w", encoding="utf-8") as f:
        for t in result.tasks:
            for o in t.outcomes:
                f.write(json.dumps({"task": t.spec.name, "id": o.id, "prediction": o.prediction,
                                    "references": list(o.references), "value": o.value,
                                    "correct": o.correct, "choice_logprobs": o.choice_logprobs},
                                   ensure_ascii=False) + "\n")
    return list(paths.values())

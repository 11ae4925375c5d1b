"""Rows to evaluation items: the chat messages a model sees and the references it is scored on.

Independent of InspectAI: one place decides what a benchmark row becomes. Rows are shuffled with
the suite's seed (the paper's 4242) before ``--limit`` takes the first N; few-shot examples are
drawn the same way from the task's few-shot split and given as earlier user/assistant turns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mimir_megatron.errors import UserError

from .metrics import LETTERS, extract
from .benchmark_rows import load_rows, lookup, matches_filter, render, template_fields
from .suite import TaskSpec

MC_INSTRUCTION = "Answer with the letter of the correct option only."


@dataclass
class Item:
    id: str
    messages: list[dict[str, str]]
    """The conversation up to the model's turn (shots first)."""
    references: list[str]
    """Correct answers after extraction (the option letter for multiple choice)."""
    num_choices: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    """Format-specific inputs of the scorer (IFEval's instructions, HumanEval's tests)."""


class RowError(UserError):
    pass


def _choices(spec: TaskSpec, row: dict[str, Any]) -> list[str]:
    if spec.choice_values:
        return list(spec.choice_values)
    source = spec.columns["choices"]
    if isinstance(source, str):
        return [str(c) for c in lookup(row, source)]
    return [str(lookup(row, column)) for column in source]


def _answer_index(spec: TaskSpec, row: dict[str, Any], choices: list[str]) -> int:
    raw = lookup(row, spec.columns["answer"])
    kind = spec.answer_kind
    if kind == "index":
        index = int(raw)
    elif kind == "index1":
        index = int(raw) - 1
    elif kind == "letter":
        index = LETTERS.index(str(raw).strip().upper())
    elif kind == "label":
        labels = [str(x) for x in lookup(row, spec.columns["labels"])]
        index = labels.index(str(raw))
    elif kind == "bool":
        index = 0 if raw in (True, "true", "True", 1, "1") else 1
    else:  # value
        index = choices.index(str(raw))
    if not 0 <= index < len(choices):
        raise ValueError(f"answer {raw!r} is outside the {len(choices)} options")
    return index


def _user_text(spec: TaskSpec, row: dict[str, Any]) -> tuple[str, str, int, dict[str, Any]]:
    """(user message, the assistant's correct reply for a shot, number of options, extra)."""
    text = render(spec.prompt, row)
    if spec.format == "multiple_choice":
        choices = _choices(spec, row)
        index = _answer_index(spec, row, choices)
        options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))
        text = f"{text}\n\n{options}\n\n{spec.instruction or MC_INSTRUCTION}"
        return text, LETTERS[index], len(choices), {}
    if spec.instruction:
        text = f"{text}\n\n{spec.instruction}"
    if spec.format == "generate":
        target = lookup(row, spec.columns["target"])
        refs = [str(t) for t in target] if isinstance(target, list) else [str(target)]
        return text, refs[0], 0, {"references": [extract(spec.target_extract, r) for r in refs]}
    if spec.format == "ifeval":
        return text, "", 0, {"instructions": list(lookup(row, spec.columns["instructions"])),
                             "kwargs": list(lookup(row, spec.columns["kwargs"]))}
    # humaneval: the model is asked to complete the function in `prompt`'s code
    return text, "", 0, {"code_prompt": str(row.get("prompt", "")),
                         "test": str(lookup(row, spec.columns["test"])),
                         "entry_point": str(lookup(row, spec.columns["entry_point"]))}


def _shuffled(rows: list[dict[str, Any]], seed: int) -> list[tuple[int, dict[str, Any]]]:
    indexed = list(enumerate(rows))
    random.Random(seed).shuffle(indexed)
    return indexed


def task_rows(spec: TaskSpec, data_dir: Path, seed: int, limit: int | None = None) -> list[tuple[int, dict]]:
    """The task's rows in evaluation order: (number among the rows its ``filter`` keeps, which is
    the item's id; the row), shuffled with ``seed``, the first ``limit``."""
    rows = load_rows(data_dir / spec.data, spec.name, spec.split)
    rows = [r for r in rows if matches_filter(r, spec.filter)]
    if not rows:
        raise RowError(f"task {spec.name}: no rows in {data_dir / spec.data}"
                       + (f" matching {dict(spec.filter)}" if spec.filter else ""))
    return _shuffled(rows, seed)[:limit]


def build_items(spec: TaskSpec, data_dir: Path, seed: int, limit: int | None = None) -> list[Item]:
    """The task's items in evaluation order (shuffled with ``seed``, first ``limit``)."""
    rows = task_rows(spec, data_dir, seed, limit)
    shots: list[dict[str, str]] = []
    if spec.shots:
        pool = load_rows(data_dir / spec.fewshot_data, spec.name, spec.fewshot_split)
        for number, (_, row) in enumerate(_shuffled(pool, seed)[: spec.shots]):
            text, reply, _, _ = _convert(spec, row, f"few-shot row {number}")
            shots += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
    items = []
    for index, row in rows:
        text, reply, num_choices, extra = _convert(spec, row, f"row {index}")
        references = extra.pop("references", [reply])
        items.append(Item(str(index), [*shots, {"role": "user", "content": text}], references,
                          num_choices, extra))
    return items


@dataclass
class BenchmarkText:
    """The benchmark's own text in one item, without this suite's wording (prompt template,
    instruction, option letters, shots): what a copy of the benchmark in training data holds."""

    id: str
    prompt: list[str]
    """The row's values the prompt shows, in order: the template's fields, then the options."""
    references: list[str]
    """Reference answers as the row writes them, before extraction (free-generation tasks)."""


def benchmark_texts(spec: TaskSpec, data_dir: Path, seed: int,
                    limit: int | None = None) -> list[BenchmarkText]:
    """:class:`BenchmarkText` of the task's items, same rows, order and ids as :func:`build_items`."""
    out = []
    for index, row in task_rows(spec, data_dir, seed, limit):
        try:
            prompt = [text for name in template_fields(spec.prompt) for text in _strings(lookup(row, name))]
            if spec.format == "multiple_choice" and not spec.choice_values:
                prompt += _choices(spec, row)
            references = _strings(lookup(row, spec.columns["target"])) if spec.format == "generate" else []
        except KeyError as exc:
            raise RowError(f"task {spec.name}: row {index} has no column {exc.args[0]!r} "
                           f"(columns: {', '.join(sorted(row))})") from None
        out.append(BenchmarkText(str(index), prompt, references))
    return out


def _strings(value: Any) -> list[str]:
    """The text leaves of a row value (a list's items, a mapping's values); no booleans or nulls."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [text for v in value for text in _strings(v)]
    if value is None or isinstance(value, bool):
        return []
    return [str(value)]


def _convert(spec: TaskSpec, row: dict[str, Any], where: str):
    try:
        return _user_text(spec, row)
    except KeyError as exc:
        raise RowError(f"task {spec.name}: {where} has no column {exc.args[0]!r} "
                       f"(columns: {', '.join(sorted(row))})") from None
    except (ValueError, TypeError, IndexError) as exc:
        raise RowError(f"task {spec.name}: {where}: {exc}") from None

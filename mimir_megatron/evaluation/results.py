"""The files ``mimir eval`` and ``mimir sweep`` write for tools: one record each, one reader, one
writer.

- ``results.json`` (:class:`EvalResults`): per task its score, item count, metric, category,
  chance level and error, with the contamination mark and the clean/contaminated score split
  where a report was given; the category averages; the schedule evaluated.
- ``table5.json`` (:class:`SweepResults`): the Table 5 rows (one per schedule), the trained
  schedule, the McNemar tests and the contamination marks.

Both carry ``format`` and the digest of their content (:mod:`mimir_megatron.integrity`), and are
read by one rule (:func:`_read_record`): another version is refused by name, a file whose content
no longer matches its digest is refused as edited, then :meth:`read` checks the fields and their
types, naming the file and the field in one line. A file written before ``format`` or the digest
was recorded holds today's fields and reads as today's (:func:`_migrated`; without a digest there
is nothing to verify).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Self

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import (
    RecordFields as _Fields,
    is_number,
    read_json_object,
    refuse_if_edited,
    with_digest,
    write_json_atomic,
)

RESULTS_FORMAT = "mimir-eval-results-v2"
SWEEP_FORMAT = "mimir-sweep-results-v2"
_DIGESTLESS_FORMATS = {RESULTS_FORMAT: "mimir-eval-results-v1", SWEEP_FORMAT: "mimir-sweep-results-v1"}
"""Each record's format before v2, when its files may lack a digest (written before digests)."""
RESULTS_NAME = "results.json"
SWEEP_NAME = "table5.json"


class _ResultsFile:
    """What ``results.json`` and ``table5.json`` share: their name in an output directory, their
    format, the command that writes them, one writer (with the digest, atomically) and one reader."""

    NAME: ClassVar[str]
    FORMAT: ClassVar[str]
    WRITER: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def write(self, directory: str | Path) -> Path:
        """Write ``<directory>/<NAME>`` with the digest of its content, atomically; the path written."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        return write_json_atomic(Path(directory) / self.NAME, with_digest(self.to_dict()))

    @classmethod
    def read(cls, path: str | Path) -> Self:
        """The file at ``path`` (the file, or the output directory holding it); a one-line
        :class:`UserError` naming the file and what is wrong."""
        path = Path(path)
        path = path / cls.NAME if path.is_dir() else path
        return cls._from_fields(_Fields(_read_record(path, cls.FORMAT, cls.WRITER), path), path)

    @classmethod
    def _from_fields(cls, body: _Fields, path: Path) -> Self:
        raise NotImplementedError


@dataclass(frozen=True)
class TaskScore:
    """One task's result."""

    score: float | None
    """None: the task failed (``error``) or scored no item."""
    n: int
    metric: str
    category: str | None = None
    chance: float | None = None
    error: str | None = None
    contamination: Mapping[str, Any] | None = None
    """The contamination report's mark (``BenchmarkMark.as_dict``), where a report was given."""
    score_split: Mapping[str, Any] | None = None
    """Score on clean and on contaminated items (``ScoreSplit``), where the report allows it."""
    marked: bool = field(default=False, compare=False)
    """Whether a report was given (then ``contamination`` and ``score_split`` are written, null or not)."""

    def to_dict(self) -> dict[str, Any]:
        values = {"score": self.score, "n": self.n, "metric": self.metric, "category": self.category,
                  "chance": self.chance, "error": self.error}
        if self.marked:
            values |= {"contamination": None if self.contamination is None else dict(self.contamination),
                       "score_split": None if self.score_split is None else dict(self.score_split)}
        return values


@dataclass(frozen=True)
class EvalResults(_ResultsFile):
    """``results.json`` of ``mimir eval``."""

    NAME: ClassVar[str] = RESULTS_NAME
    FORMAT: ClassVar[str] = RESULTS_FORMAT
    WRITER: ClassVar[str] = "mimir eval"

    suite: str
    model: str
    tasks: Mapping[str, TaskScore]
    category_averages: Mapping[str, float]
    schedule: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"format": RESULTS_FORMAT, "suite": self.suite, "model": self.model,
                "schedule": list(self.schedule) if self.schedule else None,
                "tasks": {name: task.to_dict() for name, task in self.tasks.items()},
                "category_averages": dict(self.category_averages)}

    @classmethod
    def _from_fields(cls, body: _Fields, path: Path) -> EvalResults:
        tasks = {}
        for name, task in body.mapping("tasks").items():
            t = _Fields(task, path, f"tasks.{name}.") if isinstance(task, dict) else None
            if t is None:
                raise UserError(f"{path}: tasks.{name}: a JSON object expected, got {task!r}")
            tasks[name] = TaskScore(
                score=t.number("score", required=False), n=t.int("n"), metric=t.str("metric"),
                category=t.str("category", required=False), chance=t.number("chance", required=False),
                error=t.str("error", required=False),
                contamination=t.mapping("contamination", required=False),
                score_split=t.mapping("score_split", required=False), marked="contamination" in task)
        averages = body.mapping("category_averages")
        bad = next((k for k, v in averages.items() if not is_number(v)), None)
        if bad is not None:
            raise UserError(f"{path}: category_averages.{bad}: a number expected, got {averages[bad]!r}")
        return cls(suite=body.str("suite"), model=body.str("model"), tasks=tasks, category_averages=averages,
                   schedule=_schedule(body.list("schedule", required=False), path, "schedule"))


@dataclass(frozen=True)
class SweepResults(_ResultsFile):
    """``table5.json`` of ``mimir sweep``. ``rows`` are the table's rows as written (D, H, L,
    schedule, trained, one score column per task); their columns depend on the suite."""

    NAME: ClassVar[str] = SWEEP_NAME
    FORMAT: ClassVar[str] = SWEEP_FORMAT
    WRITER: ClassVar[str] = "mimir sweep"

    suite: str
    rows: tuple[Mapping[str, Any], ...]
    trained: tuple[int, int] | None = None
    mcnemar: tuple[Mapping[str, Any], ...] = ()
    contamination: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"format": SWEEP_FORMAT, "suite": self.suite, "trained": list(self.trained or ()),
                "rows": [dict(r) for r in self.rows], "mcnemar": [dict(m) for m in self.mcnemar],
                "contamination": None if self.contamination is None else dict(self.contamination)}

    @classmethod
    def _from_fields(cls, body: _Fields, path: Path) -> SweepResults:
        rows = body.list("rows")
        for i, row in enumerate(rows):
            r = _Fields(row, path, f"rows[{i}].") if isinstance(row, dict) else None
            if r is None:
                raise UserError(f"{path}: rows[{i}]: a JSON object expected, got {row!r}")
            r.int("H"), r.int("L"), r.str("schedule")
        mcnemar = body.list("mcnemar", required=False) or []
        if not all(isinstance(m, dict) for m in mcnemar):
            raise UserError(f"{path}: mcnemar: a list of JSON objects expected")
        return cls(suite=body.str("suite"), rows=tuple(rows),
                   trained=_schedule(body.list("trained", required=False) or None, path, "trained"),
                   mcnemar=tuple(mcnemar), contamination=body.mapping("contamination", required=False))


def _read_record(path: Path, expected: str, writer: str) -> dict[str, Any]:
    """The reading rule of both files: a JSON object of a format this version reads
    (:func:`_migrated`), its content still the one its digest was computed over."""
    body = read_json_object(path, "results file")
    migrated = _migrated(body, path, expected, writer)
    refuse_if_edited(body, path, writer, required=body.get("format") == expected)
    return migrated


def _migrated(body: dict[str, Any], path: Path, expected: str, writer: str) -> dict[str, Any]:
    """A file of an older format brought to today's: one without ``format`` (written before it was
    recorded) or of v1 (maybe written before digests were: its digest is checked where it has
    one) holds today's fields, so it reads as it is; another version is refused, naming it. A file
    of today's format always carries its digest (:func:`_read_record` refuses one without)."""
    found = body.get("format")
    if found not in (None, expected, _DIGESTLESS_FORMATS[expected]):
        raise UserError(f"{path}: format {found!r} is not one this version of mimir reads (it reads "
                        f"{expected!r}); run `{writer}` again")
    return body


def _schedule(value: Any, path: Path, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if len(value) != 2 or not all(type(v) is int for v in value):
        raise UserError(f"{path}: {where}: [H, L] expected, got {value!r}")
    return value[0], value[1]

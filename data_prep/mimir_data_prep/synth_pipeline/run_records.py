"""The records of a `mimir synth run` output directory: one reader and one writer each.

- :class:`EvidenceRow`: a line of ``evidence.jsonl`` (the append-only state,
  :mod:`.evidence_file`), a decided row with its full evidence.
- :class:`PipelineStamp`: ``pipeline.json``, the pipeline the rows were produced by (its name and
  fingerprint), what a resume is checked against.
- :class:`AcceptanceReport`: ``report.json``, the counts of a run (logged to MLflow).
- :class:`MlflowPointer`: ``mlflow_run.json``, the MLflow run an output directory logs to.

Each carries ``format`` and the digest of its content (:mod:`mimir_megatron.integrity`), is
written by its ``write`` (``line`` for an evidence row, appended by the state file) and read by
its ``read`` / ``from_dict``, which checks the format, the digest and every field it names, and
refuses a damaged file in one line naming the file (and the line) and the field. Files written
before formats were recorded hold the same fields and read as they are (no digest to check);
writing them again gives them today's format. Fields a record does not name are kept (and
covered by the digest).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import (
    DIGEST_KEY,
    RecordFields,
    read_json_object,
    refuse_if_edited,
    with_digest,
    write_json_atomic,
)

EVIDENCE_FORMAT = "mimir-synth-evidence-v1"
PIPELINE_FORMAT = "mimir-synth-pipeline-v1"
REPORT_FORMAT = "mimir-synth-report-v1"
MLFLOW_RUN_FORMAT = "mimir-synth-mlflow-run-v1"

PIPELINE_NAME = "pipeline.json"
REPORT_NAME = "report.json"
MLFLOW_RUN_NAME = "mlflow_run.json"

STATUSES = ("kept", "accepted", "discarded", "error")


def _body(values: Mapping[str, Any], path: str | Path, fmt: str, writer: str) -> dict[str, Any]:
    """``values`` of today's ``fmt`` (one without a format: written before formats were, read as
    it is), its digest checked; another version is refused by name."""
    found = values.get("format", fmt)
    if found != fmt:
        raise UserError(f"{path}: format {found!r} is not one this version of mimir reads (it reads "
                        f"{fmt!r}); {writer}")
    refuse_if_edited(values, path, "mimir synth run", required="format" in values)
    return {k: v for k, v in values.items() if k not in ("format", DIGEST_KEY)}


def _stored(fmt: str, content: Mapping[str, Any]) -> dict[str, Any]:
    """What is written: ``format`` first, the content as JSON reads it back, the digest last."""
    plain = json.loads(json.dumps(dict(content), ensure_ascii=False, default=str))
    return with_digest({"format": fmt, **plain})


def _file_fields(path: Path, fmt: str, what: str, advice: str) -> RecordFields | None:
    """The fields of the record file ``path`` (a ``what`` of format ``fmt``), checked; None where
    there is no such file. ``advice``: what to do about a file of another version."""
    if not path.exists():
        return None
    return RecordFields(_body(read_json_object(path, what), path, fmt, advice), path)


def _objects(record: RecordFields, name: str, *, required: bool = True) -> list[RecordFields]:
    """The fields of each object of the list ``name`` (empty when absent and not required)."""
    found = []
    for i, value in enumerate(record.list(name, required=required) or []):
        if not isinstance(value, dict):
            raise UserError(f"{record.path}: {record.prefix}{name}[{i}]: a JSON object expected, "
                            f"got {value!r}")
        found.append(RecordFields(value, record.path, f"{record.prefix}{name}[{i}]."))
    return found


def _reason_codes(record: RecordFields, name: str, *, required: bool = True) -> tuple[str, ...]:
    """The codes of a list of ``{"code", "detail"}`` reasons."""
    return tuple(reason.str("code") for reason in _objects(record, name, required=required))


# -- the evidence of one decided row --------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One request to an endpoint, as the evidence records it (the rest in ``content``)."""

    retries: int
    content: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)


@dataclass(frozen=True)
class Attempt:
    """One candidate of a row: the generator's call (None: the source's own candidate), the
    checks it failed, the auditor's call and verdict (None: it never got that far)."""

    generator: Call | None
    auditor: Call | None
    failed_checks: tuple[str, ...]
    verdict: str | None
    verdict_reasons: tuple[str, ...]
    """The codes of a ``regenerate`` or ``discard`` verdict."""


@dataclass(frozen=True)
class EvidenceRow:
    row_id: str
    input_sha256: str
    """The source row's fingerprint when it was decided (another: the row changed since)."""
    status: str
    reasons: tuple[str, ...]
    """The codes of the final reasons."""
    attempts: tuple[Attempt, ...]
    output: Mapping[str, Any] | None
    """The chat record of a kept or accepted row."""
    content: Mapping[str, Any] = field(repr=False, compare=False, default_factory=dict)
    """The whole row as stored (source line, pipeline, fingerprint, the attempts' candidates and
    calls, when it was decided), without format and digest."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "evidence row") -> EvidenceRow:
        """The row ``values`` (``where``: ``FILE: line N``); a one-line :class:`UserError` naming it
        and the field."""
        body = _body(values, where, EVIDENCE_FORMAT, "the directory's rows were written by another "
                                                     "version: use another output directory")
        f = RecordFields(body, where)
        status = f.get("status", lambda v: v in STATUSES, f"one of {', '.join(STATUSES)}")
        output = f.mapping("output", required=status in ("kept", "accepted"))
        return cls(row_id=f.str("row_id"), input_sha256=f.str("input_sha256"), status=status,
                   reasons=_reason_codes(f, "reasons"),
                   attempts=tuple(map(_attempt, _objects(f, "attempts"))),
                   output=None if output is None else MappingProxyType(output),
                   content=MappingProxyType(body))

    @classmethod
    def from_line(cls, line: bytes, path: Path, number: int) -> EvidenceRow:
        """Line ``number`` of the evidence file ``path``, read."""
        where = f"{path}: line {number}"
        try:
            values = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"{where}: not an evidence row (invalid JSON: {exc})") from None
        if not isinstance(values, dict):
            raise UserError(f"{where}: not an evidence row (a JSON object expected)")
        return cls.from_dict(values, where)

    @classmethod
    def decided(cls, content: Mapping[str, Any]) -> EvidenceRow:
        """The row a run just decided (its evidence as built), checked as a reader would."""
        return cls.from_dict(json.loads(json.dumps(dict(content), ensure_ascii=False, default=str)),
                             f"row {content.get('row_id')!r}")

    def to_dict(self) -> dict[str, Any]:
        return _stored(EVIDENCE_FORMAT, self.content)

    def line(self) -> bytes:
        """The row as one line of the evidence file (what the state file appends)."""
        return (json.dumps(self.to_dict(), ensure_ascii=False) + "\n").encode()


def _attempt(f: RecordFields) -> Attempt:
    verdict = f.nested("verdict", required=False)
    failed = tuple(c.str("name") for c in _objects(f, "checks", required=False) if not c.bool("passed"))
    return Attempt(generator=_call(f, "generator"), auditor=_call(f, "auditor"), failed_checks=failed,
                   verdict=None if verdict is None else verdict.str("verdict"),
                   verdict_reasons=() if verdict is None else _reason_codes(verdict, "reasons",
                                                                            required=False))


def _call(attempt: RecordFields, stage: str) -> Call | None:
    call = attempt.nested(stage, required=False)
    if call is None:
        return None
    return Call(retries=len(call.list("retries")), content=MappingProxyType(call.values))


# -- the pipeline stamp ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineStamp:
    """The pipeline an output directory's rows were produced by."""

    name: str
    fingerprint: str

    @classmethod
    def read(cls, directory: Path) -> PipelineStamp | None:
        """The stamp of ``directory``; None where it has none (no run wrote there yet)."""
        f = _file_fields(directory / PIPELINE_NAME, PIPELINE_FORMAT, "pipeline stamp",
                         "use another output directory")
        return None if f is None else cls(name=f.str("name"), fingerprint=f.str("fingerprint"))

    def write(self, directory: Path) -> Path:
        stored = _stored(PIPELINE_FORMAT, {"name": self.name, "fingerprint": self.fingerprint})
        return write_json_atomic(directory / PIPELINE_NAME, stored, indent=1)


# -- the acceptance report ------------------------------------------------------------------------


@dataclass(frozen=True)
class AcceptanceReport:
    """What a run decided: counts per status and reason, calls, the models asked."""

    pipeline: str
    fingerprint: str
    source_rows: int
    decided: int
    pending: int
    status: Mapping[str, int]
    """Rows per status (every one of :data:`STATUSES`)."""
    acceptance_rate: float
    discard_reasons: Mapping[str, int]
    error_reasons: Mapping[str, int]
    regenerate_reasons: Mapping[str, int]
    check_failures: Mapping[str, int]
    generations_per_row: Mapping[str, int]
    """Rows by how many generator calls they took (keys: the count, as text)."""
    calls: Mapping[str, int]
    """``generator``, ``auditor`` and ``retries``."""
    models: Mapping[str, str]
    """Each endpoint's configured model."""
    stopped: str | None
    """Why the run stopped early (an endpoint that stays down, an interrupt), or None."""

    def to_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return _stored(REPORT_FORMAT, {k: dict(v) if isinstance(v, Mapping) else v
                                       for k, v in values.items()})

    def write(self, directory: Path) -> Path:
        return write_json_atomic(directory / REPORT_NAME, self.to_dict(), indent=1)

    @classmethod
    def read(cls, path: Path) -> AcceptanceReport:
        """The report at ``path`` (the file, or the output directory holding it)."""
        path = path / REPORT_NAME if path.is_dir() else path
        f = _file_fields(path, REPORT_FORMAT, "acceptance report", "run `mimir synth run` again")
        if f is None:
            raise UserError(f"{path}: not found")

        def counts(name: str, keys: tuple[str, ...] = ()) -> Mapping[str, int]:
            values = f.mapping(name)
            for key in keys:
                if key not in values:
                    raise UserError(f"{path}: {name}.{key}: missing")
            bad = next((k for k, v in values.items() if type(v) is not int), None)
            if bad is not None:
                raise UserError(f"{path}: {name}.{bad}: an integer expected, got {values[bad]!r}")
            return MappingProxyType(dict(values))

        models = f.mapping("models")
        bad = next((k for k, v in models.items() if not isinstance(v, str)), None)
        if bad is not None:
            raise UserError(f"{path}: models.{bad}: a string expected, got {models[bad]!r}")
        return cls(pipeline=f.str("pipeline"), fingerprint=f.str("fingerprint"),
                   source_rows=f.int("source_rows"), decided=f.int("decided"), pending=f.int("pending"),
                   status=counts("status", STATUSES),
                   acceptance_rate=f.number("acceptance_rate"), discard_reasons=counts("discard_reasons"),
                   error_reasons=counts("error_reasons"), regenerate_reasons=counts("regenerate_reasons"),
                   check_failures=counts("check_failures"), generations_per_row=counts("generations_per_row"),
                   calls=counts("calls", ("generator", "auditor", "retries")),
                   models=MappingProxyType(dict(models)), stopped=f.str("stopped", required=False))


# -- the MLflow run an output directory logs to ---------------------------------------------------


@dataclass(frozen=True)
class MlflowPointer:
    run_id: str
    tracking_uri: str

    @classmethod
    def read(cls, directory: Path) -> MlflowPointer | None:
        """The pointer of ``directory``; None before its first run was logged."""
        f = _file_fields(directory / MLFLOW_RUN_NAME, MLFLOW_RUN_FORMAT, "MLflow run pointer",
                         "delete it to log to a new run")
        return None if f is None else cls(run_id=f.str("run_id"), tracking_uri=f.str("tracking_uri"))

    def write(self, directory: Path) -> Path:
        return write_json_atomic(directory / MLFLOW_RUN_NAME, _stored(
            MLFLOW_RUN_FORMAT, {"run_id": self.run_id, "tracking_uri": self.tracking_uri}))

"""`mimir synth run PIPELINE.yaml`: generate, check, audit; N rows in flight; resumable.

Per row: a candidate (the source's own when ``generate.initial_candidate`` is set, else the
generator's) goes through the deterministic checks; only when they pass is the auditor asked.
``accept`` ends the row (status ``kept`` for the source's candidate, ``accepted`` for a generated
one), ``discard`` ends it, ``regenerate`` asks the generator again with the reasons as feedback, up
to ``max_generations`` calls (then ``discarded`` as ``attempts_exhausted``). Every decided row is
appended to the state file with its full evidence; the outputs are derived from that file.

Also ``python -m mimir_data_prep.synth_pipeline`` (``__main__.py``): `mimir synth run` under its older name.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from mimir_megatron.errors import UserError
from mimir_data_prep.records import RecordError, to_conversation

from .acceptance import finalize
from .checks import CheckResult, run_checks
from .client import ChatEndpoint, EndpointMisconfigured, EndpointUnavailable, RequestRejected
from .pipeline import Pipeline, resolve
from .run_records import STATUSES, AcceptanceReport, EvidenceRow
from .source import SourceRow, iter_source
from .evidence_file import StateFile
from .verdict import Verdict, first_json_object, parse_verdict

log = logging.getLogger(__name__)


@dataclass
class RunOptions:
    output_dir: Path
    concurrency: int | None = None
    retry_errors: bool = False
    """Redo rows whose recorded status is ``error`` (a request the server refused)."""
    allow_pipeline_change: bool = False
    progress: bool = True


def default_output_dir(pipeline: Pipeline) -> Path:
    if pipeline.config.output.dir:
        return resolve(pipeline.base_dir, pipeline.config.output.dir)
    return Path("synth") / pipeline.config.name


class RowProcessor:
    """Takes one source row to a decided record; talks to the endpoints, never to the state."""

    def __init__(self, pipeline: Pipeline, endpoints: dict[str, ChatEndpoint]):
        self.p = pipeline
        self.cfg = pipeline.config
        self.generator = endpoints[self.cfg.generate.endpoint]
        self.auditor = endpoints[self.cfg.audit.endpoint]
        self.fingerprint = pipeline.fingerprint()

    def _messages(self, stage: str, context: dict[str, Any]) -> list[dict[str, str]]:
        msgs = []
        if f"{stage}.system" in self.p.templates:
            msgs.append({"role": "system", "content": self.p.render(f"{stage}.system", **context)})
        msgs.append({"role": "user", "content": self.p.render(f"{stage}.prompt", **context)})
        return msgs

    def _parse_candidate(self, text: str) -> tuple[dict[str, Any] | None, str | None]:
        gen = self.cfg.generate
        if gen.parse == "text":
            return ({"text": text}, None) if text.strip() else (None, "empty reply")
        obj = first_json_object(text, tuple(gen.required_fields))
        if obj is None:
            want = f" with {', '.join(gen.required_fields)}" if gen.required_fields else ""
            return None, f"no JSON object{want} in the reply"
        empty = [f for f in gen.required_fields if obj.get(f) in (None, "", [], {})]
        if empty:
            return None, f"empty field(s): {', '.join(empty)}"
        return obj, None

    def _source_candidate(self, row: SourceRow) -> tuple[dict[str, Any] | None, str | None]:
        try:
            return {k: self.p.evaluate(f"generate.initial_candidate.{k}", row=row.record)
                    for k in self.cfg.generate.initial_candidate}, None
        except Exception as exc:  # noqa: BLE001 - a source row without the field
            return None, f"cannot take the candidate from the source row: {exc}"

    def build_output(self, context: dict[str, Any]) -> dict[str, Any]:
        """The chat record; raises RecordError when it is not one `mimir prepare` accepts."""
        out = self.cfg.output
        try:
            if out.messages_expr:
                messages = self.p.evaluate("output.messages_expr", **context)
            else:
                messages = [{"role": m.role,
                             "content": self.p.render(f"output.messages[{i}].content", **context)}
                            for i, m in enumerate(out.messages)]
            tools = self.p.evaluate("output.tools_expr", **context) if out.tools_expr else None
        except Exception as exc:  # noqa: BLE001 - missing candidate fields and the like
            raise RecordError("bad_schema", f"cannot build the output: {exc}") from None
        record: dict[str, Any] = {"messages": _plain_json(messages)}
        if tools:
            record["tools"] = _plain_json(tools)
        to_conversation(record)  # the same validation `mimir prepare` applies
        return record

    def _checks(self, context: dict[str, Any]) -> tuple[list[CheckResult], dict[str, Any] | None]:
        results = run_checks(self.cfg.checks,
                             lambda i, arg: self.p.evaluate(f"checks[{i}].{arg}", **context))
        output = None
        try:
            output = self.build_output(context)
            results.append(CheckResult("output_format", "output", True))
        except RecordError as exc:
            results.append(CheckResult("output_format", "output", False, f"{exc.reason}: {exc.detail}"))
        return results, output

    async def _propose(self, row: SourceRow, base: dict[str, Any], attempt: dict[str, Any]):
        """(candidate, parse error): the source's own candidate, or the generator's."""
        if base["from_source"]:
            return self._source_candidate(row)
        call = await self.generator.chat(self._messages("generate", base))
        attempt["generator"] = call.evidence
        return self._parse_candidate(call.text)

    async def _judge(self, candidate: dict[str, Any] | None, parse_error: str | None,
                     base: dict[str, Any], attempt: dict[str, Any]) -> tuple[Verdict, dict[str, Any] | None]:
        """Deterministic checks first; the auditor only for a candidate that passes them all."""
        if parse_error is not None:
            checks, output = [CheckResult("generator_unparseable", "parse", False, parse_error)], None
        else:
            checks, output = self._checks(base | {"candidate": candidate})
        attempt["checks"] = [c.to_dict() for c in checks]
        failed = [c for c in checks if not c.passed]
        if failed:
            word = "discard" if any(c.on_fail == "discard" for c in failed) else "regenerate"
            return Verdict(word, [{"code": c.name, "detail": c.detail} for c in failed]), None
        context = base | {"candidate": candidate, "output": output, "checks": attempt["checks"]}
        call = await self.auditor.chat(self._messages("audit", context))
        attempt["auditor"] = call.evidence
        return parse_verdict(call.text, self.cfg.verdict), output

    async def process(self, row: SourceRow) -> EvidenceRow:
        """The decided row with its evidence (the record the state file appends)."""
        return EvidenceRow.decided(await self._decide(row))

    async def _decide(self, row: SourceRow) -> dict[str, Any]:
        record: dict[str, Any] = {
            "row_id": row.row_id, "source_line": row.number, "input_sha256": row.sha256,
            "pipeline": self.cfg.name, "fingerprint": self.fingerprint,
        }
        if row.error is not None:
            return record | _decided("error", [{"code": "invalid_source_row", "detail": row.error}], [])
        attempts: list[dict[str, Any]] = []
        feedback: list[dict[str, str]] = []
        previous = None
        generations = 0
        from_source = bool(self.cfg.generate.initial_candidate)
        while True:
            if not from_source and generations >= self.cfg.max_generations:
                reasons = [{"code": "attempts_exhausted",
                            "detail": f"{generations} generations without an accepted candidate"}]
                return record | _decided("discarded", reasons, attempts)
            generations += not from_source
            attempt: dict[str, Any] = {"attempt": len(attempts), "from_source": from_source,
                                       "generator": None, "auditor": None}
            base = {"row": row.record, "attempt": len(attempts), "feedback": feedback,
                    "previous": previous, "from_source": from_source}
            try:
                candidate, parse_error = await self._propose(row, base, attempt)
                attempt["candidate"] = candidate
                verdict, output = await self._judge(candidate, parse_error, base, attempt)
            except RequestRejected as exc:
                attempts.append(attempt | {"error": exc.detail})
                return record | _decided("error", [{"code": exc.code, "detail": exc.detail}], attempts)
            except jinja2.TemplateError as exc:  # e.g. a source row without a field the prompt uses
                attempts.append(attempt | {"error": str(exc)})
                reasons = [{"code": "prompt_template_error", "detail": f"{type(exc).__name__}: {exc}"}]
                return record | _decided("error", reasons, attempts)
            attempt["verdict"] = verdict.to_dict()
            attempts.append(attempt)
            if verdict.verdict == "accept":
                return record | _decided("kept" if from_source else "accepted", [], attempts, output)
            if verdict.verdict == "discard":
                return record | _decided("discarded", verdict.reasons, attempts)
            feedback, previous, from_source = verdict.reasons, candidate, False


def _decided(status: str, reasons: list[dict[str, str]], attempts: list[dict[str, Any]],
             output: dict[str, Any] | None = None) -> dict[str, Any]:
    assert status in STATUSES
    return {"status": status, "reasons": reasons, "attempts": attempts, "output": output,
            "decided_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


def _plain_json(value: Any) -> Any:
    """Jinja hands back its own list/dict proxies at times; the record must be plain JSON."""
    import json

    return json.loads(json.dumps(value, ensure_ascii=False, default=str))


def _is_done(state: StateFile, row: SourceRow, retry_errors: bool) -> bool:
    """Decided for this very input (same hash), and not an error the user asked to redo."""
    entry = state.index.get(row.row_id)
    return (entry is not None and entry.sha256 == row.sha256
            and not (retry_errors and entry.status == "error"))


def _pending_rows(pipeline: Pipeline, state: StateFile, retry_errors: bool):
    src = pipeline.config.source
    for row in iter_source(pipeline.source_path, src.format, src.id_field, src.limit):
        if not _is_done(state, row, retry_errors):
            yield row


def _count_rows(pipeline: Pipeline, state: StateFile, retry_errors: bool) -> tuple[int, int]:
    """(source rows, rows still to do); also surfaces duplicate ids before any request."""
    total = todo = 0
    src = pipeline.config.source
    for row in iter_source(pipeline.source_path, src.format, src.id_field, src.limit):
        total += 1
        todo += not _is_done(state, row, retry_errors)
    return total, todo


async def _run_rows(pipeline: Pipeline, state: StateFile, concurrency: int, retry_errors: bool,
                    bar: Any) -> None:
    cfg = pipeline.config
    endpoints = {name: ChatEndpoint(name, ep, cfg.retry) for name, ep in cfg.endpoints.items()}
    processor = RowProcessor(pipeline, endpoints)
    rows = _pending_rows(pipeline, state, retry_errors)
    in_flight: set[asyncio.Task] = set()
    try:
        exhausted = False
        while True:
            while not exhausted and len(in_flight) < concurrency:
                row = next(rows, None)
                if row is None:
                    exhausted = True
                    break
                in_flight.add(asyncio.create_task(processor.process(row)))
            if not in_flight:
                break
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                decided = task.result()  # EndpointUnavailable and bugs propagate from here
                state.append(decided)
                bar.update(1)
                bar.set_postfix_str(decided.status, refresh=False)
    finally:
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
        for ep in endpoints.values():
            await ep.close()


def run_pipeline(pipeline: Pipeline, options: RunOptions) -> AcceptanceReport:
    """Run (or resume) a pipeline; returns the acceptance report. Raises EndpointUnavailable
    (after writing the outputs of the rows decided so far) when a server stays unreachable."""
    from tqdm.auto import tqdm

    cfg = pipeline.config
    out = options.output_dir
    concurrency = options.concurrency or cfg.concurrency
    if concurrency < 1:
        raise UserError(f"concurrency must be >= 1, got {concurrency}")
    with StateFile(out) as state:
        state.check_pipeline(pipeline.fingerprint(), cfg.name, options.allow_pipeline_change)
        total, todo = _count_rows(pipeline, state, options.retry_errors)
        log.info("%s: %d source rows, %d to do (%d decided before), concurrency %d, state %s",
                 cfg.name, total, todo, total - todo, concurrency, state.path)
        stopped: BaseException | None = None
        with tqdm(total=total, initial=total - todo, desc=cfg.name, unit="row",
                  disable=not options.progress) as bar:
            try:
                asyncio.run(_run_rows(pipeline, state, concurrency, options.retry_errors, bar))
            except (EndpointUnavailable, EndpointMisconfigured) as exc:
                stopped = exc
            except KeyboardInterrupt:  # Ctrl-C: the outputs still show every row decided so far
                finalize(pipeline, state, out, stopped="interrupted")
                raise
        report = finalize(pipeline, state, out, stopped=str(stopped) if stopped else None)
    if stopped is not None:
        raise type(stopped)(f"{stopped}\n{report.decided} of {report.source_rows} rows are "
                            f"decided and kept in {out}; rerun the same command to resume")
    return report

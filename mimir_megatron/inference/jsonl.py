"""Batched generation from a JSONL file of prompts (what `mimir generate` runs).

Input lines: ``{"prompt": "text"}``, ``{"messages": [...], "tools"?: [...]}`` (rendered with the
tokenizer's chat template up to the generation prompt) or ``{"prompt_ids": [...]}``; any other
fields are copied to the output line, which adds ``completion``, ``completion_ids``,
``finish_reason`` (and ``logprobs`` with ``logprobs``). A bad line is reported with its line
number and written to the output with an ``error`` field; the others are still generated.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import atomic_files

from .requests import RequestError
from .types import GenerationRequest, SamplingParams

log = logging.getLogger("mimir")


@dataclass(frozen=True)
class GeneratedFile:
    """What :func:`generate_jsonl` wrote: the output, its lines, those generated and those refused."""

    output: Path
    lines: int
    generated: int
    bad: int


def prompt_ids(engine, record) -> list[int]:  # noqa: ANN001 (an InferenceEngine)
    """The prompt of one input line as token ids; :class:`RequestError` naming what is wrong."""
    if not isinstance(record, dict):
        raise RequestError("a line must be a JSON object")
    keys = [k for k in ("prompt", "messages", "prompt_ids") if k in record]
    if len(keys) != 1:
        raise RequestError("a line needs exactly one of prompt, messages, prompt_ids")
    value = record[keys[0]]
    if keys[0] == "prompt_ids":
        return value
    if keys[0] == "prompt":
        if not isinstance(value, str):
            raise RequestError("prompt must be a string")
        return engine.encode(value)
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise RequestError("messages must be a list of objects")
    return engine.render_chat(value, record.get("tools"))


def generate_jsonl(engine, source: str | Path, output: str | Path,  # noqa: ANN001 (an engine or its loader)
                   sampling: SamplingParams | None = None, *, h_cycles: int | None = None,
                   l_cycles: int | None = None, logprobs: bool = False) -> GeneratedFile:
    """Generate a completion for every line of ``source`` and write ``output`` (atomically, one
    line per input line). ``engine``: an ``InferenceEngine``, or a function that loads one (called
    once ``source`` is found, so a mistyped path fails at once). ``sampling`` (default: greedy,
    256 tokens) applies to every line; with a seed, line i (from 1) samples with seed + i - 1.
    ``h_cycles``/``l_cycles``: the schedule (default: as trained)."""
    source, output, sampling = Path(source), Path(output), sampling or SamplingParams()
    if not source.is_file():
        raise UserError(f"input file not found: {source}")
    if not hasattr(engine, "generate"):  # the function that loads it
        engine = engine()
    engine.limits.schedule(h_cycles, l_cycles)
    records, requests, errors = [], [], {}
    with source.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            record = None
            try:
                record = json.loads(raw)
                params = replace(sampling, seed=None if sampling.seed is None else sampling.seed + number - 1)
                request = GenerationRequest(prompt_ids(engine, record), params, h_cycles, l_cycles)
                engine.limits.check_request(request)
                requests.append((len(records), request))
            except (json.JSONDecodeError, UnicodeDecodeError, RequestError) as exc:
                errors[len(records)] = f"line {number}: {exc}"
                log.error("%s: %s", source, errors[len(records)])
            records.append(record if isinstance(record, dict) else {"line": number})
    results = engine.generate([r for _, r in requests], progress=True) if requests else []
    by_index = {i: res for (i, _), res in zip(requests, results)}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with atomic_files(output) as (tmp,), tmp.open("w") as out:
        for i, record in enumerate(records):
            line = dict(record)
            if i in errors:
                line["error"] = errors[i]
            else:
                res = by_index[i]
                line.update(completion=res.text, completion_ids=res.token_ids,
                            finish_reason=res.finish_reason)
                if logprobs:
                    line["logprobs"] = res.logprobs
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    log.info("generated %d of %d lines (%d bad) -> %s; %s", len(requests), len(records), len(errors), output,
             engine.stats.summary())
    return GeneratedFile(output, len(records), len(requests), len(errors))

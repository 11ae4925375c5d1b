"""`mimir generate`: batched generation from a JSONL file of prompts.

    mimir generate --checkpoint runs/demo/checkpoints --input prompts.jsonl --output out.jsonl

Input lines: ``{"prompt": "text"}``, ``{"messages": [...], "tools"?: [...]}`` (rendered with the
tokenizer's chat template up to the generation prompt) or ``{"prompt_ids": [...]}``; any other
fields are copied to the output line, which adds ``completion``, ``completion_ids``,
``finish_reason`` (and ``logprobs`` with ``--logprobs``). A bad line is reported with its line
number and written to the output with an ``error`` field; the others are still generated.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from mimir_megatron.checkpoint import add_model_arguments

log = logging.getLogger("mimir")


def add_generate_source(p: argparse.ArgumentParser) -> None:
    """The model flags of every command (:func:`mimir_megatron.checkpoint.add_model_arguments`) and
    the engine's."""
    add_model_arguments(p)
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model's own)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="TP size (run under torchrun)")
    p.add_argument("--compile-decode", action="store_true",
                   help="decode with static shapes through torch.compile: faster steps after a compile "
                        "per (schedule, batch size, cache size); pays off for long generations")


def engine_from_args(args: argparse.Namespace, **kwargs):
    from mimir_megatron.inference import load_engine

    return load_engine(
        model=args.model,
        checkpoint=args.checkpoint,
        ema=args.ema,
        weights=args.weights,
        hf=args.hf,
        tokenizer=args.tokenizer,
        tensor_parallel_size=args.tensor_parallel_size,
        compile_decode=args.compile_decode,
        **kwargs,
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for a JSONL file of prompts")
    add_generate_source(p)
    p.add_argument("--input", required=True, help="JSONL: prompt | messages | prompt_ids per line")
    p.add_argument("--output", required=True, help="JSONL to write (one line per input line)")
    p.add_argument("--h-cycles", type=int, help="schedule: H cycles (default: as trained)")
    p.add_argument("--l-cycles", type=int, help="schedule: L cycles per H cycle (default: as trained)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="tokens generated per row, at most (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: all)")
    p.add_argument("--seed", type=int, help="sampling seed; line i uses seed + i")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--batch-size", type=int, default=32, help="rows decoded together")
    p.add_argument("--logprobs", action="store_true", help="write per-token log-probs")
    p.set_defaults(handler=cmd_generate, setup="megatron")


def _prompt_ids(engine, record) -> list[int]:
    from mimir_megatron.inference import RequestError

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


def cmd_generate(args: argparse.Namespace) -> int:
    from mimir_megatron.errors import UserError
    from mimir_megatron.inference import GenerationRequest, RequestError, SamplingParams

    source = Path(args.input)
    if not source.is_file():
        raise UserError(f"input file not found: {source}")
    engine = engine_from_args(args, max_batch_size=args.batch_size)
    engine.limits.schedule(args.h_cycles, args.l_cycles)
    records, requests, errors = [], [], {}
    with source.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            record = None
            try:
                record = json.loads(raw)
                params = SamplingParams(
                    max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature,
                    top_k=args.top_k,
                    top_p=args.top_p,
                    seed=None if args.seed is None else args.seed + number - 1,
                    stop_strings=tuple(args.stop),
                )
                request = GenerationRequest(_prompt_ids(engine, record), params, args.h_cycles, args.l_cycles)
                engine.limits.check_request(request)
                requests.append((len(records), request))
            except (json.JSONDecodeError, UnicodeDecodeError, RequestError) as exc:
                errors[len(records)] = f"line {number}: {exc}"
                log.error("%s: %s", source, errors[len(records)])
            records.append(record if isinstance(record, dict) else {"line": number})
    results = engine.generate([r for _, r in requests], progress=True) if requests else []
    by_index = {i: res for (i, _), res in zip(requests, results)}
    tmp = Path(args.output + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("w") as out:
        for i, record in enumerate(records):
            line = dict(record)
            if i in errors:
                line["error"] = errors[i]
            else:
                res = by_index[i]
                line.update(
                    completion=res.text, completion_ids=res.token_ids, finish_reason=res.finish_reason
                )
                if args.logprobs:
                    line["logprobs"] = res.logprobs
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    tmp.replace(args.output)
    log.info(
        "generated %d of %d lines (%d bad) -> %s; %s",
        len(requests),
        len(records),
        len(errors),
        args.output,
        engine.stats.summary(),
    )
    return 1 if errors and not requests else 0

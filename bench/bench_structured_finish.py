"""Forced tool calls finish within max_tokens: replies that parse and validate, and what the
budget check costs.

For each parameter type users send (a plain string, a number, an array, a nested object), a
forced call (``tool_choice: required``) is sampled with ``--seeds`` seeds at a budget of the
shortest call plus ``--extra`` tokens; each reply is read back as the server reads it
(``parse_tool_calls``) and validated with jsonschema. The cost: time per decoding step and row
spent keeping the budget (``GrammarConstraint.accept`` beyond llguidance's own ``consume_token``),
next to the grammar's mask and the whole step; then the mask of a forced call, a response format
and the two together (tools offered with a response format: a call or the typed answer).

    python bench/bench_structured_finish.py                          # tiny model, random weights
    python bench/bench_structured_finish.py --checkpoint runs/demo   # the trained demo
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import torch

from mimir_megatron.inference import GenerationRequest, SamplingParams
from mimir_megatron.inference.grammar import GrammarConstraint, Grammars, strict_schema
from mimir_megatron.inference.tool_calls import parse_tool_calls

PARAMETERS = {
    "string": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "number": {"type": "object", "properties": {"celsius": {"type": "number"}}, "required": ["celsius"]},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["tags"]},
    "nested": {"type": "object", "required": ["where"], "properties": {"where": {
        "type": "object", "required": ["city", "days"],
        "properties": {"city": {"type": "string"},
                       "days": {"type": "array", "items": {"type": "integer"}}}}}},
}
TOKENIZER = "data_prep/mimir_data_prep/demo/tokenizer"


def _engine(checkpoint: str | None):
    from mimir_megatron.inference.loading import load_engine

    if checkpoint:
        return load_engine(checkpoint=checkpoint, tokenizer=TOKENIZER)
    from mimir_megatron.chat import load_tokenizer
    from mimir_megatron.config import load_config
    from mimir_megatron.inference import InferenceEngine
    from mimir_megatron.model import build_model

    torch.manual_seed(0)
    model = build_model(load_config("configs/model/tiny.yaml", overrides=["vocab_size=1024"]))
    return InferenceEngine(model, load_tokenizer(TOKENIZER), model_name="tiny")


class MethodTimer:
    """Wraps a method and sums its time until :meth:`restore` puts the method back."""

    def __init__(self, owner, name: str) -> None:
        self.seconds, self.calls, original = 0.0, 0, getattr(owner, name)
        self._owner, self._name, self._original = owner, name, original

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self._owner, self._name, self._original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint",
                        help="a training checkpoint (default: the tiny model, random weights)")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--extra", type=int, default=24, help="tokens above the shortest call")
    args = parser.parse_args()
    torch.set_num_threads(2)
    engine = _engine(args.checkpoint)
    grammars = Grammars(engine.tokenizer, engine.limits.vocab_size, engine.default_stop_ids)
    accept, allowed = MethodTimer(GrammarConstraint, "accept"), MethodTimer(GrammarConstraint, "allowed")
    rows = []
    for kind, parameters in PARAMETERS.items():
        tool = {"type": "function", "function": {"name": f"get_{kind}", "parameters": parameters}}
        grammar = grammars.tool_calls([tool], False)
        prompt = engine.render_chat([{"role": "user", "content": f"Call get_{kind}."}], [tool])
        shortest = grammar.min_tokens(engine.max_context)
        budget = shortest + args.extra
        sampling = [SamplingParams(max_new_tokens=budget, temperature=1.0, seed=s) for s in range(args.seeds)]
        requests = [GenerationRequest(prompt, p,
                                      constraint=grammar) for p in sampling]
        results = engine.generate(requests)
        valid, lengths = 0, []
        for r in results:
            _, calls = parse_tool_calls(r.text)
            if r.finish_reason == "stop" and len(calls) == 1:
                value = json.loads(calls[0].arguments)
                jsonschema.validate(value, strict_schema(parameters))
                valid += 1
            lengths.append(len(r.token_ids))
        rows.append((kind, shortest, budget, valid, len(results), min(lengths), max(lengths)))
    # The budget check's own time: accept() minus llguidance's consume_token, timed alone.
    plain = {"type": "function", "function": {"name": "f", "parameters": PARAMETERS["string"]}}
    probe = grammars.tool_calls([plain], False).start(10_000)
    tokens = engine.encode('<tool_call>{"name": "f", "arguments": {"city": "' + "Aarhus " * 40)
    start = time.perf_counter()
    for t in tokens:
        probe._matcher.consume_token(t)
    consume = (time.perf_counter() - start) / len(tokens)
    steps = accept.calls
    print(f"model: {args.checkpoint or 'tiny, random weights'}; sampled (temperature 1), {args.seeds} seeds; "
          f"budget = shortest call + {args.extra}")
    print("| parameter | shortest call (tokens) | max_tokens | parse and validate | reply tokens (min-max) |")
    print("| --- | --- | --- | --- | --- |")
    for kind, shortest, budget, valid, total, low, high in rows:
        print(f"| {kind} | {shortest} | {budget} | {valid}/{total} | {low}-{high} |")
    step_row = engine.stats.decode_seconds / max(1, engine.stats.decode_tokens)
    check = accept.seconds / steps - consume
    mask = allowed.seconds / allowed.calls
    print(f"per step and row: budget check {check * 1e6:.0f} us (accept {accept.seconds / steps * 1e6:.0f} "
          f"us - consume_token {consume * 1e6:.0f} us), grammar mask {mask * 1e6:.0f} us, "
          f"decoding step {step_row * 1e6:.0f} us per row ({steps} accepted tokens)")
    accept.restore()
    allowed.restore()
    _union_cost(engine, grammars, args.seeds)


def _union_cost(engine, grammars: Grammars, seeds: int) -> None:
    """The mask per step and row of each grammar a chat request can carry: a forced call, a
    response format alone, and the two together (tools offered with a response format: a call or
    the answer), on the same tool and schema; each reply read back as the server reads it."""
    tool = {"type": "function", "function": {"name": "get_nested", "parameters": PARAMETERS["nested"]}}
    schema = PARAMETERS["nested"]
    prompt = engine.render_chat([{"role": "user", "content": "Call get_nested or answer."}], [tool])
    kinds = {"forced call": grammars.tool_calls([tool], True), "response format": grammars.json(schema),
             "union (tools + response format)": grammars.union([tool], True, schema)}
    print("| grammar | shortest reply (tokens) | max_tokens | parse and validate (calls / answers) "
          "| mask per step and row (us) |")
    print("| --- | --- | --- | --- | --- |")
    for kind, grammar in kinds.items():
        timer = MethodTimer(GrammarConstraint, "allowed")
        shortest = grammar.min_tokens(engine.max_context)
        # room for every branch (a union whose budget fits only its answer never calls)
        budget = max([shortest] + [b.min_tokens(engine.max_context) for b in grammar.branches]) + 40
        sampling = [SamplingParams(max_new_tokens=budget, temperature=1.0, seed=s) for s in range(seeds)]
        results = engine.generate([GenerationRequest(prompt, p, constraint=grammar) for p in sampling])
        timer.restore()
        calls = answers = 0
        for r in results:
            _, found = parse_tool_calls(r.text)
            if found and r.finish_reason == "stop":
                for call in found:
                    jsonschema.validate(json.loads(call.arguments), strict_schema(schema))
                calls += 1
            elif not found and r.finish_reason == "stop":
                jsonschema.validate(json.loads(r.text), strict_schema(schema))
                answers += 1
        print(f"| {kind} | {shortest} | {budget} | {calls + answers}/{len(results)} "
              f"({calls} / {answers}) | {timer.seconds / timer.calls * 1e6:.0f} |")


if __name__ == "__main__":
    main()

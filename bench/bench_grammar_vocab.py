"""What structured output costs at a production vocabulary: the demo tokenizer (1,024 tokens) next to
the same tokenizer grown to ``--vocab`` tokens (default 262,144, Gemma 3's size), in one run.

No model: each decoding step draws random logits, keeps what the grammar allows and takes the
best, as the engine's sampler does (a refused token is masked and the row draws again; after three
refusals the completion's next token), so replies wander through long odd tokens, harder on the
budget than a trained model. For each parameter type users send, ``--rows`` forced tool calls at a
budget of the shortest call plus ``--extra`` tokens: every reply must parse (as the server reads
it) and validate. Reported per tokenizer: the grammar set-up on first use (llguidance's tokenizer
and the completion search's ranking), compiling one tool's grammar, the shortest-call search, and
per decoding step and row the mask (``allowed``) and the budget check (``accept``).

    python bench/bench_grammar_vocab.py                  # 1,024 vs 262,144 tokens
    python bench/bench_grammar_vocab.py --vocab 131072 --rows 10

The grown tokenizer keeps the demo's special tokens, chat template and merges, then adds merges of
existing tokens (letters, words, JSON punctuation, spaces) until the vocabulary is full: the token
texts a real large vocabulary has (long words, ``"}``-style closers, runs of spaces), not its
statistics.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import jsonschema
import torch
from bench_structured_finish import MethodTimer

from mimir_megatron.chat import load_tokenizer
from mimir_megatron.inference.grammar import GrammarConstraint, Grammars, strict_schema
from mimir_megatron.inference.text import default_stop_ids
from mimir_megatron.inference.tool_calls import parse_tool_calls

DEMO = Path(__file__).resolve().parents[1] / "data_prep" / "mimir_data_prep" / "demo" / "tokenizer"
PARAMETERS = {
    "string": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "number": {"type": "object", "properties": {"celsius": {"type": "number"}}, "required": ["celsius"]},
    "enum": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit", "kelvin"]}},
             "required": ["unit"]},
    "nested": {"type": "object", "required": ["where"], "properties": {"where": {
        "type": "object", "required": ["city", "days"],
        "properties": {"city": {"type": "string"},
                       "days": {"type": "array", "items": {"type": "integer"}}}}}},
}
# ByteLevel's printable stand-ins: "Ġ" is a space, "Ċ" a newline.
PIECES = ['"', '"}', '"}}', '":', '",', "{", "}", "[", "]", ",", ":", "Ġ", "ĠĠ", "ĠĠĠĠ", "Ċ", "0", "1", "-"]


def grown_tokenizer(vocab: int, out: Path, seed: int = 0) -> Path:
    """The demo tokenizer with merges added until it has ``vocab`` tokens, written to ``out``."""
    spec = json.loads((DEMO / "tokenizer.json").read_text())
    model = spec["model"]
    tokens: dict[str, int] = model["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    specials = {a["content"] for a in spec["added_tokens"]}
    rng = random.Random(seed)
    pool = [t for t in tokens if t not in specials]
    short = [t for t in pool if len(t) <= 2] + [p for p in PIECES if p in tokens]
    while len(tokens) < vocab:
        left = rng.choice(pool) if rng.random() < 0.7 else rng.choice(short)
        right = rng.choice(short) if rng.random() < 0.8 else rng.choice(pool)
        merged = left + right
        if merged in tokens or len(merged) > 24 or left not in tokens or right not in tokens:
            continue
        tokens[merged] = len(tokens)
        merges.append((left, right))
        pool.append(merged)
    model["merges"] = [list(m) for m in merges]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    shutil.copy(DEMO / "tokenizer_config.json", out / "tokenizer_config.json")
    return out


def _sample(constraint: GrammarConstraint, vocab: int, stop_ids: tuple[int, ...],
            generator: torch.Generator) -> list[int]:
    """One reply, as the engine's sampler takes it: random logits within the grammar's mask."""
    allowed, tokens = torch.zeros(vocab, dtype=torch.bool), []
    while not constraint.done and constraint.budget > 0:
        constraint.allowed(allowed)
        logits = torch.rand(vocab, generator=generator)
        for attempt in range(4):
            token = int(torch.where(allowed, logits, -1.0).argmax())
            if constraint.accept(token):
                break
            allowed[token] = False
            if attempt == 2 or not allowed.any():
                allowed.zero_()
                allowed[constraint.fallback] = True
        else:
            raise RuntimeError("the grammar accepts no token")
        tokens.append(token)
        if token in stop_ids:
            break
    return tokens


def measure(tokenizer_dir: Path, rows: int, extra: int) -> dict:
    tokenizer = load_tokenizer(str(tokenizer_dir))
    vocab, stops = len(tokenizer), default_stop_ids(tokenizer)
    grammars = Grammars(tokenizer, vocab, stops)
    start = time.perf_counter()
    grammars.json(None)  # builds llguidance's tokenizer and the ranking once
    setup = time.perf_counter() - start
    allowed, accept = MethodTimer(GrammarConstraint, "allowed"), MethodTimer(GrammarConstraint, "accept")
    found = {"vocab": vocab, "setup_s": setup, "kinds": {}}
    generator = torch.Generator().manual_seed(0)
    for kind, parameters in PARAMETERS.items():
        tool = {"type": "function", "function": {"name": f"get_{kind}", "parameters": parameters}}
        start = time.perf_counter()
        grammar = grammars.tool_calls([tool], False)
        compiled = time.perf_counter() - start
        start = time.perf_counter()
        shortest = grammar.min_tokens(4096)
        search = time.perf_counter() - start
        valid, lengths = 0, []
        for _ in range(rows):
            tokens = _sample(grammar.start(shortest + extra), vocab, stops, generator)
            _, calls = parse_tool_calls(tokenizer.decode([t for t in tokens if t not in stops]))
            if len(calls) == 1:
                jsonschema.validate(json.loads(calls[0].arguments), strict_schema(parameters))
                valid += 1
            lengths.append(len(tokens))
        found["kinds"][kind] = {"compile_s": compiled, "search_s": search, "shortest": shortest,
                                "valid": valid, "rows": rows, "tokens": (min(lengths), max(lengths))}
    found["allowed_us"] = allowed.seconds / allowed.calls * 1e6
    found["accept_us"] = accept.seconds / accept.calls * 1e6
    found["steps"] = accept.calls
    allowed.restore()
    accept.restore()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=262_144, help="the grown tokenizer's size")
    parser.add_argument("--rows", type=int, default=20, help="forced calls per parameter type")
    parser.add_argument("--extra", type=int, default=24, help="budget above the shortest call (tokens)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        grown = grown_tokenizer(args.vocab, Path(tmp) / "grown")
        print(f"grown tokenizer: {args.vocab:,} tokens in {time.perf_counter() - start:.1f} s")
        results = [measure(DEMO, args.rows, args.extra), measure(grown, args.rows, args.extra)]
    small, large = results
    print(f"random logits within the grammar's mask; budget = shortest call + {args.extra}; {args.rows} rows "
          "per type\n")
    print("| tokenizer | parameter | compile (ms) | shortest-call search (ms) | shortest (tokens) | "
          "parse and validate | reply tokens (min-max) |")
    print("| --- | --- | ---: | ---: | ---: | --- | --- |")
    for r in results:
        for kind, k in r["kinds"].items():
            print(f"| {r['vocab']:,} | {kind} | {1e3 * k['compile_s']:.1f} | {1e3 * k['search_s']:.1f} | "
                  f"{k['shortest']} | {k['valid']}/{k['rows']} | {k['tokens'][0]}-{k['tokens'][1]} |")
    print()
    for r in results:
        print(f"{r['vocab']:>9,} tokens: set-up {r['setup_s']:.2f} s; per step and row: "
              f"mask {r['allowed_us']:.0f} us, budget check (accept) {r['accept_us']:.0f} us "
              f"({r['steps']} steps)")
    ratio = {key: large[key] / small[key] for key in ("setup_s", "allowed_us", "accept_us")}
    print(f"ratio {large['vocab']:,} / {small['vocab']:,}: set-up {ratio['setup_s']:.0f}x, "
          f"mask {ratio['allowed_us']:.1f}x, accept {ratio['accept_us']:.1f}x")

if __name__ == "__main__":
    main()

"""The exact shortest-reply search of a grammar whose replies are few texts: the texts a schema
admits (as the grammar writes them) and the fewest tokens that write one of them, each against
an enumeration by hand."""

from __future__ import annotations

import itertools
import json
import random
from types import SimpleNamespace

from mimir_megatron.inference.grammar import fewest_tokens, finite_texts


def _written(value) -> str:
    return json.dumps(value, separators=(", ", ": "))


def test_finite_texts_are_every_value_as_the_grammar_writes_it():
    schema = {"type": "object", "additionalProperties": False, "required": ["unit", "days"],
              "properties": {"unit": {"enum": ["C", "F"]}, "exact": {"type": "boolean"},
                             "days": {"type": "integer", "minimum": 1, "exclusiveMaximum": 4},
                             "note": {"const": None}}}
    expected = []
    for unit, days in itertools.product(["C", "F"], [1, 2, 3]):
        for exact, note in itertools.product([None, True, False], [False, True]):  # optional: absent or each value
            value = {"unit": unit, **({} if exact is None else {"exact": exact}), "days": days,
                     **({"note": None} if note else {})}
            expected.append(_written(value))
    assert sorted(finite_texts(schema)) == sorted(expected) and len(expected) == 36
    assert finite_texts({"anyOf": [{"enum": [1, 2]}, {"type": "null"}, {"const": "x"}]}) == ["1", "2", "null", '"x"']
    assert finite_texts({"type": "integer", "enum": [1, "a", True]}) == ["1"]  # the type filters the values


def test_finite_texts_refuse_what_admits_unboundedly_many_or_too_many():
    for schema in ({"type": "string"}, {"type": "number"}, {"type": "array", "items": {"enum": [1]}},
                   {"type": "integer", "minimum": 0},  # one side only
                   {"type": "object", "properties": {"a": {"enum": [1]}}},  # other keys allowed
                   {"enum": [1], "pattern": "x"},  # a keyword this does not read
                   {"$ref": "#/$defs/x"}, True):
        assert finite_texts(schema) is None, schema
    assert finite_texts({"type": "integer", "minimum": 0, "maximum": 63}) is not None
    assert finite_texts({"type": "integer", "minimum": 0, "maximum": 64}) is None  # 65 texts > 64
    many = {"type": "object", "additionalProperties": False, "required": ["a", "b", "c"],
            "properties": {k: {"enum": [1, 2, 3, 4, 5]} for k in "abc"}}
    assert finite_texts(many) is None and finite_texts(many, limit=125) is not None


def test_fewest_tokens_is_the_shortest_tokenisation_of_any_text():
    pieces = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab", '"', '"a']
    vocab = SimpleNamespace(ids_by_bytes={p.encode(): i for i, p in enumerate(pieces)},
                            longest=max(len(p) for p in pieces))

    def by_hand(text: str) -> int | None:  # every split of the text into the vocabulary's pieces
        best = None
        for cuts in itertools.product([False, True], repeat=len(text) - 1):
            parts, start = [], 0
            for i, cut in enumerate(cuts, 1):
                if cut:
                    parts.append(text[start:i])
                    start = i
            parts.append(text[start:])
            if all(p.encode() in vocab.ids_by_bytes for p in parts) and (best is None or len(parts) < best):
                best = len(parts)
        return best

    texts = ['"abcab', '"abcabc', '"abcabca', '"acab', '"bcca', '"cc', '"ccab']  # sharing prefixes
    for text in texts:
        path = fewest_tokens([text], vocab)
        assert "".join(pieces[t] for t in path) == text and len(path) == by_hand(text), text
    path = fewest_tokens(texts, vocab)  # each text reusing what it shares with the one before
    assert len(path) == min(by_hand(t) for t in texts) and "".join(pieces[t] for t in path) in texts
    assert fewest_tokens(["xyz"], vocab) is None  # no token writes it

    rng = random.Random(0)  # sets of texts that share prefixes, small vocabularies: against every split
    for _ in range(300):
        pieces = list(dict.fromkeys(["a", "b"] + ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(6)]))
        vocab = SimpleNamespace(ids_by_bytes={p.encode(): i for i, p in enumerate(pieces)},
                                longest=max(len(p) for p in pieces))
        stem = "".join(rng.choices("abc", k=rng.randint(0, 4)))
        texts = [stem + "".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        found = [n for n in map(by_hand, texts) if n is not None]
        path = fewest_tokens(texts, vocab)
        assert (None if path is None else len(path)) == (min(found) if found else None), (pieces, texts)

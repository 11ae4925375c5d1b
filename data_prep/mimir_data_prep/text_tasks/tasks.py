"""The four task families. Each takes a passage (a verbatim slice of the source) and a seeded
``random.Random`` and returns a :class:`TextSample` whose completion is verbatim source text."""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import Callable

from .templates import LANGUAGES, MASK_MARKER, TEMPLATES

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_LETTERS = string.ascii_lowercase + "æøå"


@dataclass(frozen=True)
class TextSample:
    prompt: str
    completion: str
    task: str
    lang: str


def split_units(text: str) -> list[str]:
    """Paragraphs if the passage has several, else sentences; joined back they give ``text``
    up to whitespace (the completion uses ``text`` itself, never the re-joined units)."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if len(paragraphs) > 1:
        return paragraphs
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def _instruction(task: str, lang: str, rng: random.Random, **fields: str) -> str:
    if lang not in LANGUAGES:
        raise ValueError(f"language {lang!r} not in {LANGUAGES}")
    return rng.choice(TEMPLATES[task][lang]).format(**fields)


def corruption_repair(text: str, lang: str, rng: random.Random) -> TextSample:
    """Character noise (swap, drop, double, replace) on about one word in six."""
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if len(w) >= 3]
    n = max(1, len(candidates) // 6) if candidates else 0
    for i in rng.sample(candidates, n):
        words[i] = _corrupt_word(words[i], rng)
    noisy = " ".join(words)
    if noisy == text and text:  # guarantee the prompt differs: drop one character
        pos = rng.randrange(len(text))
        noisy = text[:pos] + text[pos + 1 :]
    return TextSample(_instruction("repair", lang, rng, text=noisy), text, "repair", lang)


def _corrupt_word(word: str, rng: random.Random) -> str:
    pos = rng.randrange(len(word) - 1)
    kind = rng.randrange(4)
    if kind == 0:
        return word[:pos] + word[pos + 1] + word[pos] + word[pos + 2 :]
    if kind == 1:
        return word[:pos] + word[pos + 1 :]
    if kind == 2:
        return word[:pos] + word[pos] + word[pos:]
    return word[:pos] + rng.choice(_LETTERS) + word[pos + 1 :]


def span_filling(text: str, lang: str, rng: random.Random) -> TextSample:
    """T5-style: 1-3 word spans replaced by numbered sentinel markers."""
    words = text.split(" ")
    n_spans = min(3, max(1, len(words) // 8))
    starts = sorted(rng.sample(range(len(words)), min(n_spans, len(words))))
    out, marker, i = [], 1, 0
    while i < len(words):
        if starts and i == starts[0]:
            starts.pop(0)
            out.append(MASK_MARKER.format(marker))
            marker += 1
            i += rng.randint(1, 3)
            while starts and starts[0] < i:  # spans that would overlap merge into one
                starts.pop(0)
        else:
            out.append(words[i])
            i += 1
    markers = ", ".join(MASK_MARKER.format(k) for k in range(1, marker))
    prompt = _instruction("spans", lang, rng, text=" ".join(out), markers=markers)
    return TextSample(prompt, text, "spans", lang)


def prefix_continuation(text: str, lang: str, rng: random.Random) -> TextSample:
    """The prompt holds the first part (cut at a word boundary); the rest is the completion."""
    spaces = [m.start() for m in re.finditer(r" ", text)]
    if not spaces:
        raise ValueError("prefix continuation needs a passage of at least two words")
    lo, hi = len(spaces) // 4, max(len(spaces) // 4, (3 * len(spaces)) // 4)
    cut = spaces[rng.randint(lo, hi)]
    head, tail = text[:cut], text[cut + 1 :]
    return TextSample(_instruction("continue", lang, rng, text=head), tail, "continue", lang)


def paragraph_reordering(text: str, lang: str, rng: random.Random) -> TextSample:
    """Units (paragraphs, or sentences of a single paragraph) shuffled into a different order."""
    units = split_units(text)
    if len(set(units)) < 2:
        raise ValueError("reordering needs at least two distinct paragraphs or sentences")
    order = list(range(len(units)))
    while [units[i] for i in order] == units:  # terminates: two units differ
        rng.shuffle(order)
    shuffled = "\n".join(units[i] for i in order)
    return TextSample(_instruction("reorder", lang, rng, text=shuffled), text, "reorder", lang)


TASK_FAMILIES: dict[str, Callable[[str, str, random.Random], TextSample]] = {
    "repair": corruption_repair,
    "spans": span_filling,
    "continue": prefix_continuation,
    "reorder": paragraph_reordering,
}


def make_sample(task: str, text: str, lang: str, seed: int) -> TextSample:
    """Deterministic for (task, text, lang, seed)."""
    if task not in TASK_FAMILIES:
        raise ValueError(f"unknown task family {task!r}; choose from {sorted(TASK_FAMILIES)}")
    return TASK_FAMILIES[task](text, lang, random.Random(f"{task}:{lang}:{seed}"))

"""IFEval-style verifiable instructions (Zhou et al. 2023), the common subset, strict variant.

Rows carry IFEval's own columns: ``instruction_id_list`` and ``kwargs`` (one dict per
instruction). A row counts as followed when every instruction is (prompt-level strict
accuracy). The reference library (``instruction_following_eval``) needs nltk data downloads, so
the checks that the paper's Danish IFEval uses most are written here; an instruction id outside
this set is reported by name rather than silently passed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any


def _compare(count: int, relation: str, target: int) -> bool:
    return count < target if relation == "less than" else count >= target


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


def _json(text: str, **_: Any) -> bool:
    body = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def _paragraphs(text: str, num_paragraphs: int, **_: Any) -> bool:
    parts = [p for p in re.split(r"\s?\*\*\*\s?", text)]
    return len(parts) == num_paragraphs and all(p.strip() for p in parts)


def _bullets(text: str, num_bullets: int, **_: Any) -> bool:
    return len(re.findall(r"^\s*[\*\-]\s", text, flags=re.MULTILINE)) == num_bullets


def _highlights(text: str, num_highlights: int, **_: Any) -> bool:
    marked = re.findall(r"\*[^\n\*]+\*", text) + re.findall(r"\*\*[^\n\*]+\*\*", text)
    return sum(1 for m in marked if m.strip("*").strip()) >= num_highlights


def _frequency(text: str, keyword: str, frequency: int, relation: str, **_: Any) -> bool:
    count = len(re.findall(rf"\b{re.escape(keyword)}\b", text, flags=re.IGNORECASE))
    return _compare(count, relation, frequency)


def _letter_frequency(text: str, letter: str, let_frequency: int, let_relation: str, **_: Any) -> bool:
    return _compare(text.lower().count(letter.lower()), let_relation, let_frequency)


CHECKS: dict[str, Callable[..., bool]] = {
    "punctuation:no_comma": lambda text, **_: "," not in text,
    "change_case:english_lowercase": lambda text, **_: text == text.lower(),
    "change_case:english_capital": lambda text, **_: text == text.upper(),
    "detectable_format:title": lambda text, **_: bool(re.search(r"<<[^\n]+>>", text)),
    "detectable_format:json_format": _json,
    "detectable_format:number_bullet_lists": _bullets,
    "detectable_format:number_highlighted_sections": _highlights,
    "length_constraints:number_words":
        lambda text, num_words, relation, **_: _compare(len(_words(text)), relation, num_words),
    "length_constraints:number_paragraphs": _paragraphs,
    "keywords:existence":
        lambda text, keywords, **_: all(re.search(rf"\b{re.escape(k)}\b", text, re.IGNORECASE)
                                        for k in keywords),
    "keywords:forbidden_words":
        lambda text, forbidden_words, **_: not any(
            re.search(rf"\b{re.escape(w)}\b", text, re.IGNORECASE) for w in forbidden_words),
    "keywords:frequency": _frequency,
    "keywords:letter_frequency": _letter_frequency,
    "startend:end_checker":
        lambda text, end_phrase, **_: text.strip().lower().endswith(end_phrase.strip().lower()),
    "startend:quotation":
        lambda text, **_: len(text.strip()) > 1 and text.strip()[0] == text.strip()[-1] == '"',
    "detectable_content:postscript":
        lambda text, postscript_marker, **_: bool(
            re.search(rf"\s*{re.escape(postscript_marker.lower())}", text.lower(), re.MULTILINE)),
    "detectable_content:number_placeholders":
        lambda text, num_placeholders, **_: len(re.findall(r"\[.*?\]", text)) >= num_placeholders,
}


def unsupported(instruction_ids: list[str]) -> list[str]:
    return sorted({i for i in instruction_ids if i not in CHECKS})


def follows(response: str, instruction_ids: list[str], kwargs: list[dict[str, Any] | None]) -> list[bool]:
    """One verdict per instruction (strict: the response as given)."""
    verdicts = []
    for instruction, args in zip(instruction_ids, kwargs):
        clean = {k: v for k, v in (args or {}).items() if v is not None}
        verdicts.append(bool(CHECKS[instruction](response, **clean)))
    return verdicts

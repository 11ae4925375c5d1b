"""The auditor's reply as a verdict (accept / regenerate / discard) with reasons.

Auditors are asked for a JSON object such as
``{"verdict": "regenerate", "reasons": [{"code": "wrong_answer", "detail": "..."}]}``; models wrap
it in prose or code fences, so the first JSON object in the reply that carries the verdict field
is used. A reply without one is *unparseable*: its verdict is the pipeline's ``on_unparseable``
with the reason ``auditor_unparseable``, and the raw reply stays in the evidence.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

VERDICTS = ("accept", "regenerate", "discard")
UNPARSEABLE = "auditor_unparseable"
_CODE = re.compile(r"[^a-z0-9_]+")


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reasons: list[dict[str, str]] = field(default_factory=list)
    """Each {"code": short_snake_case, "detail": free text}."""
    parsed: bool = True

    @property
    def codes(self) -> list[str]:
        return [r["code"] for r in self.reasons]

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reasons": self.reasons, "parsed": self.parsed}


def json_objects(text: str) -> list[Any]:
    """Every top-level JSON object or array embedded in ``text``, in order (fences, prose ignored)."""
    decoder = json.JSONDecoder()
    found, i = [], 0
    while i < len(text):
        j = min((k for k in (text.find("{", i), text.find("[", i)) if k >= 0), default=-1)
        if j < 0:
            break
        try:
            obj, end = decoder.raw_decode(text, j)
        except json.JSONDecodeError:
            i = j + 1
            continue
        found.append(obj)
        i = end
    return found


def first_json_object(text: str, required: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """The first JSON object in ``text`` that has every ``required`` key, else None."""
    for obj in json_objects(text):
        if isinstance(obj, dict) and all(k in obj for k in required):
            return obj
    return None


def reason_code(text: str) -> str:
    """A free-text reason as a short code for counting: "Wrong answer!" -> "wrong_answer"."""
    code = _CODE.sub("_", str(text).strip().casefold()).strip("_")
    return code[:48].rstrip("_") or "unspecified"


def normalise_reasons(value: Any, allowed: list[str] | tuple[str, ...] = ()) -> list[dict[str, str]]:
    """Reasons given as a string, a list of strings or a list of {"code", "detail"} objects."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    reasons = []
    for item in items:
        if isinstance(item, dict):
            detail = str(item.get("detail") or item.get("reason") or item.get("message") or "")
            code = reason_code(item.get("code") or detail)
        else:
            detail = str(item)
            code = reason_code(detail)
        if allowed and code not in allowed:
            code = "other"
        reasons.append({"code": code, "detail": detail})
    return reasons


def parse_verdict(reply: str | None, cfg: Any) -> Verdict:
    """``cfg`` is a VerdictConfig (verdict_key, reasons_key, aliases, on_unparseable, reason_codes)."""
    obj = first_json_object(reply or "", (cfg.verdict_key,))
    word = obj.get(cfg.verdict_key) if obj else None
    if isinstance(word, str):
        word = word.strip().casefold()
        word = cfg.aliases.get(word, word)
    if word not in VERDICTS:
        got = "no JSON object with a verdict" if obj is None else f"unknown verdict {word!r}"
        return Verdict(cfg.on_unparseable, [{"code": UNPARSEABLE, "detail": got}], parsed=False)
    reasons = normalise_reasons(obj.get(cfg.reasons_key), cfg.reason_codes)
    if word != "accept" and not reasons:
        reasons = [{"code": "unspecified", "detail": "the auditor gave no reason"}]
    return Verdict(word, reasons)

"""Deterministic checks run on every candidate before the auditor is asked.

A check that fails short-cuts the audit: the row is regenerated (the failure goes back to the
generator as feedback) or discarded, per the check's ``on_fail``. Checks see their arguments
already evaluated (Jinja expressions over ``row`` and ``candidate``), so they are plain functions
of strings and message lists, testable without a pipeline.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

CHECK_KINDS = ("verbatim", "not_contains", "length", "structure", "json_equal")
ON_FAIL = ("regenerate", "discard")
STRUCTURE_PARTS = ("roles", "code_blocks", "inline_code", "math", "structured", "labels")

# What each kind reads (expression arguments) and must be given.
_ARGS = {
    "verbatim": ("needle", "haystack"),
    "not_contains": ("needle", "haystack"),
    "length": ("value",),
    "structure": ("source", "target"),
    "json_equal": ("source", "target"),
}
EXPRESSION_ARGS = ("needle", "haystack", "value", "source", "target")

_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[^\n]*\n.*?^[ \t]*\1[ \t]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]+`")
_MATH = re.compile(
    r"\$\$.+?\$\$|\\\[.+?\\\]|\\\(.+?\\\)|(?<![\\$\w])\$(?=\S)[^$\n]+?(?<=\S)\$(?!\w)", re.S
)
# Answer-option labels at line starts ("A)", "(b)", "C." "D:"), markup tags, template
# placeholders and sentinel markers: a translation must not touch them.
_LABELS = re.compile(
    r"(?m)^[ \t]*(?:\([A-Ha-h]\)|[A-H][).:])(?=\s)|</?[A-Za-z_][\w:-]*\s*/?>|\{\{?\s*\w+\s*\}?\}|<mask_\d+>"
)


@dataclass(frozen=True)
class CheckResult:
    name: str
    kind: str
    passed: bool
    detail: str = ""
    on_fail: str = "regenerate"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "passed": self.passed, "detail": self.detail,
                "on_fail": self.on_fail}


def check_errors(check: Any) -> list[str]:
    """Configuration mistakes of one check (a CheckConfig), each as ``.field: message``."""
    errs = []
    if check.kind not in CHECK_KINDS:
        return [f".kind must be one of {', '.join(CHECK_KINDS)}, got {check.kind!r}"]
    if check.on_fail not in ON_FAIL:
        errs.append(f".on_fail must be one of {', '.join(ON_FAIL)}, got {check.on_fail!r}")
    needed = _ARGS[check.kind]
    for arg in EXPRESSION_ARGS:
        given = getattr(check, arg) is not None
        if arg in needed and not given:
            errs.append(f".{arg}: required for kind {check.kind}")
        elif arg not in needed and given:
            errs.append(f".{arg}: not used by kind {check.kind} (it reads {', '.join(needed)})")
    if check.min_chars < 0 or (check.max_chars is not None and check.max_chars < check.min_chars):
        errs.append(f".min_chars/.max_chars: need 0 <= min_chars <= max_chars, got "
                    f"{check.min_chars} and {check.max_chars}")
    bad_parts = sorted(set(check.preserve) - set(STRUCTURE_PARTS))
    if bad_parts:
        errs.append(f".preserve: unknown part(s) {', '.join(bad_parts)}; known: {', '.join(STRUCTURE_PARTS)}")
    for pattern in check.patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            errs.append(f".patterns: {pattern!r} is not a regular expression: {exc}")
    return errs


def run_checks(checks: list[Any], evaluate: Callable[[int, str], Any]) -> list[CheckResult]:
    """Run every check; ``evaluate(i, arg)`` returns the value of ``checks[i].arg``."""
    results = []
    for i, check in enumerate(checks):
        name = check.name or check.kind
        args: dict[str, Any] = {}
        try:
            for arg in _ARGS[check.kind]:
                args[arg] = _plain(evaluate(i, arg))
        except Exception as exc:  # noqa: BLE001 - a candidate without the field fails the check
            results.append(CheckResult(name, check.kind, False, f"cannot evaluate {arg}: {exc}",
                                       check.on_fail))
            continue
        passed, detail = _KINDS[check.kind](check, **args)
        results.append(CheckResult(name, check.kind, passed, detail, check.on_fail))
    return results


def _plain(value: Any) -> Any:
    """Jinja Undefined (a missing field) must fail loudly, not compare as an empty string."""
    import jinja2

    if isinstance(value, jinja2.Undefined):
        value._fail_with_undefined_error()
    return value


def _normalise(text: str, check: Any) -> str:
    if check.normalize_whitespace:
        text = " ".join(text.split())
    return text if check.case_sensitive else text.casefold()


def verbatim(check: Any, needle: Any, haystack: Any) -> tuple[bool, str]:
    """The needle occurs, character for character, in the haystack (the answer is in the source)."""
    if not isinstance(needle, str) or not isinstance(haystack, str):
        return False, f"needs text, got {type(needle).__name__} in {type(haystack).__name__}"
    if not needle.strip():
        return False, "empty needle"
    if _normalise(needle, check) in _normalise(haystack, check):
        return True, ""
    return False, f"not found verbatim in the source: {_excerpt(needle)}"


def not_contains(check: Any, needle: Any, haystack: Any) -> tuple[bool, str]:
    """The needle must not occur in the haystack (e.g. the question must not give the answer)."""
    if not isinstance(needle, str) or not isinstance(haystack, str):
        return False, f"needs text, got {type(needle).__name__} in {type(haystack).__name__}"
    if needle.strip() and _normalise(needle, check) in _normalise(haystack, check):
        return False, f"must not contain {_excerpt(needle)}"
    return True, ""


def length(check: Any, value: Any) -> tuple[bool, str]:
    if not isinstance(value, str):
        return False, f"needs text, got {type(value).__name__}"
    n = len(value.strip())
    if n < check.min_chars:
        return False, f"{n} characters, need >= {check.min_chars}"
    if check.max_chars is not None and n > check.max_chars:
        return False, f"{n} characters, need <= {check.max_chars}"
    return True, ""


def json_equal(check: Any, source: Any, target: Any) -> tuple[bool, str]:
    a, b = _as_json(source), _as_json(target)
    if a == b:
        return True, ""
    return False, f"structured value changed: {_excerpt(json.dumps(b, ensure_ascii=False))}"


def structure(check: Any, source: Any, target: Any) -> tuple[bool, str]:
    """Roles, code blocks, inline code, formulas, labels and structured outputs come back unchanged."""
    if not _is_messages(source):
        return False, "source is not a list of messages"
    if not _is_messages(target):
        return False, f"translation is not a list of messages (got {type(target).__name__})"
    problems = structure_differences(source, target, check.preserve, check.patterns)
    return (not problems), "; ".join(problems[:5])


def structure_differences(source: list[dict], target: list[dict], preserve: list[str],
                          patterns: list[str] = ()) -> list[str]:
    """Every preserved part that differs between two conversations, one message each."""
    problems = []
    if len(source) != len(target):
        return [f"{len(target)} messages, the source has {len(source)}"]
    extra = [re.compile(p) for p in patterns]
    for i, (a, b) in enumerate(zip(source, target)):
        where = f"message {i} ({a.get('role')})"
        if "roles" in preserve:
            for key in ("role", "name", "tool_call_id"):
                if a.get(key) != b.get(key):
                    problems.append(f"{where}: {key} {a.get(key)!r} became {b.get(key)!r}")
        ta, tb = a.get("content") or "", b.get("content") or ""
        if not isinstance(tb, str):
            problems.append(f"{where}: content is not text")
            continue
        if "structured" in preserve:
            if _as_json(a.get("tool_calls")) != _as_json(b.get("tool_calls")):
                problems.append(f"{where}: tool_calls changed")
            ja = _parse_json(ta)
            if ja is not None and ja != _parse_json(tb):
                problems.append(f"{where}: structured (JSON) content changed")
                continue
        for part, (sa, sb) in _parts(ta, tb, preserve, extra).items():
            if sa != sb:
                problems.append(f"{where}: {_describe(part, sa, sb)}")
    return problems


def _parts(a: str, b: str, preserve: list[str], extra: list[re.Pattern]) -> dict[str, tuple[list, list]]:
    out = {}
    fa, fb = _fences(a), _fences(b)
    if "code_blocks" in preserve:
        out["code block"] = (fa, fb)
    ra, rb = _FENCE.sub(" ", a), _FENCE.sub(" ", b)  # the rest is searched outside code blocks
    if "inline_code" in preserve:
        out["inline code"] = (_INLINE_CODE.findall(ra), _INLINE_CODE.findall(rb))
    ra, rb = _INLINE_CODE.sub(" ", ra), _INLINE_CODE.sub(" ", rb)
    if "math" in preserve:
        out["formula"] = (_MATH.findall(ra), _MATH.findall(rb))
    if "labels" in preserve:
        out["label"] = ([m.strip() for m in _LABELS.findall(ra)], [m.strip() for m in _LABELS.findall(rb)])
    for pattern in extra:
        out[f"match of {pattern.pattern!r}"] = (pattern.findall(ra), pattern.findall(rb))
    return out


def _fences(text: str) -> list[str]:
    return [m.group(0).strip() for m in _FENCE.finditer(text)]


def _describe(part: str, a: list, b: list) -> str:
    if len(a) != len(b):
        return f"{len(b)} {part}(s), the source has {len(a)}"
    k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return f"{part} {k + 1} changed: {_excerpt(str(a[k]))} -> {_excerpt(str(b[k]))}"


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def _parse_json(text: str) -> Any:
    text = text.strip()
    if not text or text[0] not in "[{":
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _as_json(value: Any) -> Any:
    """Structured values compared by content: JSON strings are parsed, key order is ignored."""
    if isinstance(value, str):
        parsed = _parse_json(value)
        return value if parsed is None else parsed
    return json.loads(json.dumps(value, sort_keys=True, default=str)) if value is not None else None


def _excerpt(text: str, width: int = 60) -> str:
    text = " ".join(str(text).split())
    return repr(text if len(text) <= width else text[: width - 3] + "...")


_KINDS: dict[str, Callable[..., tuple[bool, str]]] = {
    "verbatim": verbatim,
    "not_contains": not_contains,
    "length": length,
    "structure": structure,
    "json_equal": json_equal,
}

"""Parsing the values public tool-use data writes: JSON, single-quoted JSON, Python literals, and
Python-like call lists (``[name(arg=value, ...)]``).

Python syntax is only ever *parsed* (``ast.parse``) and walked by a small evaluator that accepts
literals and nothing else; no code runs. JSON's ``true``/``false``/``null`` are accepted inside
Python syntax because single-quoted JSON mixes the two.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from dataclasses import dataclass
from typing import Any

from .trace import ConversionError

_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]


def parse_literal(text: str) -> tuple[Any, str]:
    """(value, "json" | "python"); ValueError if the text is neither JSON nor a literal."""
    try:
        return json.loads(text), "json"
    except (json.JSONDecodeError, RecursionError):
        pass
    return _literal(_parse(text.strip())), "python"


def _parse(text: str) -> ast.expr:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "invalid escape sequence" in JSON-escaped text
            return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"not JSON or a Python literal ({type(exc).__name__})") from None


def _literal(node: ast.AST) -> Any:
    """The value of a literal expression: constants, lists, tuples, dicts, signed numbers."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("'**' in a literal")
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise ValueError("a dict key must be a string or a number")
            out[key if isinstance(key, str) else json.dumps(key)] = _literal(v)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not a literal: {type(node).__name__}")


def parse_arguments(value: Any) -> tuple[dict[str, Any], str | None]:
    """Call arguments as an object, and how they were written (None: already an object).

    Accepts an object, a JSON string (also double-encoded), single-quoted JSON or a Python dict
    literal, and empty/None for "no arguments". ConversionError('bad_arguments') otherwise.
    """
    if isinstance(value, dict):
        return value, None
    if value is None:
        return {}, "arguments_missing"
    if not isinstance(value, str):
        raise ConversionError("bad_arguments", f"arguments are a {type(value).__name__}, not an object")
    if not value.strip():
        return {}, "arguments_missing"
    how = None
    for _ in range(2):  # a JSON string holding a JSON string: unwrap once
        try:
            value, kind = parse_literal(value)
        except ValueError as exc:
            raise ConversionError("bad_arguments", f"arguments: {exc}") from None
        how = how or f"arguments_{'json' if kind == 'json' else 'python_literal'}_string"
        if not isinstance(value, str):
            break
    if not isinstance(value, dict):
        raise ConversionError("bad_arguments", f"arguments are a {type(value).__name__}, not an object")
    return value, how


def parse_call_list(text: str, declared: list[str] | tuple[str, ...] = ()) -> list[ParsedCall]:
    """``[f(a=1), g(b="x")]`` (or one bare call) -> calls. Declared names that are not Python
    identifiers ("Market Trends API") are recognised before parsing."""
    aliases: dict[str, str] = {}
    for i, name in enumerate(sorted((n for n in declared if not n.isidentifier()), key=len, reverse=True)):
        alias = f"__mimir_tool_{i}__"
        pattern = re.compile(r"(?<![\w.])" + re.escape(name) + r"(?=\s*\()")
        if pattern.search(text):
            text = pattern.sub(alias, text)
            aliases[alias] = name
    try:
        node = _parse(text.strip())
    except ValueError as exc:
        raise ConversionError("bad_call", f"call list: {exc}") from None
    items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    if not items:
        raise ConversionError("bad_call", "empty call list")
    calls = []
    for item in items:
        if not isinstance(item, ast.Call):
            raise ConversionError("bad_call", f"call list holds a {type(item).__name__}, not a call")
        name = _dotted(item.func)
        if item.args:
            raise ConversionError("bad_call", f"{aliases.get(name, name)}: positional arguments")
        arguments = {}
        for kw in item.keywords:
            if kw.arg is None:
                raise ConversionError("bad_call", f"{aliases.get(name, name)}: '**' arguments")
            try:
                arguments[kw.arg] = _literal(kw.value)
            except ValueError as exc:
                raise ConversionError(
                    "bad_arguments", f"{aliases.get(name, name)}({kw.arg}=...): {exc}"
                ) from None
        calls.append(ParsedCall(aliases.get(name, name), arguments))
    return calls


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ConversionError("bad_call", f"a call of a {type(node).__name__}, not a function name")

"""Function declarations as JSON Schema, recovered from the dialects public data writes them in.

Three shapes occur: OpenAI-style ``{"type": "function", "function": {...}}``, a bare
``{"name", "description", "parameters"}`` whose parameters are JSON Schema with Python type names
(ToolACE's ``"type": "dict"``), and xLAM's ``parameters = {param: {"type": "str, optional",
"description", "default"}}``. All become ``{"type": "function", "function": {"name",
"description", "parameters": {"type": "object", "properties", "required"}}}``.
"""

from __future__ import annotations

import re
from typing import Any

from .trace import ConversionError

_TYPES = {
    "str": "string",
    "string": "string",
    "text": "string",
    "int": "integer",
    "integer": "integer",
    "float": "number",
    "number": "number",
    "double": "number",
    "bool": "boolean",
    "boolean": "boolean",
    "list": "array",
    "array": "array",
    "tuple": "array",
    "set": "array",
    "dict": "object",
    "object": "object",
    "map": "object",
    "null": "null",
}
_OPTIONAL = re.compile(r"\s*,\s*optional\s*$", re.IGNORECASE)
_GENERIC = re.compile(r"^(\w+)\s*\[(.*)\]$")


def declaration(obj: Any) -> tuple[dict[str, Any], bool]:
    """(normalised declaration, whether anything had to be recovered); ConversionError('bad_tools')."""
    if not isinstance(obj, dict):
        raise ConversionError("bad_tools", f"a tool declaration is a {type(obj).__name__}")
    wrapped = obj.get("type") == "function" and isinstance(obj.get("function"), dict)
    fn = obj["function"] if wrapped else obj
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConversionError("bad_tools", "a tool declaration has no name")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise ConversionError("bad_tools", f"{name}: description is not a string")
    params = fn.get("parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ConversionError("bad_tools", f"{name}: parameters are a {type(params).__name__}")
    if isinstance(params.get("type"), str) or ("properties" in params and "type" not in params):
        schema, changed = _node(dict(params, type=params.get("type", "object")))
        changed |= "type" not in params
    else:
        schema, changed = _from_parameter_map(name, params)
    out = {"name": name.strip(), "description": description, "parameters": schema}
    return {"type": "function", "function": out}, changed


def _from_parameter_map(name: str, params: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """xLAM: {param: {"type": "List[int], optional", ...}} -> an object schema."""
    properties, required = {}, []
    for param, spec in params.items():
        if not isinstance(spec, dict):
            raise ConversionError("bad_tools", f"{name}.{param}: parameter spec is not an object")
        optional = isinstance(spec.get("type"), str) and bool(_OPTIONAL.search(spec["type"]))
        properties[param], _ = _node(spec)
        if not optional:
            required.append(param)
    return {"type": "object", "properties": properties, "required": required}, True


def _node(spec: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """One schema node with Python-ish type names mapped to JSON Schema; recursive."""
    out = dict(spec)
    changed = False
    raw = spec.get("type")
    if isinstance(raw, str):
        mapped, items = _type(raw)
        changed = mapped != raw
        if mapped is None:
            out.pop("type")
        else:
            out["type"] = mapped
        if items is not None and "items" not in out:
            out["items"] = {"type": items}
    if isinstance(out.get("properties"), dict):
        props = {}
        for key, child in out["properties"].items():
            props[key], c = _node(child) if isinstance(child, dict) else (child, False)
            changed |= c
        out["properties"] = props
    if isinstance(out.get("items"), dict):
        out["items"], c = _node(out["items"])
        changed |= c
    if "required" in out and not isinstance(out["required"], list):
        out.pop("required")  # ToolACE writes "required": null
        changed = True
    return out, changed


def _type(raw: str) -> tuple[str | None, str | None]:
    """("array", "integer") for "List[int], optional"; (None, None) for what JSON Schema lacks."""
    text = _OPTIONAL.sub("", raw).strip()
    generic = _GENERIC.match(text)
    if generic:
        outer, inner = generic.group(1).lower(), generic.group(2)
        if outer == "optional":
            return _type(inner)
        mapped = _TYPES.get(outer)
        if mapped == "array":
            return "array", _type(inner.split(",")[0])[0]
        return mapped, None
    return _TYPES.get(text.lower()), None

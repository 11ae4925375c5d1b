"""OpenAI's published OpenAPI schemas, to validate what `mimir serve` sends against them.

``tests/data/openai_openapi_components.json`` holds the components of OpenAI's spec that the
served routes' bodies, stream chunks and events are defined by (the roots below and everything
they reference; descriptions, titles and examples dropped), and where they came from under
``_source``. Refresh it from a newer copy of the spec with
``python tests/helpers/openai_spec.py openapi.json COMMIT DATE``.
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path

SPEC = Path(__file__).resolve().parents[1] / "data" / "openai_openapi_components.json"
ROOTS = ("CreateCompletionResponse", "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
         "Response", "ResponseStreamEvent", "ResponseItemList", "ListModelsResponse", "Model", "ErrorResponse")
"""What the routes answer: completions (whole and streamed chunks alike), chat completions and their
chunks, a Response and its stream events, a response's input items, the models, an error."""
_DROPPED = ("description", "title", "example", "examples", "x-oaiMeta")


@cache
def _document() -> dict:
    return json.loads(SPEC.read_text())


def _nullable(node):
    """OpenAPI 3.0's ``nullable: true`` (which the 3.1 spec still uses in places, and JSON Schema
    ignores) as JSON Schema says it: the schema, or null."""
    if isinstance(node, dict):
        node = {k: _nullable(v) for k, v in node.items()}
        if node.pop("nullable", False) is True:
            return {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    return node


@cache
def _validator(name: str):
    import jsonschema

    document = _document()
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "components": _nullable(document["components"]), "$ref": f"#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(schema)


def errors(name: str, body: dict) -> list[str]:
    """What in ``body`` the spec's component ``name`` refuses (empty: it validates). An ``anyOf``
    that fails reports its closest branch's errors (jsonschema's ``best_match``)."""
    from jsonschema.exceptions import best_match

    found = list(_validator(name).iter_errors(body))
    if not found:
        return []
    branch = _branch_of_type(name, body.get("type") if isinstance(body, dict) else None)
    if branch is not None:  # a union of event types: the errors of the event's own type say more
        return [f"{name}: {e}" for e in errors(branch, body)] or [f"{name}: {found[0].message[:300]}"]
    best = best_match(found)
    where = "/".join(str(p) for p in best.absolute_path)
    return [f"{name} at /{where}: {best.message[:300]}"] + [
        f"{name} at /{'/'.join(str(p) for p in e.absolute_path)}: {e.message[:200]}" for e in found[:5]]


def _branch_of_type(name: str, kind: str | None) -> str | None:
    """The component of the union ``name`` whose ``type`` is the constant ``kind`` (None: none)."""
    schemas = _document()["components"]["schemas"]
    for branch in schemas[name].get("anyOf", []) + schemas[name].get("oneOf", []):
        ref = branch.get("$ref", "").rsplit("/", 1)[-1]
        if kind is not None and schemas.get(ref, {}).get("properties", {}).get("type", {}).get("enum") == [kind]:
            return ref
    return None


def source() -> dict:
    """Where the components came from (repository, commit, date, the spec's version)."""
    return _document()["_source"]


def _references(node) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[1]} if isinstance(node.get("$ref"), str) else set()
        for value in node.values():
            found |= _references(value)
        return found
    if isinstance(node, list):
        return set().union(*(_references(v) for v in node)) if node else set()
    return set()


def _stripped(node, names: bool = False):
    """``node`` without documentation keys (``names``: a ``properties`` map, whose keys are field
    names, ``description`` among them, and kept)."""
    if isinstance(node, dict):
        return {k: _stripped(v, k == "properties" and not names) for k, v in node.items()
                if names or k not in _DROPPED}
    if isinstance(node, list):
        return [_stripped(v) for v in node]
    return node


def extract(openapi_json: Path, commit: str, date: str) -> dict:
    """The components reachable from :data:`ROOTS` in a copy of OpenAI's ``openapi.json``."""
    spec = json.loads(Path(openapi_json).read_text())
    schemas = spec["components"]["schemas"]
    kept, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in kept:
            kept.add(name)
            todo += sorted(_references(schemas[name]))
    return {"_source": {"repository": "https://github.com/openai/openai-openapi", "file": "openapi.json",
                        "commit": commit, "commit_date": date, "openapi": spec["openapi"],
                        "info_version": spec["info"]["version"], "roots": list(ROOTS),
                        "kept": "components.schemas reachable from the roots; description, title, example(s) "
                                "and x-oaiMeta dropped"},
            "components": {"schemas": {name: _stripped(schemas[name]) for name in sorted(kept)}}}


if __name__ == "__main__":
    path, commit, date = sys.argv[1:4]
    document = extract(Path(path), commit, date)
    lines = [f"{json.dumps(name)}: {json.dumps(schema)}" for name, schema in document["components"]["schemas"].items()]
    SPEC.write_text('{"_source": ' + json.dumps(document["_source"], indent=1) + ',\n"components": {"schemas": {\n'
                    + ",\n".join(lines) + "\n}}}\n")  # one schema a line: a refresh diffs by component
    print(f"wrote {SPEC}")

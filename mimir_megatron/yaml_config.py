"""Reading YAML configuration files: the one way every configuration the project reads comes in.

:func:`read_yaml` loads a file and merges ``key=value`` overrides into it (one line naming the
file, and the line, when it cannot); :func:`typed_section` types a mapping by a dataclass key by
key, collecting every mistake instead of stopping at the first; :func:`raise_errors` turns the
collected mistakes into one :class:`~mimir_megatron.errors.ConfigError`, one line each. The
schemas themselves live with what they configure (the model's in :mod:`mimir_megatron.config`,
training's in :mod:`mimir_megatron.train.config`, ...).
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mimir_megatron.errors import ConfigError

T = TypeVar("T")


# -- reading a file ----------------------------------------------------------------------------


def yaml_problem(path: str | Path, exc: BaseException) -> str:
    """One line for a YAML file that cannot be read: the file and line, and what is wrong."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return f"{path}:{mark.line + 1}: invalid YAML ({getattr(exc, 'problem', None) or 'syntax error'})"
    if isinstance(exc, UnicodeDecodeError):
        return f"{path}: not UTF-8 text (byte {exc.start})"
    if isinstance(exc, OSError):
        return f"{path}: cannot read ({exc.strerror or exc})"
    return f"cannot parse {path}: {' '.join(str(exc).split())}"


def read_yaml(path: str | Path, what: str, overrides: Sequence[str] = (), kind: str = "config file"
              ) -> dict[str, Any]:
    """A YAML file's mapping with ``key=value`` ``overrides`` merged in (interpolations resolved),
    or a one-line ConfigError naming the file (and line). Every configuration the project reads
    (model, train, mixture, eval suite, prepare, synth pipeline, GPU table) comes through here;
    what a file holds is then checked by :func:`typed_section` and listed by :func:`raise_errors`.
    ``what``: what the mapping holds; ``kind``: what the file is, for a missing one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{kind} not found: {path}")
    try:
        loaded = OmegaConf.load(path)
        # In place, key by key: ``section.key=v`` sets a setting, ``datasets.0.repeat=2`` an item.
        loaded.merge_with_dotlist(list(overrides))
        raw = OmegaConf.to_container(loaded, resolve=True)
    except Exception as exc:  # YAML syntax, not UTF-8, unreadable, malformed overrides
        problem = yaml_problem(path, exc)
        if problem.startswith("cannot parse") and overrides:
            problem += f" (overrides {list(overrides)})"
        raise ConfigError(problem) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of {what}")
    return raw


def merge_overrides(tree: dict[str, Any], overrides: Sequence[str], prefix: str, errors: list[str]
                    ) -> dict[str, Any]:
    """``tree`` with ``key=value`` overrides merged in (a leading ``prefix`` such as ``model.``
    dropped from each); a malformed override appends one line to ``errors`` and leaves ``tree``."""
    if not overrides:
        return dict(tree)
    try:
        dotlist = OmegaConf.from_dotlist([o[len(prefix):] if o.startswith(prefix) else o for o in overrides])
        return OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(dict(tree)), dotlist))
    except OmegaConfBaseException as exc:
        errors.append(f"{prefix.rstrip('.')} overrides {list(overrides)}: {str(exc).splitlines()[0]}")
        return dict(tree)


# -- typed sections, every mistake collected ---------------------------------------------------


def typed_section(schema: type[T], values: Any, prefix: str, errors: list[str],
                  moved: Mapping[str, str] | None = None) -> T:
    """``values`` (a mapping from YAML) typed by the dataclass ``schema``, key by key: each
    unknown key and each value of the wrong type appends one line to ``errors`` and leaves that
    field at its default, so that one pass reports every mistake. Nested dataclass fields are
    sections of their own (``prefix.field.key``). ``moved``: keys of this section that now live
    in a subsection (key -> ``sub.key``), named in their error instead of the known keys."""
    node = OmegaConf.structured(schema)
    _fill(node, schema, values, prefix, errors, moved or {})
    return OmegaConf.to_object(node)


def _fill(node: DictConfig, schema: type, values: Any, prefix: str, errors: list[str],
          moved: Mapping[str, str]) -> None:
    if values is None:
        return
    if not isinstance(values, dict):
        errors.append(f"{prefix} must be a mapping of settings, got {values!r}")
        return
    hints = typing.get_type_hints(schema)
    known = [f.name for f in fields(schema)]
    for key, value in values.items():
        name = f"{prefix}.{key}"
        if key not in known:
            errors.append(f"{name} is not a setting: it is now {prefix}.{moved[key]}" if key in moved else
                          f"{name} is not a setting (known: {', '.join(known)})")
        elif is_dataclass(hints[key]):
            _fill(node[key], hints[key], value, name, errors, {})
        else:
            try:
                OmegaConf.update(node, key, value, merge=False)
            except OmegaConfBaseException as exc:
                errors.append(_type_error(name, hints[key], value, exc))


def _type_error(name: str, hint: Any, value: Any, exc: Exception) -> str:
    choices = [a for a in typing.get_args(hint) if isinstance(a, type) and issubclass(a, Enum)]
    enum = hint if isinstance(hint, type) and issubclass(hint, Enum) else (choices[0] if choices else None)
    if enum is not None:
        return f"{name} must be one of {', '.join(m.value for m in enum)}, got {value!r}"
    return f"{name}: {str(exc).splitlines()[0]}"


def raise_errors(errors: Sequence[str], what: str) -> None:
    """One :class:`ConfigError` listing every mistake, one line each."""
    if errors:
        raise ConfigError(f"{what}:\n  - " + "\n  - ".join(errors))


def plain(value: Any) -> Any:
    """Enums to their strings, recursively (JSON, YAML and MLflow params hold plain values)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value

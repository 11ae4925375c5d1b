"""What decides a prepared dataset besides its input bytes: the options of `mimir prepare`
(:class:`PrepareOptions`, the one list of them and of their defaults: prepare()'s keywords, the
command line's flags), checked once (one line per mistake) and frozen into
:class:`PrepareSettings`.

The settings travel with every shard to the worker that prepares it and are part of each
shard's key (:func:`mimir_data_prep.shard_writer.shard_key`), so a rerun with other settings
redoes the shards they change.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mimir_megatron.chat import tokenizer_sha256
from mimir_megatron.errors import UserError

from .layouts import INPUT_FORMATS, parse_columns
from .personal_data import POLICIES as PERSONAL_DATA_POLICIES
from .records import CONTROL_CHAR_POLICIES

log = logging.getLogger(__name__)

TOO_LONG_POLICIES = ("drop", "truncate-prefix")


class StrictModeError(UserError):
    """--strict met a bad line; the message names the file and line."""


@dataclass(frozen=True)
class PrepareOptions:
    """The options of `mimir prepare` that decide its output, as a caller gives them, unchecked:
    the one list of them and their defaults. prepare() and :func:`prepare_settings` take them as
    one of these or as keywords of these names."""

    seq_len: int = 4096
    too_long: str = "drop"  # TOO_LONG_POLICIES
    min_response_tokens: int = 2
    strict: bool = False
    input_format: str = "auto"  # layouts.INPUT_FORMATS
    columns: str | Mapping[str, str] | None = None  # "TARGET=COLUMN,..." or {target: column}
    control_chars: str = "reject"  # records.CONTROL_CHAR_POLICIES
    denylist: str | Path | None = None  # `mimir audit contamination --denylist` output
    personal_data: str = "reject"  # personal_data.POLICIES


_DEFAULT = PrepareOptions()


@dataclass(frozen=True)
class PrepareSettings:
    """Everything besides the input bytes that decides the output, checked: part of each shard's
    key. Its defaults are :class:`PrepareOptions`'s."""

    tokenizer_dir: str
    tokenizer_sha256: str
    seq_len: int = _DEFAULT.seq_len
    too_long: str = _DEFAULT.too_long
    min_response_tokens: int = _DEFAULT.min_response_tokens
    strict: bool = _DEFAULT.strict
    input_format: str = _DEFAULT.input_format
    columns: tuple[tuple[str, str], ...] = ()  # (target, column) pairs of the columns layout
    control_chars: str = _DEFAULT.control_chars
    denylist: str = ""  # `--denylist` file: documents holding one of its sequences are rejected
    denylist_sha256: str = ""
    personal_data: str = _DEFAULT.personal_data


def prepare_options(options: PrepareOptions | None = None, **keywords: Any) -> PrepareOptions:
    """``options`` (default: the defaults) with ``keywords`` (:class:`PrepareOptions`'s field
    names) in place of its values; a TypeError names a keyword that is not an option."""
    return replace(options or _DEFAULT, **keywords)


def prepare_settings(tokenizer_dir: str | Path, options: PrepareOptions | None = None,
                     **keywords: Any) -> PrepareSettings:
    """The options (``options`` and/or ``keywords``, as :func:`prepare_options`) checked (a
    one-line UserError naming the first bad one) and frozen; the denylist is read and checked
    against the tokenizer here, before anything is written."""
    given = prepare_options(options, **keywords)
    if given.too_long not in TOO_LONG_POLICIES:
        raise UserError(f"--too-long must be one of {TOO_LONG_POLICIES}, got {given.too_long!r}")
    if given.seq_len < 2:
        raise UserError(f"--seq-len must be >= 2, got {given.seq_len}")
    if given.input_format not in INPUT_FORMATS:
        raise UserError(f"--input-format must be one of {INPUT_FORMATS}, got {given.input_format!r}")
    if given.personal_data not in PERSONAL_DATA_POLICIES:
        raise UserError(f"--personal-data must be one of {PERSONAL_DATA_POLICIES}, "
                        f"got {given.personal_data!r}")
    if given.control_chars not in CONTROL_CHAR_POLICIES:
        raise UserError(f"--control-chars must be one of {CONTROL_CHAR_POLICIES}, "
                        f"got {given.control_chars!r}")
    column_map = parse_columns(given.columns)
    if given.input_format == "columns" and not column_map:
        raise UserError("--input-format columns needs --columns TARGET=COLUMN,...")
    denylist = check_denylist(given.denylist, tokenizer_dir)
    tokenizer_dir = str(Path(tokenizer_dir).resolve())
    return PrepareSettings(
        tokenizer_dir=tokenizer_dir,
        tokenizer_sha256=tokenizer_sha256(tokenizer_dir) if Path(tokenizer_dir).is_dir() else "",
        seq_len=given.seq_len,
        too_long=given.too_long,
        min_response_tokens=given.min_response_tokens,
        strict=given.strict,
        input_format=given.input_format,
        columns=tuple(sorted(column_map.items())),
        control_chars=given.control_chars,
        denylist=str(denylist.path.resolve()) if denylist else "",
        denylist_sha256=denylist.sha256 if denylist else "",
        personal_data=given.personal_data,
    )


def check_denylist(denylist: str | Path | None, tokenizer_dir: str | Path):
    """The denylist, read and checked against the tokenizer (one-line UserError otherwise)."""
    if not denylist:
        return None
    from mimir_megatron.audits.denylist import Denylist

    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return None  # ChatRenderer names the bad tokenizer directory
    checked = Denylist(denylist, tokenizer_sha256(tokenizer_dir))
    log.info("denylist %s: %d sequences of tokens or folded words (%s-gram overlaps)", denylist, len(checked),
             checked.ngram)
    return checked

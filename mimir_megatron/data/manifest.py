"""The manifest of a prepared dataset (``manifest.json``): one typed record, one reader, one writer.

``mimir prepare`` writes it (:func:`write_manifest`, the one writer: it sets the format, computes
the digest and refuses what the reader would refuse) once every shard is done; everyone else
reads it through :meth:`Manifest.read` (the writer returns the same typed record), which checks,
naming the file and the field in one line:

- the format (``mimir-prepared-v1``; a manifest of another version goes through
  :func:`_migrated`, which today knows no older version and refuses it, naming the version);
- the fields every reader needs, with their types (documents, tokens.total, tokenizer.sha256,
  shards, outputs, ...); fields it does not know are kept in :attr:`Manifest.content` and left
  alone (they are covered by the digest);
- the digest of its content (:mod:`mimir_megatron.integrity`): an edited manifest is refused.
  The training gate (:func:`mimir_megatron.data.policy.training_data_problems`) reads with
  ``verify_digest=False`` so that it lists an edit beside the dataset's other problems
  (:attr:`Manifest.digest_problem`).

Reads are cached per file while it stays the same (size, mtime, inode): the trainer's start-up
asks for every manifest several times, and a mixture of thousands of shards has manifests of
megabytes.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import DIGEST_KEY, RecordFields, digest_matches, with_digest, write_json_atomic

MANIFEST_NAME = "manifest.json"
FORMAT = "mimir-prepared-v1"


@dataclass(frozen=True)
class ShardEntry:
    """One shard of the dataset: ``<prefix>.bin|.idx`` under the dataset's directory."""

    prefix: str
    documents: int


@dataclass(frozen=True)
class InputFile:
    """An input file as it was when prepared (``sources``): size, mtime and sha256 tell whether it
    changed since."""

    path: str
    sha256: str | None = None
    bytes: int | None = None
    mtime_ns: int | None = None


@dataclass(frozen=True)
class TokenizerRecord:
    """The tokenizer the dataset was prepared with."""

    sha256: str
    path: str | None = None
    vocab_size: int | None = None
    end_of_turn_ids: tuple[int, ...] = ()
    """What generation stops on (None/empty for datasets prepared before they were recorded)."""


INDIRECT_IDENTIFIERS = frozenset({"ip_address"})
"""Kinds the screen counts that identify nobody on their own (``mimir_data_prep.personal_data``'s
DIRECT is every other kind; tests keep the two in step)."""


@dataclass(frozen=True)
class PersonalDataScreen:
    """What the personal-data screen of ``mimir prepare`` did: its policy (``reject``, ``redact``,
    ``report``), the identifiers found by kind, and the documents rejected for them."""

    policy: str
    found: Mapping[str, int]
    documents_rejected: int

    @property
    def kept(self) -> dict[str, int]:
        """Direct identifiers found and left in the data, by kind: ``report`` keeps whatever it
        found (``reject`` drops their documents, ``redact`` replaces them)."""
        if self.policy != "report":
            return {}
        return {kind: n for kind, n in self.found.items() if n and kind not in INDIRECT_IDENTIFIERS}

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "found": dict(self.found),
                "documents_rejected": self.documents_rejected}


@dataclass(frozen=True)
class Manifest:
    """A validated manifest. :attr:`content` is the stored record itself (read-only): its digest
    is over it, and fields this class does not name (layout, input formats, ...) live there."""

    path: Path
    """The manifest file."""
    content: Mapping[str, Any] = field(repr=False)
    documents: int
    tokens_total: int
    tokenizer: TokenizerRecord
    dtype: str
    shards: tuple[ShardEntry, ...]
    outputs: Mapping[str, str]
    """sha256 of every output file, by path relative to the dataset's directory."""
    provenance: Mapping[str, Any] | None
    """The stored provenance record (validated by :mod:`mimir_megatron.data.provenance`)."""
    digest: str | None
    digest_problem: str | None
    """Why the digest cannot be trusted (none stored, or edited by hand), or None."""
    sources: tuple[InputFile, ...] = ()
    lines_read: int | None = None
    rejected: int | None = None
    rejects: Mapping[str, int] = field(default_factory=dict)
    accepted: int | None = None
    tokens_prefix: int | None = None
    tokens_response: int | None = None
    truncated: int | None = None
    """Documents whose prefix was cut to fit (``--too-long truncate-prefix``)."""
    control_chars_stripped: int | None = None
    input_formats: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per input file: the layout asked for and the one read (``requested``, ``format``)."""
    seq_len: int | None = None
    denylist: Mapping[str, Any] | None = None
    personal_data: PersonalDataScreen | None = None
    """None for a dataset prepared before the screen was recorded."""

    @classmethod
    def read(cls, dataset: str | Path, *, verify_digest: bool = True) -> Manifest:
        """The manifest of the prepared dataset directory ``dataset``; a one-line
        :class:`UserError` naming the file when it is missing, unreadable, of another format, lacks
        a field or has one of the wrong type, or (``verify_digest``) was edited after it was
        written. The record is shared between callers (cached): it is immutable."""
        manifest_path = Path(dataset) / MANIFEST_NAME
        try:
            st = manifest_path.stat()
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise UserError(
                f"{dataset}: not a prepared dataset ({MANIFEST_NAME} is missing); run `mimir prepare` "
                "first, or finish the interrupted run"
            )
        manifest = _read(manifest_path.resolve(), st.st_ino, st.st_size, st.st_mtime_ns)
        if verify_digest and manifest.digest_problem:
            raise UserError(f"{manifest.path}: {manifest.digest_problem}")
        return manifest

    @property
    def digest_intact(self) -> bool:
        return self.digest_problem is None


def write_manifest(directory: str | Path, content: Mapping[str, Any]) -> Manifest:
    """Write ``content`` as the manifest of the dataset ``directory`` atomically, with today's
    format first and its digest last (a ``digest`` in ``content`` is replaced); the typed record
    as written. It is validated first: a writer cannot write what :meth:`Manifest.read` would
    refuse. The one place a manifest's digest is computed."""
    path = Path(directory).resolve() / MANIFEST_NAME
    record = with_digest({"format": FORMAT, **content})
    manifest = _validated(record, path)
    write_json_atomic(path, record)
    return manifest


@lru_cache(maxsize=4096)
def _read(manifest_path: Path, inode: int, size: int, mtime_ns: int) -> Manifest:
    """The parsed, validated manifest; the stat fields are part of the cache key only."""
    try:
        raw = json.loads(manifest_path.read_text())
    except OSError as exc:
        raise UserError(f"{manifest_path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise UserError(f"{manifest_path}: damaged (not UTF-8 text); prepare the dataset again") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{manifest_path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    return _validated(raw, manifest_path)


def _migrated(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """A manifest of an older format brought to today's, or a refusal naming its version. No older
    format exists yet: every other version is refused (prepare the dataset again)."""
    found = raw.get("format")
    if found == FORMAT:
        return raw
    raise UserError(f"{path}: format {found!r} is not one this version of mimir reads (it reads {FORMAT!r}); "
                    "prepare the dataset again with this version")


def _validated(raw: Any, path: Path) -> Manifest:
    """The typed record of a parsed manifest; a one-line :class:`UserError` on the first problem."""
    if not isinstance(raw, dict):
        raise UserError(f"{path}: not a manifest (a JSON object expected, got {type(raw).__name__})")
    raw = _migrated(raw, path)
    fields = _Fields(raw, path)
    tokenizer = fields.mapping("tokenizer")
    tokenizer_fields = _Fields(tokenizer, path, "tokenizer.")
    shards = []
    for i, shard in enumerate(fields.list("shards")):
        entry = _Fields(shard, path, f"shards[{i}].") if isinstance(shard, dict) else None
        if entry is None:
            raise UserError(f"{path}: shards[{i}]: a JSON object expected, got {shard!r}")
        shards.append(ShardEntry(prefix=entry.str("prefix"), documents=entry.int("documents")))
    sources = []
    for i, source in enumerate(fields.list("sources", required=False) or []):
        entry = _Fields(source, path, f"sources[{i}].") if isinstance(source, dict) else None
        if entry is None:
            raise UserError(f"{path}: sources[{i}]: a JSON object expected, got {source!r}")
        sources.append(InputFile(path=entry.str("path"), sha256=entry.str("sha256", required=False),
                                 bytes=entry.int("bytes", required=False),
                                 mtime_ns=entry.int("mtime_ns", required=False)))
    outputs = fields.mapping("outputs")
    bad = next((k for k, v in outputs.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise UserError(f"{path}: outputs.{bad}: a sha256 (string) expected, got {outputs[bad]!r}")
    settings = fields.mapping("settings", required=False) or {}
    settings_fields = _Fields(settings, path, "settings.")
    tokens = _Fields(fields.mapping("tokens"), path, "tokens.")
    input_formats = fields.mapping("input_formats", required=False) or {}
    bad = next((k for k, v in input_formats.items() if not isinstance(v, dict)), None)
    if bad is not None:
        raise UserError(f"{path}: input_formats.{bad}: a JSON object expected, got {input_formats[bad]!r}")
    rejects = fields.mapping("rejects", required=False) or {}
    bad = next((k for k, v in rejects.items() if type(v) is not int), None)
    if bad is not None:
        raise UserError(f"{path}: rejects.{bad}: an integer expected, got {rejects[bad]!r}")
    end_of_turn = tokenizer_fields.list("end_of_turn_ids", required=False) or []
    if not all(type(i) is int for i in end_of_turn):
        raise UserError(f"{path}: tokenizer.end_of_turn_ids: token ids (integers) expected, "
                        f"got {end_of_turn!r}")
    digest = fields.str(DIGEST_KEY, required=False)
    if digest is None:
        problem = "has no digest (deleted by hand, or written before digests were recorded); prepare it again"
    elif not digest_matches(raw):
        problem = "edited after mimir prepare wrote it (its digest does not match its content)"
    else:
        problem = None
    return Manifest(
        path=path, content=MappingProxyType(raw),
        documents=fields.int("documents"),
        tokens_total=tokens.int("total"),
        tokenizer=TokenizerRecord(sha256=tokenizer_fields.str("sha256"),
                                  path=tokenizer_fields.str("path", required=False),
                                  vocab_size=tokenizer_fields.int("vocab_size", required=False),
                                  end_of_turn_ids=tuple(end_of_turn)),
        dtype=fields.str("dtype", required=False) or "int32",
        shards=tuple(shards), outputs=MappingProxyType(dict(outputs)),
        provenance=fields.mapping("provenance", required=False),
        digest=digest, digest_problem=problem, sources=tuple(sources),
        lines_read=fields.int("lines_read", required=False), rejected=fields.int("rejected", required=False),
        rejects=MappingProxyType(dict(rejects)), accepted=fields.int("accepted", required=False),
        tokens_prefix=tokens.int("prefix", required=False),
        tokens_response=tokens.int("response", required=False),
        truncated=fields.int("truncated", required=False),
        control_chars_stripped=fields.int("control_chars_stripped", required=False),
        input_formats=MappingProxyType(dict(input_formats)),
        seq_len=settings_fields.int("seq_len", required=False),
        denylist=settings_fields.mapping("denylist", required=False),
        personal_data=_personal_data(fields.mapping("personal_data", required=False), path),
    )


def _personal_data(screen: Mapping[str, Any] | None, path: Path) -> PersonalDataScreen | None:
    if screen is None:
        return None
    fields = _Fields(screen, path, "personal_data.")
    found = fields.mapping("found")
    bad = next((k for k, v in found.items() if type(v) is not int), None)
    if bad is not None:
        raise UserError(f"{path}: personal_data.found.{bad}: an integer expected, got {found[bad]!r}")
    return PersonalDataScreen(policy=fields.str("policy"), found=MappingProxyType(dict(found)),
                              documents_rejected=fields.int("documents_rejected"))


class _Fields(RecordFields):
    """Typed access to one JSON object of the manifest (its integers are counts: never negative)."""

    missing_hint = " (a field every manifest has); prepare the dataset again"

    def int(self, name: str, *, required: bool = True) -> Any:
        return self.get(name, lambda v: type(v) is int and v >= 0, "a non-negative integer",
                        required=required)

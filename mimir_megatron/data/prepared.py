"""Reading a dataset written by ``mimir prepare``.

On-disk layout of one prepared dataset (a directory)::

    manifest.json          counts, tokenizer hash, rejects per reason, sha256 of every input and
                           output, the provenance record (mimir_megatron.data.provenance), and
                           the manifest's own digest (an edited manifest is refused for training)
    rejects.jsonl          one line per rejected input line: file, line, reason, detail
    shards/00000.bin|.idx  megatron-core indexed datasets, one per input shard
    shards/00000.json      shard statistics; written last, so its presence marks the shard done

Every *document* (one chat sample) is stored as two *sequences* of the indexed dataset: the
prefix (template up to and including the generation prompt) followed by the response. The
prefix length therefore lives in the ``.idx`` file itself (``sequence_lengths[2 * doc]``) and
cannot drift from the token ids; ``document_indices`` is ``[0, 2, 4, ...]``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from functools import cached_property
from pathlib import Path

import numpy as np

from mimir_megatron.errors import UserError

MANIFEST_NAME = "manifest.json"
REJECTS_NAME = "rejects.jsonl"
SHARDS_DIR = "shards"
FORMAT = "mimir-prepared-v1"
SEQUENCES_PER_DOCUMENT = 2

# megatron-core logs five INFO lines per opened .idx file; a mixture opens thousands of shards.
logging.getLogger("megatron.core.datasets.indexed_dataset").setLevel(logging.WARNING)


def read_manifest(path: str | Path) -> dict:
    """The manifest of the prepared dataset at ``path``; a :class:`UserError` if it is missing."""
    manifest_path = Path(path) / MANIFEST_NAME
    if not manifest_path.is_file():
        raise UserError(
            f"{path}: not a prepared dataset ({MANIFEST_NAME} is missing); run `mimir prepare` "
            "first, or finish the interrupted run"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{manifest_path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if manifest.get("format") != FORMAT:
        raise UserError(f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's content (everything but its ``digest`` field)."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def manifest_problem(manifest: dict) -> str | None:
    """Why a manifest cannot be trusted (edited after ``mimir prepare`` wrote it), or None.
    Manifests written before digests were recorded have none to check."""
    if "digest" in manifest and manifest["digest"] != manifest_digest(manifest):
        return "edited after mimir prepare wrote it (its digest does not match its content)"
    return None


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


class PreparedDataset:
    """Random access to the documents of one prepared dataset, shard boundaries hidden.

    Shards open lazily (memory-mapped), so constructing many of these is cheap.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        shards = [s for s in self.manifest["shards"] if s["documents"] > 0]
        self._shard_prefixes = [str(self.path / s["prefix"]) for s in shards]
        counts = np.array([s["documents"] for s in shards], dtype=np.int64)
        self._doc_starts = np.concatenate([[0], np.cumsum(counts)])
        self._opened: dict[int, object] = {}

    @property
    def shard_prefixes(self) -> list[str]:
        """Path prefixes (without ``.bin``/``.idx``) of the non-empty shards, in document order."""
        return list(self._shard_prefixes)

    def shard(self, index: int):
        """The megatron-core ``IndexedDataset`` of shard ``index`` (opened once, memory-mapped)."""
        return self._shard(index)

    @property
    def num_documents(self) -> int:
        return int(self._doc_starts[-1])

    def _shard(self, index: int):
        if index not in self._opened:
            from megatron.core.datasets.indexed_dataset import IndexedDataset

            self._opened[index] = IndexedDataset(self._shard_prefixes[index])
        return self._opened[index]

    @cached_property
    def _lengths(self) -> np.ndarray:
        """``[documents, 2]`` int32 array of (prefix, response) token counts."""
        parts = [
            np.asarray(self._shard(i).sequence_lengths, dtype=np.int32).reshape(-1, 2)
            for i in range(len(self._shard_prefixes))
        ]
        if not parts:
            return np.zeros((0, 2), dtype=np.int32)
        return np.concatenate(parts)

    @property
    def prefix_lengths(self) -> np.ndarray:
        return self._lengths[:, 0]

    @property
    def response_lengths(self) -> np.ndarray:
        return self._lengths[:, 1]

    def document(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(prefix ids, response ids) of document ``index`` as int64 arrays."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} outside [0, {self.num_documents}) in {self.path}")
        shard = int(np.searchsorted(self._doc_starts, index, side="right") - 1)
        local = index - int(self._doc_starts[shard])
        ds = self._shard(shard)
        prefix = ds.get(SEQUENCES_PER_DOCUMENT * local).astype(np.int64)
        response = ds.get(SEQUENCES_PER_DOCUMENT * local + 1).astype(np.int64)
        return prefix, response

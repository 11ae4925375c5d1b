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

Before training, every dataset is checked against its manifest (:func:`shard_problems`: the
structure of each shard, a few bytes read; :func:`output_problems`: the sha256 of every file).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from concurrent.futures import Future
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from mimir_megatron.errors import UserError

MANIFEST_NAME = "manifest.json"
REJECTS_NAME = "rejects.jsonl"
SHARDS_DIR = "shards"
FORMAT = "mimir-prepared-v1"
SEQUENCES_PER_DOCUMENT = 2



def read_manifest(path: str | Path) -> dict:
    """The manifest of the prepared dataset at ``path``; a :class:`UserError` if it is missing.

    Read once per process while the file stays as it is: the trainer's start-up asks for every
    manifest several times (policy and integrity, fingerprint, stream, lineage), and a mixture of
    thousands of shards has manifests of megabytes. A rewritten manifest (another size, mtime or
    inode) is read again. The dict is shared: callers must not change it."""
    manifest_path = Path(path) / MANIFEST_NAME
    try:
        st = manifest_path.stat()
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        raise UserError(
            f"{path}: not a prepared dataset ({MANIFEST_NAME} is missing); run `mimir prepare` "
            "first, or finish the interrupted run"
        )
    return _read_manifest(manifest_path.resolve(), st.st_ino, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=4096)
def _read_manifest(manifest_path: Path, inode: int, size: int, mtime_ns: int) -> dict:
    """The parsed manifest; the stat fields are part of the cache key only."""
    try:
        manifest = json.loads(manifest_path.read_text())
    except OSError as exc:
        raise UserError(f"{manifest_path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise UserError(f"{manifest_path}: damaged (not UTF-8 text); prepare the dataset again") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{manifest_path}:{exc.lineno}: invalid JSON ({exc.msg})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise UserError(f"{manifest_path}: format {found!r}, expected {FORMAT!r}")
    return manifest


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's content (everything but its ``digest`` field)."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def manifest_problem(manifest: dict) -> str | None:
    """Why a manifest cannot be trusted (no digest, or edited after ``mimir prepare`` wrote it),
    or None."""
    if "digest" not in manifest:
        return "has no digest (deleted by hand, or written before digests were recorded); prepare it again"
    if manifest["digest"] != manifest_digest(manifest):
        return "edited after mimir prepare wrote it (its digest does not match its content)"
    return None


def sha256_file(path: str | Path) -> str:
    """sha256 of a file (hashlib releases the GIL: threads hash files in parallel)."""
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# The .idx layout of megatron-core's IndexedDataset (version 1): a header, then int32 sequence
# lengths, int64 sequence pointers (byte offsets into the .bin) and int64 document indices.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEAD = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count


def shard_problems(path: Path, manifest: dict) -> list[str]:
    """Structural problems of a prepared dataset's shards, one line each naming the file: missing
    files, an ``.idx`` that is not an index of this dtype, of this shard's document count or of
    its own size, a ``.bin`` of another size than its index covers (truncated, or an ``.idx``
    from elsewhere). A few bytes are read per shard: cheap at any size, run before every start."""
    dtype = np.dtype(manifest.get("dtype", "int32"))
    problems = []
    for shard in manifest.get("shards", []):
        idx = path / f"{shard['prefix']}.idx"
        try:
            problem = _shard_problem(idx, idx.with_suffix(".bin"), shard["documents"], dtype)
        except FileNotFoundError as exc:
            problem = f"{exc.filename}: missing"
        except OSError as exc:
            problem = f"{exc.filename or idx}: cannot read ({exc.strerror or exc})"
        if problem:
            problems.append(problem)
    return problems


def _shard_problem(idx: Path, data: Path, shard_documents: int, dtype: np.dtype) -> str | None:
    from megatron.core.datasets.indexed_dataset import DType

    with open(idx, "rb") as f, open(data, "rb") as b:
        head = f.read(_IDX_HEAD)
        if len(head) < _IDX_HEAD or head[:9] != _IDX_MAGIC:
            return f"{idx}: not a megatron index (bad header)"
        code, sequences, documents = head[17], *np.frombuffer(head[18:34], dtype="<u8").tolist()
        if code != DType.code_from_dtype(dtype.type):
            return f"{idx}: token dtype code {code}, the manifest says {dtype.name}"
        if sequences != SEQUENCES_PER_DOCUMENT * shard_documents or documents != shard_documents + 1:
            return (f"{idx}: holds {max(documents, 1) - 1} documents, the manifest says {shard_documents} "
                    "for this shard (a file from another shard or dataset?)")
        idx_size, expected = os.fstat(f.fileno()).st_size, _IDX_HEAD + 12 * sequences + 8 * documents
        if idx_size != expected:
            return f"{idx}: {idx_size:,} bytes, {expected:,} expected for its {sequences} sequences (damaged)"
        bin_size, covered = os.fstat(b.fileno()).st_size, _bin_bytes_covered(f, sequences, dtype.itemsize)
        if bin_size != covered:
            what = "truncated" if bin_size < covered else "longer"
            return (f"{data}: {bin_size:,} bytes, its index {idx.name} covers {covered:,} ({what}, or one of "
                    "the two comes from elsewhere)")
    return None


def _bin_bytes_covered(index_file, sequences: int, itemsize: int) -> int:
    """End of the last sequence in the .bin: its pointer plus its length."""
    if sequences == 0:
        return 0
    fd = index_file.fileno()
    length = int(np.frombuffer(os.pread(fd, 4, _IDX_HEAD + 4 * (sequences - 1)), dtype="<i4")[0])
    pointer = int(np.frombuffer(os.pread(fd, 8, _IDX_HEAD + 4 * sequences + 8 * (sequences - 1)),
                                dtype="<i8")[0])
    return pointer + length * itemsize


def hash_outputs(path: Path, manifest: dict, submit) -> list[tuple[Path, str, Future]]:
    """Start hashing the files a manifest lists: ``submit(path)`` returns a future of the file's
    sha256 (None: not this caller's to check), so that many datasets hash in parallel;
    :func:`output_problems` reads the verdicts."""
    return [(path / rel, want, submit(path / rel)) for rel, want in manifest.get("outputs", {}).items()]


def output_problems(pending: list[tuple[Path, str, Future]]) -> list[str]:
    """Files whose sha256 differs from the manifest's (one line each naming the file)."""
    problems = []
    for file, want, future in pending:
        try:
            got = future.result()
        except FileNotFoundError:
            problems.append(f"{file}: missing")
            continue
        except OSError as exc:
            problems.append(f"{file}: cannot read ({exc.strerror or exc})")
            continue
        if got is not None and got != want:
            problems.append(f"{file}: sha256 differs from the manifest's (damaged, or replaced since "
                            "mimir prepare wrote it); prepare the dataset again")
    return problems


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

            prefix = self._shard_prefixes[index]
            try:
                self._opened[index] = IndexedDataset(prefix)
            except (OSError, ValueError, AssertionError) as exc:  # megatron asserts on a bad header
                raise UserError(f"{prefix}.idx/.bin: cannot open ({exc}); `mimir train` checks prepared "
                                "data before step 1 (prepare the dataset again)") from None
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
        try:
            prefix = ds.get(SEQUENCES_PER_DOCUMENT * local).astype(np.int64)
            response = ds.get(SEQUENCES_PER_DOCUMENT * local + 1).astype(np.int64)
        except (OSError, ValueError) as exc:  # a .bin shorter than its index (numpy's ValueError)
            raise UserError(f"{self._shard_prefixes[shard]}.bin: cannot read document {local} ({exc}); "
                            "the file is damaged: prepare the dataset again") from None
        return prefix, response

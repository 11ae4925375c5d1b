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

import errno
import json
import os
import threading
from concurrent.futures import Future
from functools import cached_property
from pathlib import Path

import numpy as np

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import sha256_file, write_json_atomic

from .files import data_files, too_many_files_line
from .manifest import Manifest

REJECTS_NAME = "rejects.jsonl"
SHARDS_DIR = "shards"
SEQUENCES_PER_DOCUMENT = 2


# The .idx layout of megatron-core's IndexedDataset (version 1): a header, then int32 sequence
# lengths, int64 sequence pointers (byte offsets into the .bin) and int64 document indices.
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEAD = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count


def shard_problems(path: Path, manifest: Manifest) -> list[str]:
    """Structural problems of a prepared dataset's shards, one line each naming the file: missing
    files, an ``.idx`` that is not an index of this dtype, of this shard's document count or of
    its own size, a ``.bin`` of another size than its index covers (truncated, or an ``.idx``
    from elsewhere). A few bytes are read per shard: cheap at any size, run before every start."""
    dtype = np.dtype(manifest.dtype)
    problems = []
    for shard in manifest.shards:
        idx = path / f"{shard.prefix}.idx"
        try:
            problem = _shard_problem(idx, idx.with_suffix(".bin"), shard.documents, dtype)
        except FileNotFoundError as exc:
            problem = f"{exc.filename}: missing"
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # the process's limit, not the data
                raise _read_error(str(exc.filename or idx), exc) from None
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


class ByteShares:
    """Which of ``world`` ranks hashes each file: the one with the fewest bytes so far (files
    taken in the same order on every rank, so every rank decides the same). A split by file count
    gave one rank every ``.bin`` and the other every ``.idx``."""

    def __init__(self, world: int) -> None:
        self.loads = [0] * world

    def owner(self, size: int) -> int:
        rank = self.loads.index(min(self.loads))
        self.loads[rank] += size
        return rank


VERIFIED_CACHE_GLOB = "verified-sha256.*.json"


class DigestCache:
    """sha256 digests of files hashed on an earlier start, reused while a file's (path, size,
    mtime, inode, inode change time) are unchanged: a restart does not read a 100B-token corpus
    again. Each rank keeps its own file (``verified-sha256.rank<r>.json``) in ``directory`` and
    reads all of them. A file rewritten in place keeps its inode but not its mtime, and setting an
    old mtime back (``touch -d``, ``os.utime``) changes the inode's ctime, which no user can set:
    either edit is read again. (Moving or ``chmod``-ing a file changes its ctime too: it costs one
    more hashing, nothing else.)"""

    def __init__(self, directory: Path, rank: int) -> None:
        self.path = directory / VERIFIED_CACHE_GLOB.replace("*", f"rank{rank}")
        self.known: dict[str, list] = {}
        self.reused = 0
        for part in sorted(directory.glob(VERIFIED_CACHE_GLOB)):
            try:
                entries = json.loads(part.read_text())
            except (OSError, ValueError):
                continue  # a damaged cache only costs hashing
            if isinstance(entries, dict):
                self.known.update({k: v for k, v in entries.items() if isinstance(v, list) and len(v) == 5})
        self.seen: dict[str, list] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(st: os.stat_result) -> list:
        return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]

    def sha256(self, path: Path) -> str:
        """The file's sha256: remembered if it is unchanged since, else read (thread-safe)."""
        name = str(Path(path).resolve())
        key = self._key(os.stat(name))
        entry = self.known.get(name)
        if entry is not None and entry[:-1] == key:
            with self._lock:
                self.reused += 1
            digest = entry[-1]
        else:
            digest = sha256_file(name)
            if self._key(os.stat(name)) != key:  # changed while it was read: remember nothing
                return digest
        self.seen[name] = [*key, digest]
        return digest

    def save(self) -> None:
        """Write what this rank knows (atomically); a directory that is not writable costs only
        the hashing next time."""
        entries = {**self.known, **self.seen}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A cache: losing it costs hashing, so no fsync.
            write_json_atomic(self.path, entries, indent=None, fsync=False)
        except OSError:
            pass


def hash_outputs(path: Path, manifest: Manifest, submit) -> list[tuple[Path, str, Future]]:
    """Start hashing the files a manifest lists: ``submit(path)`` returns a future of the file's
    sha256 (None: not this caller's to check), so that many datasets hash in parallel;
    :func:`output_problems` reads the verdicts."""
    return [(path / rel, want, submit(path / rel)) for rel, want in manifest.outputs.items()]


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

    Documents are read with ``os.pread`` through the process's bounded pool of open files
    (:mod:`.files`): nothing is opened until a document is read, and a mixture of any number of
    shards stays within the open-file limit. The ``.idx`` layout is megatron-core's (see
    :func:`shard_problems`); a document's two sequences lie back to back in the ``.bin``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.record = Manifest.read(self.path)
        """Its manifest (read and checked, digest included)."""
        shards = [s for s in self.record.shards if s.documents > 0]
        self._shard_prefixes = [str(self.path / s.prefix) for s in shards]
        self._shard_documents = [s.documents for s in shards]
        counts = np.array(self._shard_documents, dtype=np.int64)
        self._doc_starts = np.concatenate([[0], np.cumsum(counts)])
        self._dtype = np.dtype(self.record.dtype).newbyteorder("<")
        self._opened: dict[int, object] = {}

    @property
    def shard_prefixes(self) -> list[str]:
        """Path prefixes (without ``.bin``/``.idx``) of the non-empty shards, in document order."""
        return list(self._shard_prefixes)

    @property
    def shard_documents(self) -> list[int]:
        """Documents of each non-empty shard, in the order of :attr:`shard_prefixes`."""
        return list(self._shard_documents)

    def shard(self, index: int):
        """The megatron-core ``IndexedDataset`` of shard ``index`` (opened once, memory-mapped; for
        tools that scan whole shards: training reads through :meth:`document`)."""
        if index not in self._opened:
            from megatron.core.datasets.indexed_dataset import IndexedDataset

            prefix = self._shard_prefixes[index]
            try:
                self._opened[index] = IndexedDataset(prefix)
            except (OSError, ValueError, AssertionError) as exc:  # megatron asserts on a bad header
                raise UserError(f"{prefix}.idx/.bin: cannot open ({_reason(exc)}); `mimir train` checks "
                                "prepared data before step 1 (prepare the dataset again)") from None
        return self._opened[index]

    @property
    def num_documents(self) -> int:
        return int(self._doc_starts[-1])

    def shard_lengths(self, index: int) -> np.ndarray:
        """``[documents, 2]`` int32 (prefix, response) token counts of shard ``index``, read from its
        ``.idx`` (a file opened and closed: this scans, it does not keep the shard open)."""
        documents = self._shard_documents[index]
        idx = self._shard_prefixes[index] + ".idx"
        size = 4 * SEQUENCES_PER_DOCUMENT * documents
        try:
            with open(idx, "rb") as f:
                raw = os.pread(f.fileno(), size, _IDX_HEAD)
        except OSError as exc:
            raise _read_error(idx, exc) from None
        if len(raw) != size:
            raise UserError(f"{idx}: shorter than its {documents} documents need (damaged); prepare the "
                            "dataset again")
        return np.frombuffer(raw, dtype="<i4").reshape(documents, SEQUENCES_PER_DOCUMENT).astype(np.int32)

    @cached_property
    def _lengths(self) -> np.ndarray:
        """``[documents, 2]`` int32 array of (prefix, response) token counts."""
        parts = [self.shard_lengths(i) for i in range(len(self._shard_prefixes))]
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
        prefix_path = self._shard_prefixes[shard]
        sequences = SEQUENCES_PER_DOCUMENT * self._shard_documents[shard]
        seq = SEQUENCES_PER_DOCUMENT * local
        pool = data_files()
        idx, data = prefix_path + ".idx", prefix_path + ".bin"
        try:
            lengths = np.frombuffer(pool.pread(idx, 8, _IDX_HEAD + 4 * seq), dtype="<i4")
            pointer = np.frombuffer(pool.pread(idx, 8, _IDX_HEAD + 4 * sequences + 8 * seq), dtype="<i8")
            if len(lengths) != 2 or len(pointer) != 1:
                raise ValueError(f"{idx} is shorter than its index needs")
            p, r = int(lengths[0]), int(lengths[1])
            want = (p + r) * self._dtype.itemsize
            raw = pool.pread(data, want, int(pointer[0]))
            if len(raw) != want or p < 0 or r < 0:
                raise ValueError(f"{len(raw)} of {want} bytes at offset {int(pointer[0])}")
        except (OSError, ValueError) as exc:  # short file, or an index pointing past it
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                raise UserError(too_many_files_line(f"{data}: cannot read ({exc.strerror})")) from None
            raise UserError(f"{data}: cannot read document {local} ({_reason(exc)}); the file is damaged: "
                            "prepare the dataset again") from None
        tokens = np.frombuffer(raw, dtype=self._dtype).astype(np.int64)
        return tokens[:p], tokens[p:]


def _reason(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)) or type(exc).__name__


def _read_error(path: str, exc: OSError) -> UserError:
    """A one-line error for a file that cannot be read: out of descriptors says so."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return UserError(too_many_files_line(f"{path}: cannot open ({exc.strerror})"))
    return UserError(f"{path}: cannot read ({_reason(exc)})")

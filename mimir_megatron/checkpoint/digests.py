"""The sha256 of every file of a checkpoint: recorded by the writer, verified by every reader.

Recording (:class:`~.write.CheckpointWriter`): each rank hashes the files it wrote itself (its
``__<rank>_*.distcp`` data files and its RNG file) as soon as its write has finished, in the
process that wrote them: the forked writer of an asynchronous save (off the training's path), the
rank itself for a synchronous one. It leaves them in ``digests_rank<r>.json``; rank 0 merges
those when it makes the checkpoint visible, hashes what no rank covered (megatron's small
metadata files) and stores the result as the trainer state's ``files``.

Verification (:func:`start_verification`): threads hash the recorded files while the caller does
something else (builds the model); ``problems()`` then says what differs: one line per file,
naming the checkpoint and the file. A share (``rank``, ``world``) splits the files over the ranks
of a job, whose verdicts the caller gathers.

The data files pack many tensors each (torch_dist's ``.distcp``), so the digests are per file:
torch's format records no per-tensor boundaries at write time that this package could hash
without re-reading the file.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mimir_megatron.errors import UserError
from mimir_megatron.integrity import sha256_file, write_json_atomic

from .trainer_state import STATE_FILE, FileDigest, TrainerState, read_trainer_state

log = logging.getLogger(__name__)

_RANK_RECORD = "digests_rank{rank}.json"
_BLOCK = 1 << 22


def _digest(path: Path) -> FileDigest:
    return FileDigest(bytes=path.stat().st_size, sha256=sha256_file(path))


def _threads(count: int) -> int:
    return max(1, min(count, os.cpu_count() or 1, 8))


# -- recording (the writer) ------------------------------------------------------------------------


def rank_files(directory: Path, rank: int) -> list[Path]:
    """The files rank ``rank`` writes into a checkpoint: its torch_dist data files (megatron
    names them ``__<global rank>_<n>.distcp``) and its RNG state."""
    return [*sorted(directory.glob(f"__{rank}_*.distcp")), *directory.glob(f"rng_rank{rank}.safetensors")]


def record_rank_digests(directory: Path, rank: int) -> None:
    """Hash the files this rank wrote into ``directory`` (run where the write finished)."""
    files = rank_files(directory, rank)
    with ThreadPoolExecutor(_threads(len(files))) as pool:
        digests = dict(zip((p.name for p in files), pool.map(_digest, files)))
    write_json_atomic(directory / _RANK_RECORD.format(rank=rank),
                      {name: d.to_dict() for name, d in digests.items()}, indent=None)


def after_write(write, directory: Path, rank: int):
    """``write`` (megatron's asynchronous write function, or None: nothing to write on this rank)
    followed by this rank's digests, in the forked writer."""

    def write_then_record(*args, **kwargs):
        if write is not None:
            write(*args, **kwargs)
        record_rank_digests(directory, rank)

    return write_then_record


def collect_digests(directory: Path) -> dict[str, FileDigest]:
    """Every file of a written checkpoint with its digest (rank 0, once every rank has written):
    the ranks' records, and the files none of them covered hashed now. The records are removed."""
    digests: dict[str, FileDigest] = {}
    records = sorted(directory.glob(_RANK_RECORD.format(rank="*")))
    for record in records:
        for name, entry in json.loads(record.read_text()).items():
            digests[name] = FileDigest(**entry)
    skip = {STATE_FILE, *(r.name for r in records)}
    rest = sorted(p for p in directory.iterdir()
                  if p.is_file() and p.name not in skip and p.name not in digests)
    with ThreadPoolExecutor(_threads(len(rest))) as pool:
        digests.update(zip((p.name for p in rest), pool.map(_digest, rest)))
    for record in records:
        record.unlink()
    return dict(sorted(digests.items()))


# -- verification (every reader) -------------------------------------------------------------------


class CheckpointDamaged(UserError):
    """A checkpoint's files are not what its writer recorded (or its state cannot be read)."""


@dataclass
class Verification:
    """A verification under way (:func:`start_verification`)."""

    path: Path
    state: TrainerState | None
    """None: the trainer state itself could not be read (``_early`` says why)."""
    _futures: list[tuple[str, FileDigest, Future]]
    _early: list[str]
    _pool: ThreadPoolExecutor | None

    def problems(self) -> list[str]:
        """One line per damaged file of this share (empty: it verifies). Waits for the hashing."""
        out = list(self._early)
        for name, want, future in self._futures:
            try:
                got = future.result()
            except OSError as exc:
                out.append(f"checkpoint {self.path}: cannot read {name} ({exc.strerror or exc})")
                continue
            if got != want.sha256:
                out.append(f"checkpoint {self.path} is damaged: {name} differs from what was written "
                           f"(sha256 {got[:12]}..., recorded {want.sha256[:12]}...)")
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return out

    def check(self) -> TrainerState:
        """The trainer state, once every file of this share verifies; else one
        :class:`CheckpointDamaged` line naming the first damaged file (and how many more)."""
        problems = self.problems()
        if problems:
            more = f" (and {len(problems) - 1} more damaged file(s))" if len(problems) > 1 else ""
            raise CheckpointDamaged(problems[0] + more)
        assert self.state is not None
        return self.state


def start_verification(path: Path, *, rank: int = 0, world: int = 1,
                       state: TrainerState | None = None) -> Verification:
    """Start hashing the files of checkpoint ``path`` (this rank's share: every ``world``-th file
    from ``rank``) in background threads. Missing and truncated files, and a trainer state that
    cannot be read, are found at once (every rank checks every size: a ``stat`` each). ``state``:
    the trainer state, when the caller read it already (its digest checked)."""
    path = Path(path)
    try:
        state = state if state is not None else read_trainer_state(path)
    except UserError as exc:
        return Verification(path, None, [], [f"checkpoint {path} is damaged: {exc}"], None)
    if not state.files:
        log.warning("checkpoint %s was written before file digests were recorded: not verified", path)
        return Verification(path, state, [], [], None)
    early, to_hash = [], []
    for index, (name, want) in enumerate(sorted(state.files.items())):
        file = path / name
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            early.append(f"checkpoint {path} is damaged: {name} is missing")
            continue
        except OSError as exc:
            early.append(f"checkpoint {path}: cannot read {name} ({exc.strerror or exc})")
            continue
        if size != want.bytes:
            what = "truncated" if size < want.bytes else "longer than written"
            early.append(f"checkpoint {path} is damaged: {name} is {what} ({size:,} bytes, "
                         f"{want.bytes:,} written)")
        elif index % world == rank:
            to_hash.append((name, want))
    pool = ThreadPoolExecutor(_threads(len(to_hash)), thread_name_prefix="verify") if to_hash else None
    futures = [(name, want, pool.submit(sha256_file, path / name)) for name, want in to_hash] if pool else []
    return Verification(path, state, futures, early, pool)

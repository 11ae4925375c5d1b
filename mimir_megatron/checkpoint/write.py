"""Writing checkpoints: synchronously, or in a background process through megatron-core.

A checkpoint is written under ``step_N.tmp`` and renamed when every rank has finished; ``latest``
is replaced with ``os.replace``; then old checkpoints are pruned (:mod:`.prune`).

With ``checkpoint.async_save`` the sharded tensors are written by a forked process through
megatron-core's ``AsyncCallsQueue`` while training goes on; ``step_N`` and ``latest`` are made
only once the write has finished on every rank. A failed write (no space left, ...) leaves the
previous checkpoint and ``latest`` as they were and ends the job with one message.

Every file's sha256 is recorded in the trainer state (:mod:`.digests`: each rank hashes what it
wrote where it wrote it, the forked writer for an asynchronous save). Weights that are not finite
are never written: the save ends the job instead, and ``latest`` keeps naming the last good state.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException

from mimir_megatron import backend
from mimir_megatron.errors import UserError, write_error

from .digests import after_write, collect_digests, record_rank_digests
from .layout import FORMAT, latest_name, rng_file, step_dir_name, step_of
from .layout import write_latest as _write_latest
from .prune import prune_checkpoints as _prune
from .signal_safe import start_shielded, write_results_queue
from .state import rng_state as _rng_state
from .state import is_row_sharded, sharded_state
from .trainer_state import TrainerState, write_trainer_state

log = logging.getLogger(__name__)


def check_writable(checkpoint_dir: Path) -> None:
    """Fail before training, not at the first save, when checkpoints cannot be written."""
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        probe = checkpoint_dir / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise write_error(exc, f"checkpoint directory {checkpoint_dir}", "set checkpoint.dir to a writable "
                          "directory") from None


class CheckpointWriteError(UserError):
    """A checkpoint could not be written; the previous one and ``latest`` are untouched."""


class CheckpointWriter:
    """Writes checkpoints, synchronously or (``asynchronous``) in a background process.

    Asynchronous saves go through megatron-core's ``AsyncCallsQueue`` (the ``mcore`` strategy;
    ``nvrx`` needs nvidia-resiliency-ext). ``save`` returns once the state is captured: on GPU it
    is copied to host memory, on CPU the forked writer sees the state as of the fork. The
    checkpoint becomes visible (rename, ``latest``, pruning) in a finalize step that megatron runs
    on every rank once all ranks' writes are done: ``poll`` after each step, ``wait`` before
    exiting. One write is in flight at a time: a save waits for the previous one. Every method is
    collective over all ranks.
    """

    def __init__(self, checkpoint_dir: Path, keep: int, asynchronous: bool = False,
                 on_saved: Callable[[Path], None] | None = None):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.checkpoint_dir = checkpoint_dir
        self.keep = keep
        self.on_saved = on_saved
        # Not persistent: a worker fed through a queue would move CPU tensors to shared memory
        # and write them while training changes them; a forked writer gets a snapshot.
        self._queue = AsyncCallsQueue(persistent=False) if asynchronous else None
        self.pending: Path | None = None
        self._needed = 0
        """Bytes the tensors of the save in progress take (all ranks): what a full disk lacked."""
        # An asynchronous writer's helper process starts now, not inside the first save.
        write_results_queue(cross_process=asynchronous)

    def save(self, step: int, model, optimizer, ema, trainer_state: TrainerState) -> Path:
        self.wait()
        _writer_error_log().drain()  # only this write's errors explain its failure
        self._refuse_nonfinite(step, model, ema)
        rank = dist.get_rank()
        final = self.checkpoint_dir / step_dir_name(step)
        tmp = self.checkpoint_dir / (step_dir_name(step) + ".tmp")
        error: BaseException | None = None
        if rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            except OSError as exc:
                error = exc
        self._agree(step, tmp, error)
        request = None
        try:
            # A helper that died since the last save is started again.
            write_results_queue(cross_process=self._queue is not None)
            sharded = sharded_state(model, optimizer, ema.shadow if ema is not None else None,
                                    main_params=optimizer if is_row_sharded(optimizer) else None)
            self._needed = _bytes_to_write(sharded)
            request = dist_checkpointing.save(sharded, str(tmp),
                                              async_sharded_save=self._queue is not None,
                                              async_strategy="mcore")
            save_file(_rng_state(), str(rng_file(tmp, rank)))
            if request is None:
                record_rank_digests(tmp, rank)
            else:  # hashed by the forked writer once its write is done
                request = request._replace(async_fn=after_write(request.async_fn, tmp, rank))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - it wraps the OSError
            error = exc
        self._agree(step, tmp, error)
        if trainer_state.model.get("params_dtype", "float32") != "float32":
            # bf16 parameters are saved as their fp32 main copy (see state.sharded_state): the
            # checkpoint's weights are fp32 whatever the run's parameters were.
            trainer_state = replace(trainer_state, model={**trainer_state.model, "params_dtype": "float32"})
        commit = partial(self._commit, step, tmp, final, trainer_state)
        if request is None:
            commit()
            return final
        request.add_finalize_fn(commit)
        start_shielded(partial(self._queue.schedule_async_request, request))  # forks the writer
        self.pending = final
        log.info("checkpoint %s: writing in the background", final.name)
        return final

    def poll(self) -> None:
        """Make finished background writes visible (collective; cheap when none is pending)."""
        self._finalize(blocking=False)

    def wait(self) -> None:
        """Block until the pending write is written and visible (pre-emption, end of run)."""
        self._finalize(blocking=True)

    def abort(self) -> None:
        """After a failure elsewhere: stop a pending write without making it visible."""
        if self._queue is not None:
            for call in self._queue.async_calls:
                call.async_caller.close(abort=True)
            self._queue.async_calls.clear()
        self.pending = None

    def _finalize(self, blocking: bool) -> None:
        if self._queue is None or not self._queue.get_num_unfinalized_calls():
            return
        pending = self.pending
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointWriteError:
            self.abort()
            raise
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a write failed on a rank
            self.abort()
            assert pending is not None
            if dist.get_rank() == 0:
                shutil.rmtree(pending.with_name(pending.name + ".tmp"), ignore_errors=True)
            raise self._error(step_of(pending), exc) from exc
        if not self._queue.get_num_unfinalized_calls():
            self.pending = None

    def _commit(self, step: int, tmp: Path, final: Path, trainer_state: TrainerState) -> None:
        """Rank 0 makes the written checkpoint visible; run once every rank's write is done."""
        error: BaseException | None = None
        if dist.get_rank() == 0:
            try:
                write_trainer_state(tmp, replace(trainer_state, format=FORMAT, written_at=time.time(),
                                                 files=collect_digests(tmp)))
                if final.exists():
                    shutil.rmtree(final)
                tmp.rename(final)
                _write_latest(self.checkpoint_dir, final.name)
            except OSError as exc:
                error = exc
        self._agree(step, tmp, error)
        if dist.get_rank() == 0:
            _prune(self.checkpoint_dir, self.keep)
        if self.on_saved is not None:
            self.on_saved(final)
        dist.barrier()

    def _refuse_nonfinite(self, step: int, model, ema) -> None:
        """End the job instead of writing weights (or EMA weights) that are not finite; collective."""
        # Each rank checks what it holds: with FSDP2 its rows of each weight (a DTensor's local part).
        tensors = [(name, getattr(p, "to_local", lambda p=p: p)()) for name, p in model.named_parameters()]
        if ema is not None:
            tensors += [(f"ema.{name}", t) for name, t in ema.shadow.items()]
        finite = torch.stack([torch.isfinite(t).all() for _, t in tensors]) if tensors else torch.ones(1)
        bad = (~finite).float().max().reshape(1).to(backend.device())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if not bad.item():
            return
        local = [name for (name, _), ok in zip(tensors, finite.tolist()) if not ok]
        where = f"{local[0]} holds NaN or Inf" if local else "on another rank"
        previous = latest_name(self.checkpoint_dir) or "none"
        raise CheckpointWriteError(
            f"not writing checkpoint {step_dir_name(step)}: the weights are not finite ({where}); "
            f"the previous checkpoint ({previous}) and `latest` are intact")

    def _agree(self, step: int, tmp: Path, error: BaseException | None) -> None:
        """All ranks fail together when one failed (no rank left waiting in a collective)."""
        failed = torch.tensor([0.0 if error is None else 1.0], device=backend.device())
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            if dist.get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._error(step, error)

    def _error(self, step: int, cause: BaseException | None) -> CheckpointWriteError:
        previous = latest_name(self.checkpoint_dir) or "none"
        reason = _writer_error_log().drain() or _root_cause(cause)
        try:
            free = shutil.disk_usage(self.checkpoint_dir).free
        except OSError:
            free = None
        if (free is not None and free < self._needed) or _is_disk_full(cause, reason):
            # torch's writer says "unexpected pos" where the disk is full: what it means, plainly.
            free_text = "" if free is None else f" ({free:,} free)"
            reason = (f"no space left on device: {self.checkpoint_dir}, {self._needed:,} bytes "
                      f"needed{free_text}")
        return CheckpointWriteError(
            f"could not write checkpoint {step_dir_name(step)} to {self.checkpoint_dir}: "
            f"{reason}; the previous checkpoint ({previous}) and `latest` are intact"
        )


class _WriterErrors(logging.Handler):
    """The messages of megatron's checkpoint writer errors, also from its forked writer.

    megatron's writer turns a failed write into an exception naming only the error's type
    (``error: <class 'OSError'>``) and logs the message itself. This handler keeps those
    messages; a pipe carries them out of the forked writer (a full disk cannot take a file).
    """

    LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
    PREFIX = "encountered an error: "

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        logging.getLogger(self.LOGGER).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            os.write(self._write, (record.getMessage().replace("\n", " ")[:2000] + "\n").encode())
        except OSError:
            pass  # a full pipe: the first messages are the ones that matter

    def drain(self) -> str | None:
        """The first error message since the last drain, if any."""
        data = b""
        while True:
            try:
                chunk = os.read(self._read, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            data += chunk
        found = [line.split(self.PREFIX, 1)[1] for line in data.decode(errors="replace").splitlines()
                 if self.PREFIX in line]
        return found[0] if found else None


_writer_errors: _WriterErrors | None = None


def _writer_error_log() -> _WriterErrors:
    global _writer_errors
    if _writer_errors is None:
        _writer_errors = _WriterErrors()
    return _writer_errors


def _bytes_to_write(sharded: dict) -> int:
    """Bytes of the tensors the ranks write (main replicas only), summed over all ranks; collective."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    local = sum(t.data.numel() * t.data.element_size() for t in nested_values(sharded)
                if isinstance(t, ShardedTensor) and t.data is not None and is_main_replica(t.replica_id))
    total = torch.tensor([float(local)], dtype=torch.float64, device=backend.device())
    dist.all_reduce(total)
    return int(total.item())


def _is_disk_full(cause: BaseException | None, reason: str) -> bool:
    seen = 0
    while cause is not None and seen < 20:
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return True
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return "No space left on device" in reason or "unexpected pos" in reason


def _root_cause(exc: BaseException | None) -> str:
    """The first OS-level reason inside dist_checkpointing's wrapped exceptions."""
    if exc is None:
        return "failed on another rank (see that rank's log)"
    if isinstance(exc, CheckpointException):
        if not exc.failures:  # the details are raised on the coordinator only
            return "failed on a rank (see rank 0's log)"
        exc = next(iter(exc.failures.values()))[0]
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, OSError) else str(exc)

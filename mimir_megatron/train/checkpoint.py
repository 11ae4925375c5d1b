"""Training checkpoints with megatron-core dist_checkpointing.

Layout of ``<checkpoint dir>``::

    step_0000200/            one checkpoint, visible only once complete
        (dist_checkpointing files: model, optimizer moments, EMA; resharding-capable)
        trainer_state.json   step, consumed samples, window, group steps, data fingerprint,
                             model shape, MLflow run id
        rng_rank<r>.safetensors  each rank's RNG state
    latest                   name of the newest complete checkpoint (replaced atomically)

A checkpoint is written under ``step_N.tmp`` and renamed when every rank has finished; ``latest``
is replaced with ``os.replace``. The ``keep`` most recently *written* checkpoints stay, and never
the one ``latest`` names: after a rollback (resuming from an older checkpoint), the new timeline's
checkpoints are the ones kept, and the abandoned timeline's are moved to ``abandoned/`` at start.
A ``latest`` that names a missing checkpoint is an error, never a fresh start.

With ``checkpoint.async_save`` the sharded tensors are written by a forked process through
megatron-core's ``AsyncCallsQueue`` while training goes on; ``step_N`` and ``latest`` are made
only once the write has finished on every rank. A failed write (no space left, ...) leaves the
previous checkpoint and ``latest`` as they were and ends the job with one message.

Trust: dist_checkpointing reads its metadata (``.metadata``, ``common.pt``) through torch's
checkpoint reader, which unpickles it, so loading a checkpoint can run code from whoever wrote it.
Load only your own checkpoints; third-party weights go through ``mimir import`` (safetensors).
Our own files are JSON and safetensors.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException

from mimir_megatron import backend
from mimir_megatron.config import ModelConfig
from mimir_megatron.errors import UserError
from mimir_megatron.model.sharded import ema_sharded_state, model_sharded_state
from mimir_megatron.train.signal_safe_helpers import start_shielded, write_results_queue

if TYPE_CHECKING:
    from mimir_megatron.train.config import TrainConfig

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
FORMAT = 1
"""Layout version of the sharded state; bumped whenever its keys change."""
LATEST = "latest"
ABANDONED = "abandoned"
# Shape fields the weights do not depend on: the recurrence schedule and metadata may change
# between save and resume (execution and parallel settings are not part of the shape at all).
_FREE_SHAPE_FIELDS = {"bp_window", "window_policy", "tokenizer", "seed", "h_cycles", "l_cycles",
                      "max_position_embeddings"}


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def step_of(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def complete_checkpoints(checkpoint_dir: Path) -> list[Path]:
    """Complete checkpoints in ``checkpoint_dir``, oldest *written* first (not lowest step)."""
    found = [p for p in checkpoint_dir.glob("step_*") if p.name[5:].isdigit() and (p / STATE_FILE).is_file()]

    def written(path: Path) -> tuple[float, int]:
        try:
            at = float(json.loads((path / STATE_FILE).read_text()).get("written_at", 0.0))
        except (OSError, ValueError):
            at = 0.0  # unreadable: oldest, pruned first
        return at, step_of(path)

    return sorted(found, key=written)


def latest_name(checkpoint_dir: Path) -> str | None:
    pointer = checkpoint_dir / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names; None only when the directory holds no checkpoint at all.

    A ``latest`` naming a missing or incomplete checkpoint is an error: starting again from step
    0 would silently throw the run away. Without a ``latest`` (a kill between the rename and the
    pointer update) the newest written checkpoint is taken.
    """
    name = latest_name(checkpoint_dir)
    if name is None:
        complete = complete_checkpoints(checkpoint_dir)
        if complete:
            log.warning("%s has no `latest`; resuming from the newest written checkpoint %s",
                        checkpoint_dir, complete[-1].name)
            return complete[-1]
        return None
    path = checkpoint_dir / name
    if not (path / STATE_FILE).is_file():
        present = ", ".join(p.name for p in complete_checkpoints(checkpoint_dir)) or "none"
        raise UserError(
            f"{checkpoint_dir / LATEST} names {name}, which is not a complete checkpoint; refusing "
            f"to start again from step 0 (complete checkpoints here: {present}). Pass "
            "checkpoint.resume=<checkpoint directory>, or checkpoint.resume=never to start afresh"
        )
    return path


def set_aside_newer(checkpoint_dir: Path, start_step: int, resumed_from: Path | None) -> Path | None:
    """Move the checkpoints of an abandoned timeline (steps after ``start_step``) aside; rank 0.

    Run at start, before the first save: they would otherwise be pruned in place of the new
    timeline's, or overwritten by it. Incomplete ``*.tmp`` writes are deleted.
    """
    for partial_write in checkpoint_dir.glob("step_*.tmp"):
        log.info("deleting %s (a write that did not finish)", partial_write)
        shutil.rmtree(partial_write, ignore_errors=True)
    newer = [p for p in complete_checkpoints(checkpoint_dir) if step_of(p) > start_step]
    if not newer:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = checkpoint_dir / ABANDONED / f"after_{step_dir_name(start_step)}_{stamp}"
    target.mkdir(parents=True, exist_ok=True)
    for path in newer:
        path.rename(target / path.name)
    log.warning("starting at step %d: moved %d checkpoint(s) of the abandoned timeline (%s) to %s; "
                "delete them when no longer needed", start_step, len(newer),
                ", ".join(p.name for p in newer), target)
    pointer = latest_name(checkpoint_dir)
    if pointer is not None and not (checkpoint_dir / pointer / STATE_FILE).is_file():
        if resumed_from is not None and resumed_from.resolve().parent == checkpoint_dir.resolve():
            _write_latest(checkpoint_dir, resumed_from.name)
        else:
            (checkpoint_dir / LATEST).unlink()
    return target


def _write_latest(checkpoint_dir: Path, name: str) -> None:
    pointer = checkpoint_dir / (LATEST + ".tmp")
    pointer.write_text(name + "\n")
    os.replace(pointer, checkpoint_dir / LATEST)


def check_writable(checkpoint_dir: Path) -> None:
    """Fail before training, not at the first save, when checkpoints cannot be written."""
    try:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        probe = checkpoint_dir / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"checkpoint directory {checkpoint_dir} is not writable: {exc}") from None


# -- sharded state ---------------------------------------------------------------------------------


def _sharded_state(model, optimizer, ema) -> dict[str, Any]:
    """Model, optimizer moments and EMA as sharded tensors keyed by parameter name.

    Optimizer moments are stored per parameter (``optimizer.<moment>.<param key>``), sharded like
    the parameter. With ZeRO-1 each rank holds, and writes as the main replica, only the
    parameters it owns; a checkpoint therefore reloads under any data-parallel size.
    """
    from mimir_megatron.train.optim import local_optimizer, owned_parameters

    model_sd = model_sharded_state(model)
    by_param = {id(t.data): t for t in model_sd.values() if hasattr(t, "data")}
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        local = local_optimizer(optimizer)
        sharded = local is not optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        moments = {}
        for param in owned_parameters(optimizer):
            entries = {}
            for moment in ("exp_avg", "exp_avg_sq"):
                tensor = make_sharded_optimizer_tensor(
                    by_param[id(param)], local.state[param][moment], prefix=f"optimizer.{moment}"
                )
                # The owner is the only holder: it writes, whatever its data-parallel rank.
                entries[moment] = replace(tensor, replica_id=0) if sharded else tensor
            moments[names[id(param)]] = entries
        state["optimizer"] = moments
    if ema is not None:
        state["ema"] = ema_sharded_state(model, model_sd, ema.shadow)
    return state


def _rng_state() -> dict[str, torch.Tensor]:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": torch.from_numpy(np.frombuffer(json.dumps(_np_state()).encode(), dtype=np.uint8).copy()),
        "python": torch.tensor(list(json.dumps(_py_state()).encode()), dtype=torch.uint8),
    }
    if backend.has_gpu():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _np_state() -> list:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return [name, keys.tolist(), pos, has_gauss, gauss]


def _py_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = json.loads(bytes(state["numpy"].tolist()).decode())
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss = json.loads(bytes(state["python"].tolist()).decode())
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and backend.has_gpu():
        torch.cuda.set_rng_state(state["cuda"])


# -- save / load -----------------------------------------------------------------------------------


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
        write_results_queue()  # its helper process starts now, not inside the first save

    def save(self, step: int, model, optimizer, ema, trainer_state: dict[str, Any]) -> Path:
        self.wait()
        _writer_error_log().drain()  # only this write's errors explain its failure
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
            write_results_queue()  # a helper that died since the last save is started again
            request = dist_checkpointing.save(_sharded_state(model, optimizer, ema), str(tmp),
                                              async_sharded_save=self._queue is not None,
                                              async_strategy="mcore")
            save_file(_rng_state(), str(tmp / f"rng_rank{rank}.safetensors"))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - it wraps the OSError
            error = exc
        self._agree(step, tmp, error)
        commit = partial(self._commit, step, tmp, final, dict(trainer_state))
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

    def _commit(self, step: int, tmp: Path, final: Path, trainer_state: dict[str, Any]) -> None:
        """Rank 0 makes the written checkpoint visible; run once every rank's write is done."""
        error: BaseException | None = None
        if dist.get_rank() == 0:
            try:
                state = {**trainer_state, "format": FORMAT, "written_at": time.time()}
                (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
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


def _prune(checkpoint_dir: Path, keep: int) -> None:
    """Keep the ``keep`` most recently written checkpoints and the one ``latest`` names."""
    complete = complete_checkpoints(checkpoint_dir)
    kept = {p.name for p in complete[-keep:]} | {latest_name(checkpoint_dir)}
    for old in complete:
        if old.name not in kept:
            log.info("pruning checkpoint %s", old.name)
            shutil.rmtree(old, ignore_errors=True)


def read_trainer_state(path: Path) -> dict[str, Any]:
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise UserError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    return json.loads(state_file.read_text())


def check_compatible(saved: dict[str, Any], cfg: ModelConfig, path: Path) -> None:
    """Refuse a checkpoint of another layout version or model shape, naming what differs."""
    if saved.get("format") != FORMAT:
        raise UserError(f"checkpoint {path} has layout version {saved.get('format', 'none')}; this "
                        f"version of mimir-megatron reads version {FORMAT}")
    current = cfg.shape_dict()
    diffs = [
        f"{key}: checkpoint {value!r}, config {current[key]!r}"
        for key, value in saved["model"].items()
        # Records written before the shape/execution split also hold execution and layout keys.
        if key in current and key not in _FREE_SHAPE_FIELDS and current[key] != value
    ]
    if saved.get("padded_vocab_size") != cfg.padded_vocab_size and not diffs:
        diffs.append(
            f"padded vocabulary: checkpoint {saved.get('padded_vocab_size')}, this TP layout "
            f"{cfg.padded_vocab_size} (set model.make_vocab_size_divisible_by so both agree)"
        )
    if diffs:
        raise UserError(f"checkpoint {path} holds a model of another shape:\n  - " + "\n  - ".join(diffs))


# What may change between save and resume without --allow-config-change: the layout of the same
# computation (how the global batch is split, whether Adam state is sharded) and reporting.
_LAYOUT_SETTINGS = {"train.micro_batch_size", "train.log_interval", "train.peak_tflops", "optim.shard_state",
                    "train.collective_timeout_s"}
_COMPARED_SECTIONS = ("train", "window", "optim")
_COMPARED_MODEL_FIELDS = ("h_cycles", "l_cycles", "window_policy")


def config_changes(saved: dict[str, Any], cfg: "TrainConfig") -> list[str]:
    """One line per training setting that differs from the checkpoint's: the trajectory changes."""
    before, now = saved.get("config", {}), cfg.to_dict()
    pairs = [(f"{section}.{key}", before.get(section, {}), key, value)
             for section in _COMPARED_SECTIONS for key, value in now[section].items()]
    pairs += [(f"model.{key}", saved.get("model", {}), key, now["model"][key])
              for key in _COMPARED_MODEL_FIELDS]
    return [
        f"{name}: checkpoint {old[key]!r}, config {value!r}"
        for name, old, key, value in pairs
        # A setting added since the checkpoint was written has no recorded value to compare.
        if name not in _LAYOUT_SETTINGS and key in old and old[key] != value
    ]


def check_resumable(saved: dict[str, Any], cfg: "TrainConfig", path: Path, fingerprint: str) -> list[str]:
    """Refuse a changed data mixture or training configuration unless allowed; returns the
    accepted configuration changes (to be recorded)."""
    check_compatible(saved, cfg.model, path)
    if saved["data_fingerprint"] != fingerprint and not cfg.checkpoint.allow_data_change:
        raise UserError(
            f"the data mixture changed since {path} was written "
            f"(fingerprint {saved['data_fingerprint'][:12]} -> {fingerprint[:12]}); "
            "pass checkpoint.allow_data_change=true to resume anyway"
        )
    changes = config_changes(saved, cfg)
    if changes and not cfg.checkpoint.allow_config_change:
        raise UserError(
            f"the training configuration changed since {path} was written:\n  - "
            + "\n  - ".join(changes)
            + "\npass --allow-config-change (checkpoint.allow_config_change=true) to resume anyway"
        )
    return changes


def load_checkpoint(path: Path, model, optimizer, ema) -> dict[str, Any]:
    """Load model (and optimizer, EMA when given) from ``path``; returns the trainer state."""
    trainer_state = read_trainer_state(path)
    check_compatible(trainer_state, model.cfg, path)
    sharded = _sharded_state(model, optimizer, ema)
    loaded = dist_checkpointing.load(sharded, str(path))
    model.load_state_dict(loaded["model"], strict=False)
    if optimizer is not None:
        from mimir_megatron.train.optim import local_optimizer, owned_parameters

        # Adam's per-parameter step is equal within a group; it is kept per group name.
        local, steps = local_optimizer(optimizer), trainer_state["optimizer_group_steps"]
        names = {id(p): n for n, p in model.named_parameters()}
        group_of_param = {id(p): g["name"] for g in local.param_groups for p in g["params"]}
        with torch.no_grad():
            for param in owned_parameters(optimizer):
                slot = local.state[param]
                for moment in ("exp_avg", "exp_avg_sq"):
                    slot[moment].copy_(loaded["optimizer"][names[id(param)]][moment])
                slot["step"] = torch.tensor(float(steps[group_of_param[id(param)]]))
    if ema is not None:
        with torch.no_grad():
            for name, tensor in loaded["ema"].items():
                ema.shadow[name].copy_(tensor)
    rng_file = path / f"rng_rank{dist.get_rank()}.safetensors"
    if rng_file.is_file():
        _set_rng_state(load_file(str(rng_file)))
    return trainer_state


def optimizer_group_steps(optimizer, group=None) -> dict[str, int]:
    """Adam steps per group; with ZeRO-1 a group's owner may be another data-parallel rank."""
    from mimir_megatron.train.optim import local_optimizer

    local = local_optimizer(optimizer)
    names = [g["name"] for g in optimizer.param_groups]
    steps = torch.full((len(names),), -1.0)
    for g in local.param_groups:
        if g["params"]:
            steps[names.index(g["name"])] = local.state[g["params"][0]]["step"].item()
    if local is not optimizer:
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)
    return {name: int(value) for name, value in zip(names, steps.tolist())}


def load_model_from_checkpoint(path: Path, ema: bool = False):
    """The model of a training checkpoint, with its trained or (``ema``) EMA weights."""
    from mimir_megatron.config import model_config_from_record
    from mimir_megatron.model import build_model
    from mimir_megatron.train.optim import EMA

    state = read_trainer_state(path)
    if ema and state["config"]["optim"]["ema_decay"] == 0:
        raise UserError(f"{path} was trained without an EMA (optim.ema_decay = 0)")
    # The recorded shape; kernels and layer implementation are this machine's choice (defaults).
    cfg = model_config_from_record(state["model"])
    model = build_model(cfg)
    averaged = EMA(model, decay=0.0) if ema else None
    load_checkpoint(path, model, None, averaged)
    if averaged is not None:
        averaged.copy_to(model)
    return model

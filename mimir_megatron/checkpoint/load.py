"""Reading checkpoints: the training state into a built model (resume, ``init_from``), and a model
on its own (export, generate, serve, evaluation, audits).

Every load verifies the checkpoint's files against the digests its writer recorded
(:mod:`.digests`) before a tensor is read; :func:`load_model` hashes them while it builds the
model. A damaged checkpoint is one :class:`~.digests.CheckpointDamaged` line naming the file.

Trust: dist_checkpointing reads its metadata (``.metadata``, ``common.pt``) through torch's
checkpoint reader, which unpickles it, so loading a checkpoint can run code from whoever wrote it.
Load only your own checkpoints; third-party weights go through ``mimir import`` (safetensors).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from safetensors.torch import load_file

from mimir_megatron import backend
from mimir_megatron.errors import UserError
from mimir_megatron.parallel import gather_lines

from .compat import check_compatible, check_format
from .digests import CheckpointDamaged, Verification, start_verification
from .layout import resolve, rng_file
from .state import is_row_sharded, restore_optimizer, restore_row_sharded, set_rng_state, sharded_state
from .trainer_state import TrainerState


def start_collective_verification(path: Path) -> Verification:
    """This rank's share of the verification of ``path`` (every rank hashes a part of the files),
    started in the background; :func:`verify_collectively` gathers the verdict."""
    return start_verification(path, rank=dist.get_rank(), world=dist.get_world_size())


def verify_collectively(path: Path, verification: Verification | None = None) -> TrainerState:
    """The trainer state of ``path`` once all ranks agree that every file verifies (``verification``:
    one this rank started earlier); else one :class:`CheckpointDamaged` line, the same on every
    rank. Collective."""
    verification = verification or start_collective_verification(path)
    problems = gather_lines(verification.problems())
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise CheckpointDamaged(problems[0] + more)
    assert verification.state is not None
    return verification.state


def _read(path: Path, sharded: dict) -> dict:
    """dist_checkpointing's load, its failures one line naming the checkpoint (a checkpoint written
    before digests were recorded is not verified, and may be damaged)."""
    try:
        return dist_checkpointing.load(sharded, str(path))
    except Exception as exc:  # noqa: BLE001 - torch's reader raises anything from EOFError to pickle's
        detail = str(exc).splitlines()[0] if str(exc) else "no detail"
        raise UserError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {detail}); "
                        "it may be damaged") from exc


def load_checkpoint(path: Path, model, optimizer, ema, *, restore_rng: bool = True,
                    verified: TrainerState | None = None, optimizer_state: bool = True) -> TrainerState:
    """Load model (and optimizer, EMA when given) from the checkpoint ``path`` into a built model;
    returns the trainer state. ``restore_rng`` (a resume) also sets this rank's saved RNG state.
    The files are verified first (collectively) unless ``verified`` is the state a verification
    of ``path`` already returned. ``optimizer_state=False`` leaves the optimizer's moments as
    they are (a distributed optimizer still takes the weights into its fp32 main copy)."""
    trainer_state = verified if verified is not None else verify_collectively(path)
    check_compatible(trainer_state, model.cfg, path)
    shadow = ema.shadow if ema is not None else None
    if is_row_sharded(optimizer):
        moments = optimizer if optimizer_state else None
        # The read may consume its request: a second one names where each part goes.
        requested = sharded_state(model, moments, shadow, main_params=optimizer)
        loaded = _read(path, sharded_state(model, moments, shadow, main_params=optimizer))
        restore_row_sharded(model, optimizer, loaded, requested,
                            trainer_state.optimizer_group_steps if optimizer_state else None, shadow)
    else:
        optimizer = optimizer if optimizer_state else None
        loaded = _read(path, sharded_state(model, optimizer, shadow))
        model.load_state_dict(loaded["model"], strict=False)
        if optimizer is not None:
            restore_optimizer(model, optimizer, loaded["optimizer"], trainer_state.optimizer_group_steps)
        if ema is not None:
            with torch.no_grad():
                for name, tensor in loaded["ema"].items():
                    ema.shadow[name].copy_(tensor)
    saved_rng = rng_file(path, dist.get_rank())
    if restore_rng and saved_rng.is_file():
        try:
            set_rng_state(load_file(str(saved_rng)))
        except Exception as exc:  # noqa: BLE001 - safetensors' errors name no file
            raise UserError(f"checkpoint {path}: cannot read {saved_rng.name} ({exc})") from exc
    return trainer_state


def execution_overrides(tensor_parallel_size: int = 1) -> list[str]:
    """The parallel layout a loaded model takes from this machine, as config overrides.

    Kernels and layer implementation are this machine's defaults (a recorded shape carries
    none); a loaded model is used for decoding, scoring or export, so the sequence is never
    split across TP ranks.
    """
    return [f"parallel.tensor_parallel_size={tensor_parallel_size}", "parallel.sequence_parallel=false"]


def load_model(path: str | Path, *, ema: bool = False, tensor_parallel_size: int = 1,
               state: TrainerState | None = None):
    """The model of a training checkpoint (``step_N``, or through ``latest`` a run's checkpoints
    directory or the run directory) with its trained or (``ema``) EMA weights, for this process's
    TP rank. ``state``: the checkpoint's trainer state, already read (the model value's record:
    its files are verified against it, it is not read again).

    Only the model is read: the process's RNG state is left as it was (building a model seeds
    torch's generator; that is undone here).
    """
    from mimir_megatron.config import model_config_from_record
    from mimir_megatron.model import build_model

    path = resolve(path)
    verification = start_verification(path, state=state)  # hashed by threads while the model is built
    if verification.state is None:
        verification.check()  # the state itself is unreadable: nothing to build
    state = verification.state
    check_format(state, path)
    if ema and not state.has_ema:
        raise UserError(f"{path} was trained without an EMA (optim.ema_decay = 0)")
    cfg = model_config_from_record(state.model, execution_overrides(tensor_parallel_size))
    devices = list(range(torch.cuda.device_count())) if backend.has_gpu() else []
    with torch.random.fork_rng(devices=devices):
        model = build_model(cfg)
    check_compatible(state, cfg, path)
    verification.check()
    shadow = {n: p.detach().float().clone() for n, p in model.named_parameters()} if ema else None
    loaded = _read(path, sharded_state(model, None, shadow))
    model.load_state_dict(loaded["model"], strict=False)
    if shadow is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(loaded["ema"][name])
    return model

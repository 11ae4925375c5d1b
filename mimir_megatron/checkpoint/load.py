"""Reading checkpoints: the training state into a built model (resume, ``init_from``), and a model
on its own (export, generate, serve, evaluation, audits).

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

from .compat import check_compatible, check_format
from .layout import resolve, rng_file
from .state import restore_optimizer, set_rng_state, sharded_state
from .trainer_state import TrainerState, read_trainer_state


def load_checkpoint(path: Path, model, optimizer, ema, *, restore_rng: bool = True) -> TrainerState:
    """Load model (and optimizer, EMA when given) from the checkpoint ``path`` into a built model;
    returns the trainer state. ``restore_rng`` (a resume) also sets this rank's saved RNG state."""
    trainer_state = read_trainer_state(path)
    check_compatible(trainer_state, model.cfg, path)
    sharded = sharded_state(model, optimizer, ema.shadow if ema is not None else None)
    loaded = dist_checkpointing.load(sharded, str(path))
    model.load_state_dict(loaded["model"], strict=False)
    if optimizer is not None:
        restore_optimizer(model, optimizer, loaded["optimizer"], trainer_state.optimizer_group_steps)
    if ema is not None:
        with torch.no_grad():
            for name, tensor in loaded["ema"].items():
                ema.shadow[name].copy_(tensor)
    saved_rng = rng_file(path, dist.get_rank())
    if restore_rng and saved_rng.is_file():
        set_rng_state(load_file(str(saved_rng)))
    return trainer_state


def execution_overrides(tensor_parallel_size: int = 1) -> list[str]:
    """The parallel layout a loaded model takes from this machine, as config overrides.

    Kernels and layer implementation are this machine's defaults (a recorded shape carries
    none); a loaded model is used for decoding, scoring or export, so the sequence is never
    split across TP ranks.
    """
    return [f"parallel.tensor_parallel_size={tensor_parallel_size}", "parallel.sequence_parallel=false"]


def load_model(path: str | Path, *, ema: bool = False, tensor_parallel_size: int = 1):
    """The model of a training checkpoint (``step_N``, or through ``latest`` a run's checkpoints
    directory or the run directory) with its trained or (``ema``) EMA weights, for this process's
    TP rank.

    Only the model is read: the process's RNG state is left as it was (building a model seeds
    torch's generator; that is undone here).
    """
    from mimir_megatron.config import model_config_from_record
    from mimir_megatron.model import build_model

    path = resolve(path)
    state = read_trainer_state(path)
    check_format(state, path)
    if ema and not state.has_ema:
        raise UserError(f"{path} was trained without an EMA (optim.ema_decay = 0)")
    cfg = model_config_from_record(state.model, execution_overrides(tensor_parallel_size))
    devices = list(range(torch.cuda.device_count())) if backend.has_gpu() else []
    with torch.random.fork_rng(devices=devices):
        model = build_model(cfg)
    check_compatible(state, cfg, path)
    shadow = {n: p.detach().float().clone() for n, p in model.named_parameters()} if ema else None
    loaded = dist_checkpointing.load(sharded_state(model, None, shadow), str(path))
    model.load_state_dict(loaded["model"], strict=False)
    if shadow is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(loaded["ema"][name])
    return model

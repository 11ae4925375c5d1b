"""Training checkpoints with megatron-core dist_checkpointing.

Layout of ``<checkpoint dir>``::

    step_0000200/            one checkpoint, visible only once complete
        (dist_checkpointing files: model, optimizer moments, EMA; resharding-capable)
        trainer_state.json   step, consumed samples, window, group steps, data fingerprint,
                             model shape, MLflow run id
        rng_rank<r>.safetensors  each rank's RNG state
    latest                   name of the newest complete checkpoint (replaced atomically)

A checkpoint is written under ``step_N.tmp`` and renamed when every rank has finished; ``latest``
is replaced with ``os.replace``. Only the last ``keep`` checkpoints stay. Everything is read back
without unpickling Python objects of ours: JSON, safetensors, and dist_checkpointing's tensors.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from safetensors.torch import load_file, save_file

from mimir_megatron import backend
from mimir_megatron.config import EXECUTION_FIELDS, ModelConfig
from mimir_megatron.errors import UserError
from mimir_megatron.model.sharded import ema_sharded_state, model_sharded_state

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
FORMAT = 1
"""Layout version of the sharded state; bumped whenever its keys change."""
LATEST = "latest"
# Model fields that may change between save and resume (layout and schedule, not shape).
_LAYOUT_FIELDS = {"tensor_parallel_size", "sequence_parallel", "bp_window", "window_policy",
                  "tokenizer", "seed", "h_cycles", "l_cycles", "max_position_embeddings"} | set(
    EXECUTION_FIELDS)


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def latest_checkpoint(checkpoint_dir: Path) -> Path | None:
    pointer = checkpoint_dir / LATEST
    if not pointer.is_file():
        return None
    path = checkpoint_dir / pointer.read_text().strip()
    return path if (path / STATE_FILE).is_file() else None


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


def save_checkpoint(checkpoint_dir: Path, step: int, model, optimizer, ema,
                    trainer_state: dict[str, Any], keep: int) -> Path:
    """Write a complete checkpoint for ``step``; collective over all ranks."""
    rank = dist.get_rank()
    final = checkpoint_dir / step_dir_name(step)
    tmp = checkpoint_dir / (step_dir_name(step) + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model, optimizer, ema), str(tmp))
    save_file(_rng_state(), str(tmp / f"rng_rank{rank}.safetensors"))
    dist.barrier()
    if rank == 0:
        state_text = json.dumps({**trainer_state, "format": FORMAT}, indent=2, sort_keys=True)
        (tmp / STATE_FILE).write_text(state_text)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        pointer = checkpoint_dir / (LATEST + ".tmp")
        pointer.write_text(final.name + "\n")
        os.replace(pointer, checkpoint_dir / LATEST)
        _prune(checkpoint_dir, keep)
    dist.barrier()
    return final


def _prune(checkpoint_dir: Path, keep: int) -> None:
    complete = sorted(p for p in checkpoint_dir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in complete[:-keep]:
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
    current = asdict(cfg)
    diffs = [
        f"{key}: checkpoint {value!r}, config {current.get(key)!r}"
        for key, value in saved["model"].items()
        if key not in _LAYOUT_FIELDS and current.get(key) != value
    ]
    if saved.get("padded_vocab_size") != cfg.padded_vocab_size and not diffs:
        diffs.append(
            f"padded vocabulary: checkpoint {saved.get('padded_vocab_size')}, this TP layout "
            f"{cfg.padded_vocab_size} (set model.make_vocab_size_divisible_by so both agree)"
        )
    if diffs:
        raise UserError(f"checkpoint {path} holds a model of another shape:\n  - " + "\n  - ".join(diffs))


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
    from mimir_megatron.config import model_config_from_dict
    from mimir_megatron.model import build_model
    from mimir_megatron.train.optim import EMA

    state = read_trainer_state(path)
    if ema and state["config"]["optim"]["ema_decay"] == 0:
        raise UserError(f"{path} was trained without an EMA (optim.ema_decay = 0)")
    # Kernels and layer implementation are this machine's choice, not the checkpoint's.
    defaults = ModelConfig().to_dict()
    execution = {name: defaults[name] for name in EXECUTION_FIELDS}
    cfg = model_config_from_dict({**state["model"], **execution, "tensor_parallel_size": 1})
    model = build_model(cfg)
    averaged = EMA(model, decay=0.0) if ema else None
    load_checkpoint(path, model, None, averaged)
    if averaged is not None:
        averaged.copy_to(model)
    return model

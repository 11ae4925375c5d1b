"""What a checkpoint holds, as tensors: the sharded model/optimizer/EMA state and each rank's RNG.

The optimizer is any torch optimizer, or ZeRO-1's wrapper (its local shard is read through
:func:`mimir_megatron.parallel.local_optimizer`); the EMA is anything with a ``shadow`` dict of
fp32 tensors keyed by parameter name.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

from mimir_megatron import backend
from mimir_megatron.model.sharded import ema_sharded_state, model_sharded_state
from mimir_megatron.parallel import local_optimizer, owned_parameters


def sharded_state(model, optimizer, ema_shadow: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """Model, optimizer moments and EMA as sharded tensors keyed by parameter name.

    Optimizer moments are stored per parameter (``optimizer.<moment>.<param key>``), sharded like
    the parameter. With ZeRO-1 each rank holds, and writes as the main replica, only the
    parameters it owns; a checkpoint therefore reloads under any data-parallel size.
    """
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
    if ema_shadow is not None:
        state["ema"] = ema_sharded_state(model, model_sd, ema_shadow)
    return state


def restore_optimizer(model, optimizer, loaded: dict[str, Any], group_steps: dict[str, int]) -> None:
    """Copy loaded moments into this rank's optimizer state; Adam's per-parameter step is equal
    within a group and kept per group name."""
    local = local_optimizer(optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    group_of_param = {id(p): g["name"] for g in local.param_groups for p in g["params"]}
    with torch.no_grad():
        for param in owned_parameters(optimizer):
            slot = local.state[param]
            for moment in ("exp_avg", "exp_avg_sq"):
                slot[moment].copy_(loaded[names[id(param)]][moment])
            slot["step"] = torch.tensor(float(group_steps[group_of_param[id(param)]]))


def optimizer_group_steps(optimizer, group=None) -> dict[str, int]:
    """Adam steps per group; with ZeRO-1 a group's owner may be another data-parallel rank."""
    local = local_optimizer(optimizer)
    names = [g["name"] for g in optimizer.param_groups]
    steps = torch.full((len(names),), -1.0)
    for g in local.param_groups:
        if g["params"]:
            steps[names.index(g["name"])] = local.state[g["params"][0]]["step"].item()
    if local is not optimizer:
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)
    return {name: int(value) for name, value in zip(names, steps.tolist())}


# -- RNG state (one file per rank) ------------------------------------------------------------------


def rng_state() -> dict[str, torch.Tensor]:
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


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = json.loads(bytes(state["numpy"].tolist()).decode())
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss = json.loads(bytes(state["python"].tolist()).decode())
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and backend.has_gpu():
        torch.cuda.set_rng_state(state["cuda"])

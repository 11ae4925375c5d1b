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
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

from mimir_megatron import backend
from mimir_megatron.model.sharded import ema_sharded_state, model_sharded_state
from mimir_megatron.parallel import local_optimizer, owned_parameters


def sharded_state(model, optimizer, ema_shadow: dict[str, torch.Tensor] | None, *,
                  main_params=None) -> dict[str, Any]:
    """Model, optimizer moments and EMA as sharded tensors keyed by parameter name.

    Optimizer moments are stored per parameter (``optimizer.<moment>.<param key>``), sharded like
    the parameter. With ZeRO-1 each rank holds, and writes as the main replica, only the
    parameters it owns; a checkpoint therefore reloads under any data-parallel size.

    ``main_params``: the trainer's distributed optimizer (train/dist_optim.py), whose fp32 main
    weights are what the checkpoint stores as the model's weights (bf16 parameters would lose
    their low bits), each rank its rows, with its rows of the moments (``optimizer``: the same
    object, or None to leave them out) and of the EMA. The keys and dtypes are those of every
    other checkpoint: only which rank holds which part differs, so any layout reloads any other.
    """
    if main_params is not None:
        return _row_sharded_state(model, main_params, optimizer is not None, ema_shadow)
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


def _pieces(entry, param: torch.Tensor) -> list[tuple[ShardedTensor, int]]:
    """A parameter's sharded tensors and the first local row each covers: the tensor itself, or
    what a factory (SwiGLU's fc1: its two halves, each stored under the halves' layout) builds
    from the parameter's rows."""
    if isinstance(entry, ShardedTensor):
        return [(entry, 0)]
    built = entry.build()
    row_bytes = param[0].numel() * param.element_size()
    return [(st, (st.data.data_ptr() - param.data_ptr()) // row_bytes)
            for st in (built if isinstance(built, list) else [built])]


def _rows_of(pieces: list[tuple[ShardedTensor, int]], data: torch.Tensor, rows: slice,
             prefix: str = "") -> list[ShardedTensor]:
    """``data`` (a tensor of this rank's ``rows`` of a parameter) as the parts of the parameter's
    sharded tensors (``pieces``) that those rows cover. Rows need not divide evenly, so the grid
    is irregular (torch DCP reads and reshards it); every rank holds distinct rows, so each is
    the main replica of its own."""
    out = []
    for st, first in pieces:
        start, stop = max(rows.start, first), min(rows.stop, first + st.local_shape[0])
        if start >= stop:
            continue
        # The stacked layers' axis is made a real one of size 1 (DCP's irregular grid does not
        # know megatron's prepended axes).
        part = data[start - rows.start: stop - rows.start].reshape((1,) * st.prepend_axis_num
                                                                  + (stop - start,) + tuple(data.shape[1:]))
        offset = list(st.global_offset)
        offset[st.prepend_axis_num] += start - first
        out.append(replace(st, key=prefix + st.key, data=part, dtype=part.dtype,
                           local_shape=tuple(part.shape), global_offset=tuple(offset),
                           axis_fragmentations=None, replica_id=0, prepend_axis_num=0))
    return out


def _row_sharded_state(model, optimizer, with_moments: bool,
                       ema_shadow: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    model_sd = model_sharded_state(model)
    key_of = _param_keys(model, model_sd)
    model_part = dict(model_sd)
    moments, ema = {}, {}
    for shard in optimizer.all_shards():
        key = key_of[id(shard.param)]
        pieces = _pieces(model_sd[key], shard.param.data)
        model_part[key] = _rows_of(pieces, shard.main, shard.rows)
        if with_moments:
            slot = optimizer.state[shard.main]
            moments[shard.name] = {m: _rows_of(pieces, slot[m], shard.rows, f"optimizer.{m}.")
                                   for m in ("exp_avg", "exp_avg_sq")}
        if ema_shadow is not None:
            ema[shard.name] = _rows_of(pieces, ema_shadow[shard.name], shard.rows, "ema.")
    state: dict[str, Any] = {"model": model_part}
    if with_moments:
        state["optimizer"] = moments
    if ema_shadow is not None:
        state["ema"] = ema
    return state


def _copy_parts(target: torch.Tensor, parts: list, template: list[ShardedTensor]) -> None:
    """Loaded parts (the same order as :func:`_rows_of` made them) into ``target``'s rows."""
    row = target[0].numel()
    for loaded, st in zip(parts, template):
        start = (st.data.data_ptr() - target.data_ptr()) // (row * target.element_size())
        target[start: start + st.data.numel() // row].copy_(loaded.reshape(-1, *target.shape[1:]))


def restore_row_sharded(model, optimizer, loaded: dict[str, Any], requested: dict[str, Any],
                        group_steps: dict[str, int] | None,
                        ema_shadow: dict[str, torch.Tensor] | None) -> None:
    """A checkpoint read with :func:`sharded_state` (``main_params``; ``requested`` is what was
    asked for) into the distributed optimizer: main weights (then the parameters from them,
    gathered), moments and Adam's step (``group_steps``; None: the optimizer state is not
    restored), EMA."""
    key_of = _param_keys(model, model_sharded_state(model))
    main_keys = set()
    with torch.no_grad():
        for shard in optimizer.all_shards():
            key = key_of[id(shard.param)]
            main_keys.add(key)
            _copy_parts(shard.main, loaded["model"][key], requested["model"][key])
            if group_steps is not None:
                slot = optimizer.state[shard.main]
                for m in ("exp_avg", "exp_avg_sq"):
                    _copy_parts(slot[m], loaded["optimizer"][shard.name][m],
                                requested["optimizer"][shard.name][m])
            if ema_shadow is not None:
                _copy_parts(ema_shadow[shard.name], loaded["ema"][shard.name], requested["ema"][shard.name])
        if group_steps is not None:
            for group in optimizer.param_groups:
                for main in group["params"]:
                    optimizer.state[main]["step"] = torch.tensor(float(group_steps[group["name"]]))
    model.load_state_dict({k: v for k, v in loaded["model"].items() if k not in main_keys}, strict=False)
    for shards in optimizer.shards.values():
        optimizer.write_back(shards)


def _param_keys(model, model_sd: dict[str, Any]) -> dict[int, str]:
    """Each parameter's key in the model's sharded state dict, by the parameter's id."""
    params = {id(p) for p in model.parameters()}
    return {id(t.data): k for k, t in model_sd.items() if hasattr(t, "data") and id(t.data) in params}


def is_row_sharded(optimizer) -> bool:
    """Whether ``optimizer`` keeps fp32 main weights by rows (train/dist_optim.py's layout)."""
    return hasattr(optimizer, "all_shards")


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

"""Full (TP-independent) weights <-> this rank's shards.

The full state uses megatron's parameter names with unsplit tensors and the vocabulary unpadded,
so it is the same for every tensor-parallel size: the common ground for exports, imports and
comparing TP layouts. Two layouts need care when (un)splitting:

- vocab-parallel embedding and head rows carry TP-dependent padding beyond ``vocab_size``;
- the SwiGLU ``linear_fc1`` stores ``[gate_r; up_r]`` per rank, so the full tensor is
  ``[gate; up]``, not the concatenation of rank shards.

``linear_qkv`` needs no care: with one query group per head, each rank holds whole heads'
``[q, gate, k, v]`` row blocks, in order.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from mimir_megatron import parallel
from mimir_megatron.errors import UserError

_VOCAB_PARALLEL = ("embedding.weight", "head.weight")
BUFFERS = ("z_L_init",)


def _is_swiglu_fc1(name: str) -> bool:
    return name.endswith("mlp.linear_fc1.weight")


def _partition_dim(param: torch.nn.Parameter) -> int | None:
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim)
    return None


def _all_gather(local: torch.Tensor, dim: int) -> torch.Tensor:
    size = parallel.tp_size()
    if size == 1:
        return local.clone()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=parallel.tp_group())
    return torch.cat(parts, dim=dim)


def gather_full_state(
    model: torch.nn.Module, value: Callable[[torch.nn.Parameter], torch.Tensor | None] = None
) -> dict[str, torch.Tensor]:
    """Full tensors of every parameter (and the fixed buffers), on every TP rank.

    ``value`` picks what to gather (default: the weights; e.g. ``lambda p: p.grad`` for
    gradients, with zeros where a parameter has no grad). All TP ranks must call this together.
    """
    value = value or (lambda p: p.detach())
    vocab = model.cfg.vocab_size
    full: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        local = value(param)
        local = torch.zeros_like(param) if local is None else local.detach()
        dim = _partition_dim(param)
        if dim is None:
            tensor = local.clone()
        elif _is_swiglu_fc1(name):
            gate, up = local.chunk(2, dim=0)
            tensor = torch.cat([_all_gather(gate, 0), _all_gather(up, 0)], dim=0)
        else:
            tensor = _all_gather(local, dim)
        if name in _VOCAB_PARALLEL:
            tensor = tensor[:vocab]
        full[name] = tensor.cpu()
    for name in BUFFERS:
        full[name] = getattr(model, name).detach().cpu().clone()
    return full


def expected_full_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Shapes :func:`gather_full_state` produces for this model's config, without communication."""
    cfg = model.cfg
    tp = cfg.parallel.tensor_parallel_size
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        shape = list(param.shape)
        dim = _partition_dim(param)
        if dim is not None:
            shape[dim] *= tp
        if name in _VOCAB_PARALLEL:
            shape[0] = cfg.vocab_size
        shapes[name] = tuple(shape)
    for name in BUFFERS:
        shapes[name] = tuple(getattr(model, name).shape)
    return shapes


def check_full_state(model: torch.nn.Module, full: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights of another shape, listing every missing, unexpected or mis-shaped tensor."""
    expected = expected_full_shapes(model)
    problems = [f"missing {n} {tuple(s)}" for n, s in expected.items() if n not in full]
    problems += [f"unexpected {n}" for n in full if n not in expected]
    problems += [
        f"{n}: shape {tuple(full[n].shape)}, model expects {expected[n]}"
        for n in expected
        if n in full and tuple(full[n].shape) != expected[n]
    ]
    if problems:
        raise UserError(
            f"{source} does not fit this model ({len(problems)} problem(s)):\n  - "
            + "\n  - ".join(problems[:20])
            + ("\n  - ..." if len(problems) > 20 else "")
        )


def load_full_state(model: torch.nn.Module, full: dict[str, torch.Tensor], source: str = "weights") -> None:
    """Copy this rank's slice of full tensors into the model (inverse of gather_full_state)."""
    check_full_state(model, full, source)
    rank, size = parallel.tp_rank(), parallel.tp_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = full[name].to(param.dtype)
            if name in _VOCAB_PARALLEL:
                padding = param.shape[0] * size - tensor.shape[0]
                tensor = torch.cat([tensor, tensor.new_zeros(padding, *tensor.shape[1:])])
            dim = _partition_dim(param)
            if dim is not None and _is_swiglu_fc1(name):
                gate, up = tensor.chunk(2, dim=0)
                tensor = torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
            elif dim is not None:
                tensor = tensor.chunk(size, dim=dim)[rank]
            if isinstance(param, DTensor):  # a fully sharded (FSDP2) weight: this rank's rows of it
                tensor = distribute_tensor(tensor, param.device_mesh, param.placements)
            param.copy_(tensor)
        for name in BUFFERS:
            getattr(model, name).copy_(full[name])

"""Full sharding (``optim.fully_shard``): torch FSDP2 over the data-parallel group.

Parameters, gradients and optimizer state are all sharded (ZeRO-3), where the distributed
optimizer (train/dist_optim.py) shards only the fp32 main weights and Adam's state:

- Units: every layer of the L and H stacks, the embedding, and the root (the head and the fixed
  ``z_L_init``). A unit's weights are all-gathered in the compute dtype before each of its
  applications and freed after it (L runs six times a step on LLLHLLLH: six gathers), again
  before each backward through it, and its gradient is reduce-scattered in fp32 after it and
  summed into the unit's fp32 gradient shard. The root is gathered for the whole step.
- Each data-parallel rank keeps the rows ``torch.chunk`` gives it of every weight (``ceil(rows /
  DP)``, the last rank fewer): fp32, and those rows are the main weights themselves (the
  optimizer updates them in place; the next gather reads them), with Adam's two moments and the
  EMA for the same rows. 16 / DP bytes a weight, plus 4 / DP of gradient.
- Compute dtype: ``model.params_dtype``. bf16 is Megatron's mixed precision as the distributed
  optimizer runs it (bf16 weights rounded from the fp32 main copy, bf16 forward and backward,
  gradients reduced and accumulated in fp32); float32 computes in fp32 (with bf16 autocast on a
  GPU under ``train.precision: auto``).
- Gradients are summed over the group, not averaged: the loss is already divided by the global
  supervised-token count (``calculate_per_token_loss``), as megatron DDP's reduction assumes.

The trainer drives it through the slots megatron DDP fills otherwise (:class:`FullyShardedModel`:
``zero_grad_buffer``, the forward, ``finish_grad_sync`` leaving each weight's ``main_grad``: its
local fp32 gradient rows) and the interface of the distributed optimizer
(:class:`FullyShardedOptimizer`: row shards, so checkpoints, the EMA and layout changes on resume
are those of the distributed optimizer: any layout resumes any other).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mimir_megatron.train.dist_optim import RowShard, RowShardedOptimizer
from mimir_megatron.train.schedules import StepPlan


def shard_rows(rows: int, dp_rank: int, dp_size: int) -> slice:
    """Rank ``dp_rank``'s rows of a weight of ``rows`` rows under FSDP2 (``torch.chunk``)."""
    chunk = math.ceil(rows / dp_size)
    return slice(min(dp_rank * chunk, rows), min((dp_rank + 1) * chunk, rows))


def units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 gathers one at a time: every layer of L and H, the embedding; the root
    (the model itself: the head and the buffers) is sharded after them."""
    return [*model.L.layers, *model.H.layers, model.embedding]


def fully_shard_model(model: torch.nn.Module, dp_group, compute_dtype: torch.dtype, device_type: str
                      ) -> list[torch.nn.Module]:
    """Apply FSDP2 to ``model`` in place (its parameters become fp32 DTensor shards); returns the
    FSDP modules, the root last."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.no_grad():
        for param in model.parameters():  # the shards are the fp32 main weights
            param.data = param.data.float()
    # FSDP2 replaces each parameter by a new one: megatron's attributes on them (tensor-parallel
    # axis, ...) are carried over by name (pytorch issue 136929, as megatron-core's FSDP2 wrapper).
    attributes = {name: dict(vars(p)) for name, p in model.named_parameters()}
    mesh = DeviceMesh.from_group(dp_group, device_type)
    policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                  reduce_dtype=torch.float32)
    sharded = [fully_shard(unit, mesh=mesh, mp_policy=policy) for unit in units(model)]
    sharded.append(fully_shard(model, mesh=mesh, mp_policy=policy))
    for name, param in model.named_parameters():
        for key, value in attributes[name].items():
            setattr(param, key, value)
    for module in sharded:
        # A plain SUM, no division (the loss is divided by the global count): gloo has no
        # pre-multiplied sum, and a division by 1 is skipped.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return sharded


class FullyShardedModel:
    """The trainer's ``ddp`` slot for an FSDP2 model: gradients reduce-scattered during the
    backward (fp32, summed over the group) into each weight's sharded ``grad``;
    :meth:`finish_grad_sync` exposes this rank's rows as ``param.main_grad`` (what the gradient
    norm, clipping and the optimizer read, as they read megatron DDP's buffers)."""

    def __init__(self, model: torch.nn.Module, dp_group, units: list[torch.nn.Module]):
        self.module = model
        self.dp_group = dp_group
        self.units = units
        """The FSDP modules, the root last."""
        self.params = [p for p in model.parameters() if p.requires_grad]

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every weight whole on every rank (in the compute dtype) inside the block: decoding
        (the trainer's evaluation) reads weights directly and calls parts of the model, outside
        the forward that gathers them. Collective."""
        layers = self.units[:-1]
        for unit in layers:
            unit.set_reshard_after_forward(False, recurse=False)
        for unit in self.units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.units:
                unit.reshard()
            for unit in layers:
                unit.set_reshard_after_forward(True, recurse=False)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self) -> None:
        for param in self.params:
            param.grad = None
            param.main_grad = None

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        for param in self.params:
            local = param.to_local()
            # A weight outside this step's window has no gradient: zeros, as in DDP's buffer.
            param.main_grad = param.grad.to_local() if param.grad is not None else torch.zeros_like(local)


class FullyShardedOptimizer(RowShardedOptimizer):
    """A torch optimizer over this rank's fp32 rows of every weight (FSDP2's shards, updated in
    place), with the distributed optimizer's interface (train/dist_optim.py): ``shards`` by
    group, ``all_shards``, ``optim``, ``step(plan)``; param group names as train/optim.py's."""

    def _main_rows(self, name: str, param: torch.nn.Parameter) -> tuple[slice, torch.Tensor]:
        main = param.to_local()  # FSDP2's storage: updated in place
        rows = shard_rows(param.shape[0], self.dp_rank, self.dp_size)
        assert main.shape[0] == rows.stop - rows.start, (name, main.shape, rows)
        return rows, main

    def _grad_rows(self, shard: RowShard) -> torch.Tensor:
        return shard.param.main_grad

    def _after_update(self, plan: StepPlan) -> None:
        """Nothing: the next forward gathers the updated rows."""

    def write_back(self, shards: list[RowShard]) -> None:
        """Nothing to do: the rows are the parameters' own storage (a checkpoint load wrote them)."""

    def main_from_params(self) -> None:
        """Nothing to do: the main weights are the parameters' shards."""


def wrap_fully_sharded(model: torch.nn.Module, dp_group, device: torch.device) -> FullyShardedModel:
    """``model`` sharded in place over ``dp_group`` (compute in its ``params_dtype``) and the
    trainer's handle on it."""
    units = fully_shard_model(model, dp_group, model.config.params_dtype, device.type)
    return FullyShardedModel(model, dp_group, units)

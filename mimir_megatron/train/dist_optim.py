"""Megatron's mixed precision with an evenly sharded optimizer (``optim.distributed_optimizer``).

The layout of megatron-core's DistributedOptimizer, built on tensors that run on CPU (gloo) as on
GPU (NCCL): megatron-core's own class needs CUDA buffers and streams.

- The model's parameters are in ``model.params_dtype`` (bf16 on a GPU run: the weights the
  forward and backward read, no autocast weight cache); megatron DDP accumulates their
  gradients in an fp32 buffer (``param.main_grad``).
- Every weight is cut by rows into DP nearly equal slices (rows ``r * n // DP`` to
  ``(r + 1) * n // DP``: even to within one row of each tensor, exactly even for the Mimir
  shapes). Data-parallel rank ``r`` keeps, for its rows only, the fp32 main weights, Adam's two
  moments and the EMA: 16 / DP bytes a weight, where ZeRO-1 by whole tensors gives one rank a
  whole embedding's state.
- The gradients are reduce-scattered, not all-reduced (megatron's DistributedOptimizer does the
  same over its buffer's even slices): after backward each weight's fp32 gradient is summed over
  the data-parallel group into the rows of the rank that keeps them, (DP-1)/DP of the buffer
  sent where an all-reduce sends twice that. The other rows of a rank's buffer keep its own
  unreduced gradient and are never read: the gradient norm sums each rank's rows' squares over
  the group, clipping scales the rows.
- An update: each rank steps its rows' main weights from its rows of the fp32 gradient, writes
  them into its rows of the parameter (rounded to bf16) and the parameters are all-gathered
  over the data-parallel group. Frozen groups (a window without that module) change nothing and
  are not gathered.

With fp32 parameters the main weights are views of the parameter's rows (no copy): the layout
is then even ZeRO-1 with a reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimir_megatron.train.schedules import GROUPS, StepPlan


@dataclass
class RowShard:
    """This data-parallel rank's rows of one weight."""

    name: str
    param: torch.nn.Parameter
    rows: slice
    main: torch.Tensor
    """fp32 main weights of ``rows``: a view of the parameter when it is fp32, else a copy."""

    @property
    def is_view(self) -> bool:
        return self.param.dtype == torch.float32


def row_range(rows: int, dp_rank: int, dp_size: int) -> slice:
    """Rank ``dp_rank``'s rows of a tensor of ``rows`` rows: even to within one row."""
    return slice(dp_rank * rows // dp_size, (dp_rank + 1) * rows // dp_size)


class RowShardedOptimizer:
    """A torch optimizer over this data-parallel rank's fp32 rows of every weight, by param group
    (names as train/optim.py's): what the distributed optimizer and FSDP2 (train/fsdp.py) share.
    A subclass says which rows a rank keeps and where their main weights live
    (:meth:`_main_rows`), where a row's gradient is (:meth:`_grad_rows`) and what follows an
    update (:meth:`_after_update`)."""

    def __init__(self, named_groups: dict[str, list[tuple[str, torch.nn.Parameter]]],
                 optimizer_class, kwargs: dict, lr: float, dp_group=None):
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.dp_rank = dist.get_rank(dp_group)
        self.shards: dict[str, list[RowShard]] = {}
        with torch.no_grad():
            for group in GROUPS:
                shards = [RowShard(name, param, *self._main_rows(name, param))
                          for name, param in named_groups.get(group, [])]
                if shards:
                    self.shards[group] = shards
        self.optim = optimizer_class(
            [{"params": [s.main for s in shards], "name": g, "lr": lr} for g, shards in self.shards.items()],
            **kwargs)

    def _main_rows(self, name: str, param: torch.nn.Parameter) -> tuple[slice, torch.Tensor]:
        raise NotImplementedError

    def _grad_rows(self, shard: RowShard) -> torch.Tensor:
        raise NotImplementedError

    def _after_update(self, plan: StepPlan) -> None:
        raise NotImplementedError

    # -- what the trainer and the checkpoints read ------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def all_shards(self) -> list[RowShard]:
        return [s for shards in self.shards.values() for s in shards]

    def model_params(self) -> list[torch.nn.Parameter]:
        return [s.param for s in self.all_shards()]

    @torch.no_grad()
    def step(self, plan: StepPlan) -> None:
        """One update of this rank's rows with ``plan``'s group learning rates (frozen groups:
        none), then :meth:`_after_update`."""
        for group in self.optim.param_groups:
            frozen = group["name"] in plan.frozen
            group["lr"] = plan.group_lr[group["name"]]
            for shard in self.shards[group["name"]]:
                shard.main.grad = None if frozen else self._grad_rows(shard)
        self.optim.step()
        for shard in self.all_shards():
            shard.main.grad = None
        self._after_update(plan)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)


class DistributedOptimizer(RowShardedOptimizer):
    """fp32 main weights and a torch optimizer's state for this data-parallel rank's rows of
    every weight; see the module docstring. ``optim`` is the torch optimizer over the row
    shards' main weights (param group names as train/optim.py's)."""

    def __init__(self, named_groups: dict[str, list[tuple[str, torch.nn.Parameter]]],
                 optimizer_class, kwargs: dict, lr: float, dp_group=None):
        super().__init__(named_groups, optimizer_class, kwargs, lr, dp_group)
        self._dp_ranks = dist.get_process_group_ranks(dp_group) if dp_group is not None else \
            list(range(self.dp_size))

    def _main_rows(self, name: str, param: torch.nn.Parameter) -> tuple[slice, torch.Tensor]:
        rows = row_range(param.shape[0], self.dp_rank, self.dp_size)
        return rows, (param.data[rows] if param.dtype == torch.float32 else param.data[rows].float())

    def _grad_rows(self, shard: RowShard) -> torch.Tensor:
        return shard.param.main_grad[shard.rows]

    def _after_update(self, plan: StepPlan) -> None:
        """The parameters gathered over the data-parallel group (frozen groups: not)."""
        for name, shards in self.shards.items():
            if name not in plan.frozen:
                self.write_back(shards)

    def grad_rows(self) -> list[torch.Tensor]:
        """This rank's rows of every weight's fp32 gradient (reduced once
        :meth:`reduce_scatter_gradients` ran), frozen groups' included."""
        return [s.param.main_grad[s.rows] for s in self.all_shards()]

    # -- the reduction and the update -------------------------------------------------------------

    @torch.no_grad()
    def reduce_scatter_gradients(self, ddp: torch.nn.Module) -> None:
        """In place of megatron DDP's all-reduce (``ddp.finish_grad_sync``): its buffers' gradient
        scaling, then every weight's gradient summed over the data-parallel group into the rows
        of the rank that keeps them (one reduce-scatter a weight, in the shards' order, the same
        on every rank)."""
        for buffer in ddp.buffers:
            if buffer.gradient_scaling_factor != 1.0:  # 1 here: the loss is per token (model/hrm.py)
                buffer.scale_gradients(buffer.gradient_scaling_factor)
        if self.dp_size == 1:
            return
        for shard in self.all_shards():
            grad = shard.param.main_grad
            rows = grad.shape[0]
            if rows % self.dp_size == 0 and grad.is_contiguous():
                # Equal slices: the output is this rank's slice of the input (in place, as
                # megatron reduce-scatters into its buffer's own slice).
                dist.reduce_scatter_tensor(grad[shard.rows], grad, group=self.dp_group)
            else:
                chunks = [grad[row_range(rows, r, self.dp_size)] for r in range(self.dp_size)]
                dist.reduce_scatter(chunks[self.dp_rank], chunks, group=self.dp_group)


    @torch.no_grad()
    def write_back(self, shards: list[RowShard]) -> None:
        """Each rank's main rows into its rows of the parameters, then every rank's rows to all."""
        for shard in shards:
            if not shard.is_view:
                shard.param.data[shard.rows].copy_(shard.main)
            self._gather(shard)

    def _gather(self, shard: RowShard) -> None:
        if self.dp_size == 1:
            return
        data = shard.param.data
        if data.shape[0] % self.dp_size == 0 and data.is_contiguous():
            # Equal slices: one all-gather into the parameter (the input is a copy: the output
            # buffer holds it too).
            dist.all_gather_into_tensor(data, data[shard.rows].clone(), group=self.dp_group)
            return
        for dp_rank, src in enumerate(self._dp_ranks):
            dist.broadcast(data[row_range(data.shape[0], dp_rank, self.dp_size)], src=src,
                           group=self.dp_group)

    @torch.no_grad()
    def main_from_params(self) -> None:
        """Main weights from the parameters (weights loaded into the model by other means)."""
        for shard in self.all_shards():
            if not shard.is_view:
                shard.main.copy_(shard.param.data[shard.rows])

class ShardedEMA:
    """fp32 EMA of the main weights, of this rank's rows only (the optimizer's shards)."""

    def __init__(self, optimizer: DistributedOptimizer, decay: float):
        self.decay = decay
        self.optimizer = optimizer
        self.reset()

    def reset(self, model: torch.nn.Module | None = None) -> None:
        """The EMA restarted at the current main weights."""
        self.shadow = {s.name: s.main.detach().clone() for s in self.optimizer.all_shards()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module | None = None) -> None:
        for shard in self.optimizer.all_shards():
            self.shadow[shard.name].lerp_(shard.main, 1 - self.decay)

    def rows(self, name: str) -> slice:
        return next(s.rows for s in self.optimizer.all_shards() if s.name == name)

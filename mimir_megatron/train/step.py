"""One optimizer step of the trainer, as a function: what `mimir train` runs and `mimir bench` times.

:func:`build_trainer` wraps a model the way the trainer does (megatron DDP with fp32 gradient
buffers, the per-module optimizer groups, the EMA); :func:`train_step` runs one step on it:
forward/backward over the micro-batches, the data-parallel reduction (all-reduce, or the
distributed optimizer's reduce-scatter), the non-finite decision,
clipping, the optimizer and the EMA.

Host synchronisation: a GPU step runs ahead of the host until the host needs a value. Every
scalar the step must decide on or report (loss, gradient norm, supervised tokens, attended keys,
the agreed stop flag) is stacked into one tensor and read with one ``tolist()``: one
synchronisation per step (plus the token-range checks of a ``validate`` step). Clipping then
uses the norm already on the host, with the same arithmetic as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimir_megatron.batch import Batch
from mimir_megatron.train.flops import attended_keys_per_token
from mimir_megatron.train.optim import (
    EMA,
    build_ema,
    build_optimizer,
    clip_,
    grad_norm,
    optimizer_step,
    param_groups,
    reduce_gradients,
)
from mimir_megatron.train.schedules import StepPlan

AfterReduction = Callable[[int, torch.Tensor, list[torch.nn.Parameter]], None]
"""``hook(step, loss_sum, params)``: called with the 1-based step number once the loss and the
gradients are reduced, before the non-finite decision (tests inject faults here)."""


@dataclass
class StepHooks:
    """Extension points of :func:`train_step`; none is needed in production."""

    after_reduction: AfterReduction | None = None


@dataclass
class Trainer:
    """What :func:`train_step` works on; built once by :func:`build_trainer`."""

    model: torch.nn.Module
    ddp: torch.nn.Module
    optimizer: torch.optim.Optimizer
    """A torch optimizer, ZeRO-1's wrapper of one, or the distributed optimizer (train/dist_optim.py)."""
    ema: EMA | None
    params: list[torch.nn.Parameter]
    device: torch.device
    dp_group: dist.ProcessGroup | None
    clip_grad: float
    autocast: Callable[[], AbstractContextManager]
    gathered: Callable[[], AbstractContextManager] = nullcontext
    """A block with every weight whole on every rank (evaluation decodes from them; FSDP2
    gathers them, otherwise nothing to do). Collective."""


@dataclass(frozen=True)
class StepOutcome:
    """The host-side values of one step (all read in its one synchronisation)."""

    loss: float
    """Mean loss over the global batch (sum over micro-batches of the all-reduced loss)."""
    grad_norm: float
    supervised: float
    """Supervised tokens of the global batch."""
    attended_keys: float
    """Mean keys attended per position on this rank (attention FLOPs)."""
    finite: bool
    """False: loss or gradient norm was not finite and the step changed nothing."""
    stop_requested: bool
    """Some rank had a stop request (pre-emption signal) when the step reduced its values."""


def build_trainer(model: torch.nn.Module, optim_cfg, *, device: torch.device, dp_group=None,
                  dp_size: int = 1, precision: str = "auto") -> Trainer:
    """Wrap ``model`` for training: megatron DDP, per-group optimizer (``optim_cfg`` is an
    :class:`~mimir_megatron.train.config.OptimSection`), EMA. Needs megatron's parallel state."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from mimir_megatron import backend

    if optim_cfg.fully_shard:  # FSDP2 in DDP's place (train/fsdp.py)
        from mimir_megatron.train.fsdp import wrap_fully_sharded

        ddp = wrap_fully_sharded(model, dp_group, device)
    else:
        ddp = DistributedDataParallel(
            model.config,
            # No overlap: L and H run several times per step, so a parameter's gradient is complete
            # only after the whole backward pass.
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                          use_distributed_optimizer=False),
            model,
        )
    optimizer = build_optimizer(model, optim_cfg, dp_group=dp_group,
                                shard=optim_cfg.shard_state and dp_size > 1)
    ema = build_ema(model, optimizer, optim_cfg.ema_decay)
    params = [p for _, named in param_groups(model).items() for _, p in named]
    bf16 = backend.has_gpu() and precision in ("auto", "bf16")

    def autocast() -> AbstractContextManager:
        return torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext()

    return Trainer(model=model, ddp=ddp, optimizer=optimizer, ema=ema, params=params, device=device,
                   dp_group=dp_group, clip_grad=optim_cfg.clip_grad, autocast=autocast,
                   gathered=getattr(ddp, "gathered", nullcontext))


def train_step(trainer: Trainer, micro_batches: Sequence[Batch], plan: StepPlan, *, step: int,
               validate: bool = False, stop_requested: Callable[[], bool] | None = None,
               hooks: StepHooks | None = None) -> StepOutcome:
    """One optimizer step over ``micro_batches`` (already on the device) with ``plan``'s window
    and learning rates; collective over all ranks. ``step`` is 0-based (the plan's).

    A non-finite loss or gradient norm (the same on every rank, as both are all-reduced) skips
    the update: no clipping, optimizer or EMA change. ``stop_requested`` is this rank's stop
    request, agreed over all ranks in the step's reduction. ``validate`` checks the batches'
    token ranges (host synchronisations: the first step of a process only).
    """
    t = trainer
    supervised = torch.stack([mb.num_supervised() for mb in micro_batches]).sum().to(t.device)
    attended = torch.stack([attended_keys_per_token(mb.segment_ids, mb.prefix_mask)
                            for mb in micro_batches]).mean()
    dist.all_reduce(supervised, group=t.dp_group)

    t.ddp.zero_grad_buffer()
    loss_sum = torch.zeros((), device=t.device)
    for mb in micro_batches:
        with t.autocast():
            out = t.ddp(mb, window=plan.window, num_supervised=supervised, return_logits=False,
                        validate=validate)
        out.loss.backward()
        loss_sum += out.loss.detach().float()
    reduce_gradients(t.ddp, t.optimizer)
    dist.all_reduce(loss_sum, group=t.dp_group)
    if hooks is not None and hooks.after_reduction is not None:
        hooks.after_reduction(step + 1, loss_sum, t.params)
    norm = grad_norm(t.params, t.optimizer)
    # A fill, not a host-to-device copy of a Python value; MAX over all ranks (TP ones too).
    stop = torch.full((), float(bool(stop_requested and stop_requested())), device=t.device)
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)

    # The step's one host synchronisation: everything decided or reported below.
    loss, norm_value, n_supervised, keys, stop_value = torch.stack(
        [loss_sum.double(), norm.double(), supervised.double(), attended.double(), stop.double()]
    ).tolist()

    finite = math.isfinite(loss) and math.isfinite(norm_value)
    if finite:
        clip_(t.params, norm_value, t.clip_grad, t.optimizer)
        optimizer_step(t.optimizer, plan)
        if t.ema is not None:
            t.ema.update(t.model)
    return StepOutcome(loss=loss, grad_norm=norm_value, supervised=n_supervised, attended_keys=keys,
                       finite=finite, stop_requested=stop_value > 0)


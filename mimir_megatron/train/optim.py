"""Per-module optimizer groups (embedding, head, L, H), Adam-atan2, gradient norm, EMA.

Group identity is the group's name, stored in each torch param group (``group["name"]``) and in
checkpoints, so a reload maps state by name, never by position. Learning rates are set per step
from :func:`mimir_megatron.train.schedules.plan_step`; a frozen group's parameters get
``grad = None`` for that step, which torch's Adam variants skip entirely (no moment update, no
weight decay).

Gradients come from megatron's DDP buffers (``param.main_grad``), reduced over the
data-parallel group by :func:`reduce_gradients` (all-reduced, or reduce-scattered to the rows
the distributed optimizer keeps). Every parameter of this model is tensor-parallel, so the
global gradient norm is the TP all-reduce of local squared norms.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from mimir_megatron import parallel
# ZeRO-1's state layout is the parallel layer's (the checkpoint package reads it too).
from mimir_megatron.parallel import local_optimizer, owned_parameters  # noqa: F401
from mimir_megatron.train.schedules import GROUPS, StepPlan


def group_of(name: str) -> str:
    """Optimizer group of a parameter name of HRMTextModel."""
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("head."):
        return "head"
    if name.startswith("L."):
        return "L"
    if name.startswith("H."):
        return "H"
    raise ValueError(f"parameter {name} belongs to no optimizer group")


def param_groups(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {g: [] for g in GROUPS}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups[group_of(name)].append((name, param))
    return groups


class AdamAtan2(torch.optim.Optimizer):
    """Adam with ``atan2`` in place of the epsilon-guarded division (the HRM-Text reference's).

    update = a * atan2(m_hat, b * sqrt(v_hat)); decoupled weight decay. Bounded by a * pi / 2 and
    scale-invariant, so it needs no epsilon.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.0, a: float = 1.27, b: float = 1.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, a=a, b=b))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    init_state(self, p)
                state = self.state[p]
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                p.add_(torch.atan2(m_hat, group["b"] * v_hat.sqrt()), alpha=-group["lr"] * group["a"])


def init_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Adam state of one parameter, created eagerly so every parameter has checkpointable state."""
    optimizer.state[param] = {
        "step": torch.zeros((), dtype=torch.float32),
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }


def build_optimizer(model: torch.nn.Module, optim_cfg, dp_group=None, shard: bool = False
                    ) -> torch.optim.Optimizer:
    """Per-group optimizer; ``shard`` spreads its state over the data-parallel group (ZeRO-1);
    ``optim_cfg.distributed_optimizer`` shards fp32 main weights and state evenly instead
    (:class:`~mimir_megatron.train.dist_optim.DistributedOptimizer`).

    Sharding uses torch's ZeroRedundancyOptimizer: each rank keeps and updates the Adam state of
    the parameters it owns, then broadcasts them. (megatron's DistributedOptimizer needs CUDA
    tensors, so it cannot run on the CPU machines where this project is tested.)
    """
    groups = param_groups(model)
    torch_groups = [
        {"params": [p for _, p in groups[g]], "name": g, "lr": optim_cfg.lr} for g in GROUPS if groups[g]
    ]
    betas = (optim_cfg.beta1, optim_cfg.beta2)
    if optim_cfg.optimizer == "adamw":
        cls, kwargs = torch.optim.AdamW, dict(betas=betas, eps=optim_cfg.eps)
    elif optim_cfg.optimizer == "adam_atan2":
        cls, kwargs = AdamAtan2, dict(betas=betas)
    else:
        raise ValueError(f"unknown optimizer {optim_cfg.optimizer!r}")
    kwargs |= dict(lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay)
    if optim_cfg.distributed_optimizer or optim_cfg.fully_shard:
        from mimir_megatron.train.dist_optim import DistributedOptimizer
        from mimir_megatron.train.fsdp import FullyShardedOptimizer

        rows = FullyShardedOptimizer if optim_cfg.fully_shard else DistributedOptimizer
        opt = rows(groups, cls, kwargs, optim_cfg.lr, dp_group=dp_group)
        for main in (p for g in opt.param_groups for p in g["params"]):
            init_state(opt.optim, main)
        return opt
    if shard:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(torch_groups, optimizer_class=cls, process_group=dp_group, **kwargs)
    else:
        opt = cls(torch_groups, **kwargs)
    local = local_optimizer(opt)
    for group in local.param_groups:
        for p in group["params"]:
            init_state(local, p)
    return opt


def keeps_rows(optimizer) -> bool:
    """The distributed optimizer or FSDP2's: fp32 main weights and state by rows of each weight."""
    from mimir_megatron.train.dist_optim import DistributedOptimizer
    from mimir_megatron.train.fsdp import FullyShardedOptimizer

    return isinstance(optimizer, (DistributedOptimizer, FullyShardedOptimizer))


def optimizer_step(optimizer: torch.optim.Optimizer, plan: StepPlan) -> None:
    """One update with this step's group learning rates; frozen groups get no gradient.

    ``param.grad`` points at the DDP buffer only during the update: left there, the next backward
    would accumulate into the buffer through ``.grad`` and DDP's hook would add it a second time.
    The distributed optimizer (train/dist_optim.py) does the same on its row shards.
    """
    if keeps_rows(optimizer):
        optimizer.step(plan)
        return
    for group in optimizer.param_groups:
        frozen = group["name"] in plan.frozen
        group["lr"] = plan.group_lr[group["name"]]
        for p in group["params"]:
            p.grad = None if frozen else p.main_grad
    optimizer.step()
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def reduce_gradients(ddp: torch.nn.Module, optimizer) -> None:
    """The data-parallel reduction of the fp32 gradient buffer after backward: megatron DDP's
    all-reduce, or the distributed optimizer's reduce-scatter into the rows each rank keeps."""
    from mimir_megatron.train.dist_optim import DistributedOptimizer

    if isinstance(optimizer, DistributedOptimizer):
        optimizer.reduce_scatter_gradients(ddp)
    else:
        ddp.finish_grad_sync()


def _reduced_grads(params: Iterable[torch.nn.Parameter], optimizer
                   ) -> tuple[list[torch.Tensor], bool, object]:
    """The reduced gradients this rank holds, whether they are split over the data-parallel
    group, and that group: the distributed optimizer's rows, FSDP2's (each ``main_grad`` is this
    rank's rows), else every gradient (not split)."""
    from mimir_megatron.train.dist_optim import DistributedOptimizer
    from mimir_megatron.train.fsdp import FullyShardedOptimizer

    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.grad_rows(), optimizer.dp_size > 1, optimizer.dp_group
    if isinstance(optimizer, FullyShardedOptimizer):
        return [p.main_grad for p in params], optimizer.dp_size > 1, optimizer.dp_group
    return [p.main_grad for p in params], False, None


def grad_norm(params: Iterable[torch.nn.Parameter], optimizer=None) -> torch.Tensor:
    """Global L2 norm of the DDP gradients (all parameters are TP-sharded: sum over TP ranks;
    with the distributed optimizer or FSDP2 each rank sums its rows' squares, then the DP group sums).

    Each gradient's squares go into one scratch buffer, sized for the largest, instead of a new
    tensor per parameter: the same products and the same sum (the same bits), without a fresh
    allocation (page faults on CPU) per parameter.
    """
    grads, split, group = _reduced_grads(params, optimizer)
    local = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    scratch = torch.empty(max(g.numel() for g in grads), dtype=torch.float32, device=local.device)
    for g in grads:
        grad = g.float()
        squares = scratch[: grad.numel()].view_as(grad)
        local += torch.pow(grad, 2, out=squares).sum()
    if split:
        dist.all_reduce(local, group=group)
    if parallel.tp_size() > 1:
        dist.all_reduce(local, group=parallel.tp_group())
    return local.sqrt()


def clip_(params: list[torch.nn.Parameter], norm: float, max_norm: float, optimizer=None) -> None:
    """Scale the DDP gradients (the distributed optimizer's rows) to ``max_norm`` when their
    global norm (a finite host value: the train step reads it once with its other scalars)
    exceeds it."""
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for grad in _reduced_grads(params, optimizer)[0]:
            grad.mul_(scale)


class EMA:
    """fp32 exponential moving average of the weights, sharded like them (local shards)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.reset(model)

    def reset(self, model: torch.nn.Module) -> None:
        """The EMA restarted at the model's current weights."""
        self.shadow = {n: p.detach().float().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            self.shadow[name].lerp_(param.detach().float(), 1 - self.decay)

    @torch.no_grad()
    def copy_to(self, model: torch.nn.Module) -> None:
        for name, param in model.named_parameters():
            param.copy_(self.shadow[name])


def build_ema(model: torch.nn.Module, optimizer, decay: float):
    """The EMA of the trainer: of the distributed optimizer's fp32 row shards, or of the weights."""
    from mimir_megatron.train.dist_optim import ShardedEMA

    if decay <= 0:
        return None
    return ShardedEMA(optimizer, decay) if keeps_rows(optimizer) else EMA(model, decay)


def weights_loaded(model: torch.nn.Module, optimizer, ema) -> None:
    """After weights were put into the model by other means than a checkpoint load (imported
    weights): the distributed optimizer's main weights follow them, and the EMA restarts there."""
    if keeps_rows(optimizer):
        optimizer.main_from_params()
    if ema is not None:
        ema.reset(model)

"""Process groups: torch.distributed and megatron's parallel state, set up once per process.

Rank, world size and master address come from torchrun's variables, or from Slurm's
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``) when torchrun's are absent. A plain
single process gets a one-rank group, so ``build_model`` works in a notebook too.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mimir_megatron import backend
from mimir_megatron.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def launch_env() -> LaunchEnv:
    """Where this process sits, from torchrun's variables, else Slurm's, else a lone process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", 0))
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_LOCALID", 0))
    else:
        rank, world, local = 0, 1, 0
    return LaunchEnv(
        rank=rank,
        world_size=world,
        local_rank=local,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
    )


def init_distributed(timeout_s: float = 1800) -> LaunchEnv:
    """Initialise torch.distributed for this process (idempotent).

    ``timeout_s``: how long a collective waits for the other ranks before it raises (the
    trainer passes ``train.collective_timeout_s``).
    """
    backend.setup()
    env = launch_env()
    if dist.is_initialized():
        return env
    if backend.has_gpu():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    if env.world_size == 1:
        # No rendezvous needed: an in-process store, no port to collide on.
        dist.init_process_group(
            backend.distributed_backend(), store=dist.HashStore(), rank=0, world_size=1,
            timeout=timeout,
        )
    else:
        dist.init_process_group(
            backend.distributed_backend(),
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
    log.debug("process group up: rank %d of %d", env.rank, env.world_size)
    return env


def gather_lines(lines: list[str]) -> list[str]:
    """Every rank's lines (problems each found in its share of a check), in rank order, without
    repeats: the same list on every rank. Collective."""
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lines)
    return list(dict.fromkeys(line for part in gathered for line in part or ()))


def init_model_parallel(tensor_parallel_size: int) -> None:
    """Set megatron's parallel state for this TP size (idempotent for the same size)."""
    from megatron.core import parallel_state

    init_distributed()
    world = dist.get_world_size()
    if world % tensor_parallel_size:
        raise UserError(
            f"tensor_parallel_size {tensor_parallel_size} does not divide the world size {world}"
        )
    if parallel_state.model_parallel_is_initialized() and _groups_outlived_their_world():
        # torch.distributed was torn down and set up again in this process (a test, a notebook):
        # megatron's groups belong to the old world, so they are built again for this one.
        parallel_state.destroy_model_parallel()
    if parallel_state.model_parallel_is_initialized():
        current = parallel_state.get_tensor_model_parallel_world_size()
        if current != tensor_parallel_size:
            raise UserError(
                f"model parallel state already initialised with TP={current}, "
                f"cannot build a TP={tensor_parallel_size} model in this process"
            )
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel_size, create_gloo_process_groups=False
    )


def _groups_outlived_their_world() -> bool:
    from megatron.core import parallel_state

    try:
        dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    except (KeyError, RuntimeError, ValueError, AssertionError):
        return True
    return False


def tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def tp_group() -> dist.ProcessGroup:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding this rank's state (the ZeRO shard's, or the optimizer itself)."""
    return getattr(optimizer, "optim", optimizer)


def owned_parameters(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """Parameters whose optimizer state lives on this rank."""
    return [p for g in local_optimizer(optimizer).param_groups for p in g["params"]]

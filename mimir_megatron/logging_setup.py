"""Logging through `logging`: rank 0 speaks, the other ranks only report warnings and errors."""

from __future__ import annotations

import logging
import os
import re
import warnings


def process_rank() -> int:
    """Global rank from the launcher's environment (torchrun or Slurm), 0 when run alone."""
    for var in ("RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def setup_logging(verbose: bool = False) -> None:
    rank = process_rank()
    level = logging.DEBUG if verbose else logging.INFO
    if rank != 0:
        level = logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # megatron-core and MLflow narrate their internals at INFO (every DDP bucket, DB migrations).
    for noisy in ("megatron", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING if not verbose else logging.DEBUG)
    # megatron 0.19 warns on every checkpoint that its (unused here) async save is deprecated.
    logging.getLogger("megatron.core.dist_checkpointing.strategies.torch").setLevel(logging.ERROR)


# Known noise, dropped by exact message: megatron's warning on every import without Transformer
# Engine and Apex (CPU machines, bare PyTorch images); torch's log line on a machine that has a
# CUDA toolkit but no GPU; and the three warnings torch's distributed checkpointing raises when
# megatron's dist_checkpointing loads a checkpoint in one process (every resume, `mimir generate`,
# `serve`, `eval`, `export`): about megatron's call (positional arguments, ShardedTensor) or a
# single-process load that is intended here. Every other warning is kept.
_MEGATRON_NO_TE_APEX = "Transformer Engine and Apex are not installed"
_TORCH_NO_CUDA_RUNTIME = "No CUDA runtime is found"
_CHECKPOINT_LOAD_NOISE = (
    (UserWarning, "The argument order of load has been changed"),
    (UserWarning, "torch.distributed is disabled, unavailable or uninitialized, assuming the intent "
                  "is to load in a single process"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
)


def _not_no_cuda_runtime(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_TORCH_NO_CUDA_RUNTIME)


# megatron-core's other import-time warnings (apex is optional everywhere; config defaults and
# collectives we do not use).
_MEGATRON_IMPORT_NOISE = (
    ".*Apex is not installed.*",
    ".*absl.logging is not installed.*",
    ".*full scope is deprecated.*",
    ".*is deprecated. Please use `torch.distributed.*_single` instead.*",
)


def quiet_known_noise() -> None:
    """Filter exactly those messages (before torch and megatron are imported); idempotent."""
    warnings.filterwarnings("ignore", message=_MEGATRON_NO_TE_APEX, category=UserWarning)
    for message in _MEGATRON_IMPORT_NOISE:
        warnings.filterwarnings("ignore", message=message)
    for category, message in _CHECKPOINT_LOAD_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
    cpp_extension = logging.getLogger("torch.utils.cpp_extension")
    if _not_no_cuda_runtime not in cpp_extension.filters:
        cpp_extension.addFilter(_not_no_cuda_runtime)
    # megatron-core logs five INFO lines per opened .idx file; a mixture opens thousands of shards.
    logging.getLogger("megatron.core.datasets.indexed_dataset").setLevel(logging.WARNING)

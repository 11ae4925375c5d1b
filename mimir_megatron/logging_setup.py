"""Logging through `logging`: rank 0 speaks, the other ranks only report warnings and errors."""

from __future__ import annotations

import logging
import os


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

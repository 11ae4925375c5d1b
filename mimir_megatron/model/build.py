"""Build the model in a process: parallel state, seeding, device placement; parameter counts."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from mimir_megatron import backend, parallel
from mimir_megatron.config import ModelConfig
from mimir_megatron.model.hrm import HRMTextModel


def build_model(cfg: ModelConfig, *, device: str | torch.device | None = None) -> HRMTextModel:
    """Build (and initialise, from ``cfg.seed``) the model for this process's TP rank.

    Works in a plain single process: a one-rank process group is created when none exists.
    ``device="meta"`` builds the module structure without allocating weights.
    """
    cfg.validate()
    parallel.init_model_parallel(cfg.parallel.tensor_parallel_size)
    # Same seed on every rank: megatron initialises full master weights and keeps each rank's
    # slice, so one seed gives the same model for any TP size.
    torch.manual_seed(cfg.seed)
    # Python's and numpy's generators too (as megatron's training does): their states are part of
    # a checkpoint, so a run's must not depend on what the process did before it.
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    backend.seed_rng_tracker(cfg.seed)
    target = torch.device(device) if device is not None else backend.device()
    if target.type == "meta":
        with torch.device("meta"):
            return HRMTextModel(cfg)
    return HRMTextModel(cfg).to(target)


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    embedding: int
    head: int
    stack_L: int
    stack_H: int
    buffers: int

    @property
    def non_embedding(self) -> int:
        """Stacks + head (the paper's "1.38B" for Mimir)."""
        return self.total - self.embedding


def count_parameters(model: HRMTextModel) -> ParameterCounts:
    """Trainable parameters of the full model (summed over TP ranks, padding rows excluded)."""
    cfg = model.cfg
    tp = cfg.parallel.tensor_parallel_size

    def numel(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters()) * tp

    vocab_rows = cfg.vocab_size * cfg.hidden_size  # padded rows are not model parameters
    stack_L, stack_H = numel(model.L), numel(model.H)
    return ParameterCounts(
        total=2 * vocab_rows + stack_L + stack_H,
        embedding=vocab_rows,
        head=vocab_rows,
        stack_L=stack_L,
        stack_H=stack_H,
        buffers=sum(b.numel() for b in model.buffers()),
    )

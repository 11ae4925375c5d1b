"""Weight initialisation as in the HRM-Text reference: LeCun normal truncated at 3 sigma."""

from __future__ import annotations

import math
from typing import Callable

import torch


def lecun_normal_(weight: torch.Tensor) -> torch.Tensor:
    """std = 1/sqrt(fan_in), truncated at +-3 std; fan_in is the last dim of ``[out, in]``.

    Megatron calls init methods on the full (unsplit) master weight, so fan_in is right for every
    TP size and the weights are identical across TP layouts for one seed.
    """
    std = 1.0 / math.sqrt(weight.shape[-1])
    return torch.nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def vocab_rows_init(vocab_size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Init for a full ``[padded_vocab, D]`` embedding or head: std 1/sqrt(D) on the real rows,
    zeros on the padding rows.

    Drawing only ``vocab_size`` rows keeps the random stream, and so every later weight,
    independent of the TP-dependent padding.
    """

    def init(weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            lecun_normal_(weight[:vocab_size])
            weight[vocab_size:].zero_()
        return weight

    return init


def z_l_init_(buffer: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The fixed initial low-level state: truncated normal, std 1."""
    with torch.no_grad():
        return torch.nn.init.trunc_normal_(buffer, std=1.0, a=-3.0, b=3.0, generator=generator)

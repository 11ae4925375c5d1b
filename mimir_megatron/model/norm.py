"""RMSNorm without a learnable weight, in the shape of a megatron norm slot."""

from __future__ import annotations

import torch


class ParameterlessRMSNorm(torch.nn.Module):
    """``x / rms(x)`` in fp32, cast back: HRM-Text's pre-norms and exit norms have no weight.

    Megatron's RMSNorm carries a weight; leaving it out keeps parameter counts, exports and the
    optimizer free of tensors that must never train.
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_: object):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"

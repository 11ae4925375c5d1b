"""RMSNorm without a learnable weight, in the shape of a megatron norm slot."""

from __future__ import annotations

import torch


class _LowPrecisionRMSNorm(torch.autograd.Function):
    """The norm of a bf16 residual stream, computed in fp32, keeping for backward the input as it
    is (the residual stream's own tensor) and the fp32 rsqrt: autograd's path would keep the fp32
    copy of the input (twice the bytes). The backward recomputes that copy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        rsqrt = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rsqrt)
        return (x32 * rsqrt).type_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, rsqrt = ctx.saved_tensors
        y, g = x.float() * rsqrt, grad.float()
        return (rsqrt * (g - y * (g * y).mean(-1, keepdim=True))).type_as(x), None


class ParameterlessRMSNorm(torch.nn.Module):
    """``x / rms(x)`` in fp32, cast back: HRM-Text's pre-norms and exit norms have no weight.
    A bf16 input (bf16 weights) goes through :class:`_LowPrecisionRMSNorm`; fp32 through autograd.

    Megatron's RMSNorm carries a weight; leaving it out keeps parameter counts, exports and the
    optimizer free of tensors that must never train.
    """

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_: object):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            return _LowPrecisionRMSNorm.apply(x, self.eps)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"

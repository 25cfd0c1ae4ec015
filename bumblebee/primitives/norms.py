"""RMSNorm with the Qwen convention: normalize in fp32, cast back, then scale.

``y = w * (x / sqrt(mean(x^2) + eps)).to(x.dtype)`` -- the weight multiplies the
already-cast normalized value, exactly as Hugging Face's Qwen3 RMSNorm does, so
bf16 results match bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from bumblebee.primitives.fused import fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm``'s maths (one fused kernel on CUDA: ``fused.py``)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ZeroCenteredRMSNorm``'s maths (one fused kernel on CUDA: ``fused.py``)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused("rms_norm", rms_norm, x, self.weight, self.eps, weight=True)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm storing ``weight`` zero-centered (Qwen3.5 / Qwen3-Next convention).

    ``y = (x / sqrt(mean(x^2) + eps) * (1 + w)).to(x.dtype)``: the scale is
    ``1 + weight`` (weights start at zero) and, unlike ``RMSNorm`` above, it is
    applied in fp32 before the cast back, exactly as HF's ``Qwen3_5MoeRMSNorm``.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused("rms_norm", zero_centered_rms_norm, x, self.weight, self.eps, weight=True)

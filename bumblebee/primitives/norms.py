"""RMSNorm with the Qwen convention: normalize in fp32, cast back, then scale.

``y = w * (x / sqrt(mean(x^2) + eps)).to(x.dtype)`` -- the weight multiplies the
already-cast normalized value, exactly as Hugging Face's Qwen3 RMSNorm does, so
bf16 results match bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

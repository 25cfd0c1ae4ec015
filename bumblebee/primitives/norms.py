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

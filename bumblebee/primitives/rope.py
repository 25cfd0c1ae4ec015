"""Rotary position embedding (RoPE, Su et al. 2021) on per-document positions.

Positions come from ``position_ids``, which restart at 0 for each packed
document, so every document is rotated as if it were alone in the row.
``rotary_dim`` < head_dim gives partial rotary (only the first dims rotate).

Legend: B batch, T tokens, N heads, D head dim, R rotary dim.
"""

from __future__ import annotations

import torch


def rope_cos_sin(position_ids_BT: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [B, T, R] in ``dtype`` (computed in fp32), HF's half-split layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                             device=position_ids_BT.device) / rotary_dim))
    freqs = position_ids_BT[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BNTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of every head; the rest pass through (partial rotary)."""
    r = cos_BTR.shape[-1]
    cos, sin = cos_BTR[:, None], sin_BTR[:, None]
    if r == x_BNTD.shape[-1]:
        return x_BNTD * cos + _rotate_half(x_BNTD) * sin
    x_rot, x_pass = x_BNTD[..., :r], x_BNTD[..., r:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)

"""Rotary position embedding (RoPE, Su et al. 2021) on per-document positions.

Positions come from ``position_ids``, which restart at 0 for each packed
document, so every document is rotated as if it were alone in the row.
``rotary_dim`` < head_dim gives partial rotary (only the first dims rotate).
``yarn_inv_freq`` gives the YaRN frequencies and cos/sin scale (Peng et al. 2023,
"YaRN: Efficient Context Window Extension", sec. 3.2-3.4) in the parametrisation
Hugging Face ``rope_parameters`` use (``factor``, ``original_max_position_embeddings``,
``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``); ``rope_cos_sin`` takes
them through ``inv_freq`` / ``scale``.

Legend: B batch, T tokens, N heads, D head dim, R rotary dim.
"""

from __future__ import annotations

import math

import torch

from bumblebee.primitives.fused import fused


def rope_cos_sin(
    position_ids_BT: torch.Tensor,
    rotary_dim: int,
    theta: float,
    dtype: torch.dtype,
    inv_freq: torch.Tensor | None = None,
    scale: float = 1.0,
):
    """cos/sin tables [B, T, R] in ``dtype`` (computed in fp32), HF's half-split layout.
    ``inv_freq`` [R/2] replaces the default frequencies (YaRN); ``scale`` multiplies cos and sin."""
    if inv_freq is None:
        inv_freq = 1.0 / (
            theta
            ** (
                torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=position_ids_BT.device)
                / rotary_dim
            )
        )
    freqs = position_ids_BT[..., None].float() * inv_freq.to(position_ids_BT.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 * mscale * ln(factor) + 1`` (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(rotary_dim: int, theta: float, rope: dict, max_position_embeddings: int):
    """(inv_freq [R/2] fp32, cos/sin scale) of YaRN rope parameters ``rope``.

    Dimensions rotating fewer than ``beta_slow`` times over the original context are
    interpolated (frequency / factor), those rotating more than ``beta_fast`` times keep
    their frequency, with a linear ramp between; cos/sin are scaled by
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (or ``attention_factor``)."""
    orig = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / orig
    scale = rope.get("attention_factor")
    if scale is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        scale = (
            yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
            if m and m_all
            else yarn_mscale(factor)
        )
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def dim_of(rotations):  # the dimension that rotates ``rotations`` times over ``orig`` positions
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate
    inv_freq = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep
    return inv_freq, float(scale)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BNTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of every head; the rest pass through (partial rotary). One fused
    kernel on CUDA (``fused.py``)."""
    return fused("rope", rope_reference, x_BNTD, cos_BTR, sin_BTR)


def rope_reference(x_BNTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor):
    """``apply_rope``'s maths in eager ops."""
    r = cos_BTR.shape[-1]
    cos, sin = cos_BTR[:, None], sin_BTR[:, None]
    if r == x_BNTD.shape[-1]:
        return x_BNTD * cos + _rotate_half(x_BNTD) * sin
    x_rot, x_pass = x_BNTD[..., :r], x_BNTD[..., r:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)

"""Non-finite steps: what the optimizer tail does with a NaN/Inf loss or gradient norm.

``train.on_nonfinite``:
  * ``"stop"`` (default): raise ``NonFiniteError`` naming the step *before* the
    optimizer step, so the weights, the optimizer state and every checkpoint on disk
    stay as they were after the last good step;
  * ``"skip"``: drop this step's gradients and do not step the optimizer; the step
    counter (hence the data position and the LR schedule) moves on, and the metrics
    count the skipped steps (``skipped_steps``).

The check reads the *global* loss and gradient norm (the norm is reduced over every
rank by the sharding primitive's ``clip_grad_norm``; the loss is all-reduced before
the check), so every rank takes the same decision without another collective.
"""

from __future__ import annotations

import math

import torch


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient norm with ``train.on_nonfinite = "stop"``. One line."""


def check_finite(
    step: int, loss: float | torch.Tensor, grad_norm: float | torch.Tensor, policy: str
) -> bool:
    """True if step ``step`` (1-based, the one being taken) may update the weights; False
    if it must be skipped; raises ``NonFiniteError`` under policy ``"stop"``."""
    loss, grad_norm = float(loss), float(grad_norm)
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return True
    if policy == "skip":
        return False
    raise NonFiniteError(
        f"step {step}: non-finite loss {loss} / grad norm {grad_norm}; stopped before the update "
        "(weights and checkpoints are those of the previous step); set train.on_nonfinite = "
        "'skip' to drop such steps, or lower train.lr"
    )

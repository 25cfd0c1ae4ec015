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

from bumblebee.primitives.replay_check import ReplayCheck


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient norm with ``train.on_nonfinite = "stop"``. One line."""


def check_finite(
    step: int,
    loss: float | torch.Tensor,
    grad_norm: float | torch.Tensor,
    policy: str,
    replay: ReplayCheck | None = None,
) -> bool:
    """True if step ``step`` (1-based, the one being taken) may update the weights; False
    if it must be skipped; raises ``NonFiniteError`` under policy ``"stop"``. ``replay``: the
    step's recompute check (primitives/replay_check.py): its flags come in the same host read as
    the loss and the norm, and a recompute that routed unlike its forward raises first."""
    flags = None if replay is None else replay.pending()
    loss, grad_norm, flag_values = _read(loss, grad_norm, flags)
    if replay is not None:
        replay.verify(flag_values)
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return True
    if policy == "skip":
        return False
    raise NonFiniteError(
        f"step {step}: non-finite loss {loss} / grad norm {grad_norm}; stopped before the update "
        "(weights and checkpoints are those of the previous step); set train.on_nonfinite = "
        "'skip' to drop such steps, or lower train.lr"
    )


def _read(loss, grad_norm, flags: torch.Tensor | None) -> tuple[float, float, list]:
    """(loss, grad norm, flags) on the host: one device-to-host read for the tensors among them
    (widened to float64, so each value is exactly what ``float()`` of it gives)."""
    tensors = [x for x in (loss, grad_norm, flags) if isinstance(x, torch.Tensor)]
    if len({t.device for t in tensors}) > 1:  # not so in a step; read one by one
        return float(loss), float(grad_norm), [] if flags is None else flags.tolist()
    host = torch.cat([t.detach().reshape(-1).double() for t in tensors]).tolist() if tensors else []
    loss, grad_norm = (
        host.pop(0) if isinstance(x, torch.Tensor) else float(x) for x in (loss, grad_norm)
    )
    return loss, grad_norm, host

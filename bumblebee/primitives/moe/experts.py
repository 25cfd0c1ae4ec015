"""Expert FFNs over tokens grouped by expert (slot ``experts``).

All experts of a layer live in two stacked tensors owned by ``Experts``:
``w_gate_up_EGH`` ([E, 2F, H]: gate rows then up rows, nn.Linear layout) and
``w_down_EHF`` ([E, H, F]). Tokens arrive sorted by expert with per-expert
counts; each expert computes ``down(silu(gate(x)) * up(x))`` (SwiGLU).

- ``loop`` (reference): one pair of matmuls per expert with tokens.
- ``grouped``: ``torch._grouped_mm`` over the ragged groups, one call per GEMM.
  It is used where PyTorch supports it (CPU; CUDA with bf16 on sm90+); anywhere
  else it falls back to ``loop``, so the choice never breaks a run.

Legend: N routed tokens (sorted by expert), H hidden, F expert FFN, G = 2F, E experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee.primitives import dispatch
from bumblebee.primitives.fused import swiglu_halves
from bumblebee.registry import register


class Experts(nn.Module):
    """Parameters of ``num_experts`` SwiGLU experts (the experts local to this rank)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, ffn))

    @property
    def num_experts(self) -> int:
        return self.w_gate_up.shape[0]

    def forward(self, x_NH: torch.Tensor, counts_E: torch.Tensor, expert_fn) -> torch.Tensor:
        """Run ``expert_fn`` (an ``experts`` slot implementation) on tokens sorted by expert.
        Going through ``forward`` lets wrappers such as FSDP2 gather the weights first.
        Under autocast the tokens are cast to the autocast dtype (grouped GEMMs are not
        autocast ops, and the residual stream they come from is fp32)."""
        kind = x_NH.device.type
        if torch.is_autocast_enabled(kind):
            x_NH = x_NH.to(torch.get_autocast_dtype(kind))
        return expert_fn(x_NH, counts_E, self.w_gate_up, self.w_down)


@register("experts", "loop", reference=True, summary="per-expert matmul loop")
def experts_loop(
    x_NH: torch.Tensor, counts_E: torch.Tensor, w_gate_up_EGH, w_down_EHF
) -> torch.Tensor:
    outs, start = [], 0
    for e, n in enumerate(counts_E.tolist()):
        if n == 0:
            continue
        x = x_NH[start : start + n]
        gate, up = F.linear(x, w_gate_up_EGH[e].to(x.dtype)).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, w_down_EHF[e].to(x.dtype)))
        start += n
    if not outs:  # no tokens routed here; still tied to the input, so that an expert-parallel
        # exchange around it stays in the autograd graph on every rank (its backward is collective)
        return x_NH.new_zeros(0, w_down_EHF.shape[1]) + 0 * x_NH.sum()
    return torch.cat(outs)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if dispatch.assumed_device() is not None:  # the planner's target (sm90+ in bf16) runs it
        return True
    if x.device.type == "cpu":
        return True
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return False


@register("experts", "grouped", summary="torch._grouped_mm over ragged expert groups")
def experts_grouped(
    x_NH: torch.Tensor, counts_E: torch.Tensor, w_gate_up_EGH, w_down_EHF
) -> torch.Tensor:
    if not grouped_mm_supported(x_NH):
        return experts_loop(x_NH, counts_E, w_gate_up_EGH, w_down_EHF)
    offs = torch.cumsum(counts_E, 0).to(torch.int32)
    h_NG = torch._grouped_mm(x_NH, w_gate_up_EGH.to(x_NH.dtype).transpose(-2, -1), offs=offs)
    return torch._grouped_mm(
        swiglu_halves(h_NG), w_down_EHF.to(x_NH.dtype).transpose(-2, -1), offs=offs
    )

"""Expert FFNs over tokens grouped by expert (slot ``experts``).

All experts of a layer live in two stacked tensors owned by ``Experts``:
``w_gate_up_EGH`` ([E, 2F, H]: gate rows then up rows, nn.Linear layout) and
``w_down_EHF`` ([E, H, F]). Tokens arrive sorted by expert with per-expert
counts; each expert computes ``down(silu(gate(x)) * up(x))`` (SwiGLU). Options (gpt-oss):
biases ``b_gate_up`` [E, 2F] and ``b_down`` [E, H] added after each GEMM, and another GLU
of the [gate | up] halves (``ClampedSwiGLU``); an implementation takes them as ``bias`` /
``act`` keywords, given only when set.

- ``loop`` (reference): one pair of matmuls per expert with tokens.
- ``grouped``: ``torch._grouped_mm`` over the ragged groups, one call per GEMM.
  It is used where PyTorch supports it (CPU; CUDA with bf16 on sm90+); anywhere
  else it falls back to ``loop``, so the choice never breaks a run.

Legend: N routed tokens (sorted by expert), H hidden, F expert FFN, G = 2F, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee.primitives import dispatch
from bumblebee.primitives.fused import clamped_swiglu_halves, swiglu_halves
from bumblebee.registry import register


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert GLU (``fused.clamped_swiglu_halves``) on [gate | up] halves."""

    alpha: float
    limit: float

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu_halves(h, self.alpha, self.limit)


class Experts(nn.Module):
    """Parameters of ``num_experts`` GLU experts (the experts local to this rank); ``bias``: with
    per-expert biases, ``act``: the GLU of the [gate | up] halves (None: SwiGLU)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, *, bias: bool = False, act=None):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        if bias:
            self.b_gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn))
            self.b_down = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias, self.act = bias, act

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
        options = {}
        if self.bias:
            options["bias"] = (self.b_gate_up, self.b_down)
        if self.act is not None:
            options["act"] = self.act
        return expert_fn(x_NH, counts_E, self.w_gate_up, self.w_down, **options)


@register("experts", "loop", reference=True, summary="per-expert matmul loop")
def experts_loop(
    x_NH: torch.Tensor, counts_E: torch.Tensor, w_gate_up_EGH, w_down_EHF, *, bias=None, act=None
) -> torch.Tensor:
    outs, start = [], 0
    for e, n in enumerate(counts_E.tolist()):
        if n == 0:
            continue
        x = x_NH[start : start + n]
        b_gu, b_d = (
            (None, None) if bias is None else (bias[0][e].to(x.dtype), bias[1][e].to(x.dtype))
        )
        h = F.linear(x, w_gate_up_EGH[e].to(x.dtype), b_gu)
        if act is None:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = act(h)
        outs.append(F.linear(h, w_down_EHF[e].to(x.dtype), b_d))
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
    x_NH: torch.Tensor, counts_E: torch.Tensor, w_gate_up_EGH, w_down_EHF, *, bias=None, act=None
) -> torch.Tensor:
    if not grouped_mm_supported(x_NH):
        return experts_loop(x_NH, counts_E, w_gate_up_EGH, w_down_EHF, bias=bias, act=act)
    offs = torch.cumsum(counts_E, 0).to(torch.int32)
    h_NG = torch._grouped_mm(x_NH, w_gate_up_EGH.to(x_NH.dtype).transpose(-2, -1), offs=offs)
    if bias is not None:  # each row's expert (output_size: no device sync)
        rows_E = torch.arange(counts_E.shape[0], device=x_NH.device)
        expert_N = torch.repeat_interleave(rows_E, counts_E, output_size=x_NH.shape[0])
        h_NG = h_NG + bias[0].to(x_NH.dtype)[expert_N]
    y_NH = torch._grouped_mm(
        (act or swiglu_halves)(h_NG), w_down_EHF.to(x_NH.dtype).transpose(-2, -1), offs=offs
    )
    return y_NH if bias is None else y_NH + bias[1].to(x_NH.dtype)[expert_N]

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

Low-rank adapters (``Experts.add_lora``, models/lora.py) are stacked like the weights, one
[r, in] / [out, r] pair per expert and projection, so each adapter is two more grouped GEMMs
over the same groups (``x A_e^T`` then ``B_e``), never a per-expert loop or a merged
[E, 2F, H] weight (a schedule that runs the GEMMs itself, moe_comm = chunked, gets the merged
weight instead).

Legend: N routed tokens (sorted by expert), H hidden, F expert FFN, G = 2F, E experts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee.primitives import kernel_choice
from bumblebee.primitives.fused import clamped_swiglu_halves, swiglu_halves
from bumblebee.primitives.packed import to_device
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
        self.lora_scale = 0.0  # > 0 once add_lora gave it adapters

    @property
    def num_experts(self) -> int:
        return self.w_gate_up.shape[0]

    def add_lora(self, rank: int, scale: float) -> None:
        """Per-expert adapters, stacked on dim 0 like the weights (so expert parallelism and
        FSDP2 split them with their experts): ``lora_A_*`` [E, r, in], ``lora_B_*`` [E, out, r]."""
        E, G, H = self.w_gate_up.shape
        F_ = self.w_down.shape[2]
        new = lambda *shape: nn.Parameter(torch.empty(*shape, device=self.w_gate_up.device))  # noqa: E731
        self.lora_A_gate_up, self.lora_B_gate_up = new(E, rank, H), new(E, G, rank)
        self.lora_A_down, self.lora_B_down = new(E, rank, F_), new(E, H, rank)
        self.lora_scale = scale

    def lora_factors(self):
        """(A_gate_up, B_gate_up, A_down, B_down, scale), or None without adapters."""
        if not self.lora_scale:
            return None
        return (
            self.lora_A_gate_up,
            self.lora_B_gate_up,
            self.lora_A_down,
            self.lora_B_down,
            self.lora_scale,
        )

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
        lora = self.lora_factors()
        if lora is None:
            return expert_fn(x_NH, counts_E, self.w_gate_up, self.w_down, **options)
        if "lora" in inspect.signature(expert_fn).parameters:
            return expert_fn(x_NH, counts_E, self.w_gate_up, self.w_down, lora=lora, **options)
        a1, b1, a2, b2, s = lora  # a schedule of its own: merged weights (full-size, transient)
        return expert_fn(
            x_NH,
            counts_E,
            self.w_gate_up.to(x_NH.dtype) + s * torch.bmm(b1, a1).to(x_NH.dtype),
            self.w_down.to(x_NH.dtype) + s * torch.bmm(b2, a2).to(x_NH.dtype),
            **options,
        )


def _low_rank(x, a_RI, b_OR, scale: float):
    """scale * B (A x) for one expert's rows x [n, I]."""
    return scale * F.linear(F.linear(x, a_RI.to(x.dtype)), b_OR.to(x.dtype))


@register("experts", "loop", reference=True, summary="per-expert matmul loop")
def experts_loop(
    x_NH: torch.Tensor,
    counts_E: torch.Tensor,
    w_gate_up_EGH,
    w_down_EHF,
    lora=None,
    *,
    bias=None,
    act=None,
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
        if lora is not None:
            h = h + _low_rank(x, lora[0][e], lora[1][e], lora[4])
        if act is None:
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = act(h)
        y = F.linear(a, w_down_EHF[e].to(x.dtype), b_d)
        outs.append(y if lora is None else y + _low_rank(a, lora[2][e], lora[3][e], lora[4]))
        start += n
    if not outs:  # no tokens routed here; still tied to the input, so that an expert-parallel
        # exchange around it stays in the autograd graph on every rank (its backward is collective)
        return x_NH.new_zeros(0, w_down_EHF.shape[1]) + 0 * x_NH.sum()
    return torch.cat(outs)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if kernel_choice.assumed_device() is not None:  # the planner's target (sm90+ in bf16) runs it
        return True
    if x.device.type == "cpu":
        return True
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return False


@register("experts", "grouped", summary="torch._grouped_mm over ragged expert groups")
def experts_grouped(
    x_NH: torch.Tensor,
    counts_E: torch.Tensor,
    w_gate_up_EGH,
    w_down_EHF,
    lora=None,
    *,
    bias=None,
    act=None,
) -> torch.Tensor:
    if not grouped_mm_supported(x_NH):
        return experts_loop(x_NH, counts_E, w_gate_up_EGH, w_down_EHF, lora, bias=bias, act=act)
    offs = torch.cumsum(counts_E, 0).to(torch.int32)

    def gmm(x, w_EOI):  # y_n = W_e x_n for the rows n of expert e
        return torch._grouped_mm(x, w_EOI.to(x.dtype).transpose(-2, -1), offs=offs)

    def low_rank(x, a_ERI, b_EOR):  # scale * B_e (A_e x_n)
        a_ERI, b_EOR = _aligned_rank(a_ERI.to(x.dtype), b_EOR.to(x.dtype))
        return lora[4] * gmm(gmm(x, a_ERI), b_EOR)

    h_NG = gmm(x_NH, w_gate_up_EGH)
    if bias is not None:  # each row's expert (output_size: no device sync)
        rows_E = torch.arange(counts_E.shape[0], device=x_NH.device)
        expert_N = torch.repeat_interleave(rows_E, counts_E, output_size=x_NH.shape[0])
        h_NG = h_NG + bias[0].to(x_NH.dtype)[expert_N]
    if lora is not None:
        h_NG = h_NG + low_rank(x_NH, lora[0], lora[1])
    a_NF = (act or swiglu_halves)(h_NG)
    y_NH = gmm(a_NF, w_down_EHF)
    if bias is not None:
        y_NH = y_NH + bias[1].to(x_NH.dtype)[expert_N]
    if lora is not None:
        y_NH = y_NH + low_rank(a_NF, lora[2], lora[3])
    return y_NH


def _aligned_rank(a_ERI: torch.Tensor, b_EOR: torch.Tensor):
    """Zero-pad the rank so that a row of the [N, r] intermediate is a multiple of 16 bytes
    (``_grouped_mm``'s stride rule; rank 4 in bf16 is 8 bytes): the padded products are zero."""
    step = max(1, 16 // a_ERI.element_size())
    pad = -a_ERI.shape[1] % step
    if pad == 0:
        return a_ERI, b_EOR
    return F.pad(a_ERI, (0, 0, 0, pad)), F.pad(b_EOR, (0, pad))


class GroupedGemms:
    """Expert GEMMs on rows grouped by local expert (``counts`` rows each), the forward, the
    data gradient and the weight gradient called separately (chunked.py runs its own backward
    and delays the weight gradients)."""

    def __init__(self, counts: list[int], grouped: bool, device):
        self.counts, self.grouped = counts, grouped
        if grouped:
            self.offs = to_device(counts, device, torch.int32).cumsum(0, dtype=torch.int32)

    def _loop(self, x, width, fn):
        parts, start = [], 0
        for e, n in enumerate(self.counts):
            if n:
                parts.append(fn(e, x[start : start + n]))
                start += n
        return torch.cat(parts) if parts else x.new_zeros(0, width)

    def fwd(self, x_MI, w_EOI):  # y_m = W_e x_m -> [M, O]
        if self.grouped:
            return torch._grouped_mm(x_MI, w_EOI.transpose(-2, -1), offs=self.offs)
        return self._loop(x_MI, w_EOI.shape[1], lambda e, x: F.linear(x, w_EOI[e]))

    def dgrad(self, g_MO, w_EOI):  # dx_m = W_e^T g_m -> [M, I]
        if self.grouped:
            return torch._grouped_mm(g_MO, w_EOI, offs=self.offs)
        return self._loop(g_MO, w_EOI.shape[2], lambda e, g: g @ w_EOI[e])

    def wgrad(self, g_MO, x_MI):  # dW_e = sum_m g_m x_m^T -> [E, O, I]
        if self.grouped:
            return torch._grouped_mm(g_MO.t(), x_MI, offs=self.offs)
        out, start = g_MO.new_zeros(len(self.counts), g_MO.shape[1], x_MI.shape[1]), 0
        for e, n in enumerate(self.counts):
            out[e] = g_MO[start : start + n].t() @ x_MI[start : start + n]
            start += n
        return out

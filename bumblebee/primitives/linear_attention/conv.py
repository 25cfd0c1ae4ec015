"""Depthwise causal conv1d over packed documents, with a carried window.

Gated DeltaNet (Yang et al., "Gated Delta Networks", ICLR 2025, §3.4; the
short convolution of Mamba/H3) mixes each channel of the q/k/v projection with
the previous ``W - 1`` tokens of the *same document* before the delta rule:

    y[t, c] = sum_{i=0}^{W-1} w[c, i] * x[t - (W - 1 - i), c]

Tokens of an earlier packed document read as zeros, so the window restarts at
every document boundary. The first document of each row may continue a sequence
that began elsewhere (the previous context-parallel shard, or an earlier call):
its window is prefixed by ``initial_BPC``, the last ``P = W - 1`` pre-conv inputs
of that sequence (zeros when None). The returned ``final_BPC`` is the same
window at the end of the row, restricted to the row's last document, so that
``conv(x[:s]) -> state -> conv(x[s:], state)`` equals ``conv(x)``.

The conv is W shifted multiply-adds (W = 4 in Qwen3.5), which makes the
per-token document mask a cheap elementwise product; the weight uses nn.Conv1d's
depthwise layout [C, 1, W] so HF's ``linear_attn.conv1d.weight`` maps one to one.

Legend: B batch, T tokens, C channels, W kernel width, P = W - 1 carried tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from bumblebee.primitives.packed import DocLayout, to_device
from bumblebee.primitives.recompute import lean


def doc_offsets(layout: DocLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] document index within its row, [B, T] offset of each token in its document), built
    once per layout and device."""
    return layout.cached("doc_offsets", device, lambda: _doc_offsets(layout, device))


def _doc_offsets(layout: DocLayout, device) -> tuple[torch.Tensor, torch.Tensor]:
    doc_BT = layout.doc_ids(device)
    T = doc_BT.shape[1]
    t_BT = torch.arange(T, device=device).expand_as(doc_BT)
    starts_BT = torch.ones_like(doc_BT, dtype=torch.bool)
    starts_BT[:, 1:] = doc_BT[:, 1:] != doc_BT[:, :-1]
    start_idx_BT = torch.cummax(torch.where(starts_BT, t_BT, torch.zeros_like(t_BT)), dim=1).values
    return doc_BT, t_BT - start_idx_BT


def _check(x_BTC: torch.Tensor, weight_CW: torch.Tensor, layout: DocLayout, initial_BPC):
    if x_BTC.dim() != 3 or weight_CW.dim() != 2 or x_BTC.shape[-1] != weight_CW.shape[0]:
        raise ValueError(
            f"causal_conv1d: need x [B, T, C] and weight [C, W], got {tuple(x_BTC.shape)} "
            f"and {tuple(weight_CW.shape)}"
        )
    B, T, C = x_BTC.shape
    if layout.seq_len != T or len(layout.bounds) != B:
        raise ValueError(
            f"causal_conv1d: layout is for {len(layout.bounds)} rows x {layout.seq_len} tokens, "
            f"input has {B} x {T}"
        )
    P = weight_CW.shape[1] - 1
    if initial_BPC is not None and tuple(initial_BPC.shape) != (B, P, C):
        raise ValueError(
            f"causal_conv1d: initial window must be [B, W-1, C] = {(B, P, C)}, "
            f"got {tuple(initial_BPC.shape)}"
        )


def causal_conv1d(
    x_BTC: torch.Tensor,
    weight_CW: torch.Tensor,
    layout: DocLayout,
    initial_BPC: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (no bias, no activation) -> (y [B, T, C], final window [B, W-1, C])."""
    _check(x_BTC, weight_CW, layout, initial_BPC)
    B, T, C = x_BTC.shape
    W = weight_CW.shape[1]
    P = W - 1
    # accumulate in fp32 (as a conv kernel does) and round once; the window is kept in x's dtype
    acc = torch.float64 if x_BTC.dtype == torch.float64 else torch.float32
    x, w_CW = x_BTC.to(weight_CW.dtype).to(acc), weight_CW.to(acc)
    init = x.new_zeros(B, P, C) if initial_BPC is None else initial_BPC.to(acc)
    x_ext = torch.cat([init, x], dim=1)  # [B, P + T, C]; x_ext[:, P + t] = x[:, t]
    doc_BT, offset_BT = doc_offsets(layout, x.device)
    first_BT = doc_BT == 0  # the first document of a row continues the initial window
    y = x * w_CW[:, P]  # lag 0: the token itself
    for i in range(P):
        lag = P - i  # tap i reads x[t - lag]
        tap = x_ext[:, i : i + T] * w_CW[:, i]
        if not layout.single_doc:
            tap = tap * ((offset_BT >= lag) | first_BT)[..., None].to(tap.dtype)
        y = y + tap
    # Window after the last token: x_ext[:, T:T+P] holds x[T-P .. T-1] (negative = initial window);
    # keep only entries of the row's last document (all of them when that is the first document).
    idx_P = torch.arange(T - P, T, device=x.device)
    last_start_B = layout.cached(
        "last_start", x.device, lambda: to_device([b[-2] for b in layout.bounds], x.device)
    )
    keep_BP = (idx_P[None] >= last_start_B[:, None]) | (last_start_B[:, None] == 0)
    final_BPC = x_ext[:, T : T + P] * keep_BP[..., None].to(x.dtype)
    return y.to(x_BTC.dtype), final_BPC.to(x_BTC.dtype)


class CausalConv1d(nn.Module):
    """Holds the depthwise weight [C, 1, W] (nn.Conv1d / HF layout) and applies ``causal_conv1d``."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        if channels <= 0 or kernel_size <= 0:
            raise ValueError(
                f"CausalConv1d needs positive channels and kernel_size, got {channels}, {kernel_size}"
            )
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    @property
    def window(self) -> int:
        """Tokens carried between calls (kernel_size - 1)."""
        return self.weight.shape[-1] - 1

    def forward(
        self, x_BTC, layout: DocLayout, initial_BPC=None, activation=None, block: int = 1024
    ):
        """Channels in blocks of ``block`` (the conv is depthwise: same values), each block under
        ``lean``: autograd keeps the input only, and backward recomputes the fp32 taps one block at
        a time (Qwen3.5, 8192 channels, bf16: 64 KiB per token less to keep, and the transient
        fp32 copies are 1/8 of the channels). ``activation`` (elementwise, e.g. SiLU) is applied
        to y inside the same block, so the conv's output need not be kept either."""
        act = activation or (lambda y: y)

        def fn(x, w, init):
            y, final = causal_conv1d(x, w[:, 0], layout, init)
            return act(y), final

        C = x_BTC.shape[-1]
        if C <= block:
            return lean(fn, x_BTC, self.weight, initial_BPC)
        # split (not slicing): backward cats the blocks' gradients once, where each slice's backward
        # would build a full-size zero tensor and add it (2-3 x the input's gradient live at once)
        inits = (
            [None] * len(range(0, C, block))
            if initial_BPC is None
            else initial_BPC.split(block, -1)
        )
        parts = [
            lean(fn, xs, ws, init)
            for xs, ws, init in zip(x_BTC.split(block, -1), self.weight.split(block), inits)
        ]
        return torch.cat([y for y, _ in parts], dim=-1), torch.cat([f for _, f in parts], dim=-1)

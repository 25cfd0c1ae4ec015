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

On CUDA with fla-core present (``kernel_choice.select("conv", "causal", ...)``) the layer runs FLA's
fused ``causal_conv1d`` instead (``fla_causal_conv1d``: one Triton kernel over all channels and
documents, SiLU fused, varlen through ``cu_seqlens``, the carried window as per-document initial
states) in place of the channel blocks x taps loop.

Legend: B batch, T tokens, C channels, W kernel width, P = W - 1 carried tokens, N documents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from bumblebee.primitives import emulation
from bumblebee.primitives.external_calls import CAUSAL_CONV1D
from bumblebee.primitives.kernel_choice import select
from bumblebee.primitives.kernel_region import standin
from bumblebee.primitives.linear_attention.fla import doc_plan, fla_chunk_indices
from bumblebee.primitives.packed import DocLayout, to_device
from bumblebee.primitives.recompute import lean

# FLA's causal_conv1d per call, for the launch counter (primitives/kernel_region.py): forward
# conv + final-state kernels; backward conv backward + initial-state gradient kernels (chunk
# indices passed in: no host read).
FLA_CONV_FWD = ("fla causal_conv1d fwd", 2)
FLA_CONV_BWD = ("fla causal_conv1d bwd", 2)


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


def _conv_plan(layout: DocLayout, device):
    """(cu_seqlens on ``device``, the same on the host, FLA's chunk indices on ``device``, each
    row's first document, its last, N), built once per layout and device."""

    def build():
        cu, first, last = doc_plan(layout)
        dev = [to_device(x, device) for x in (cu, fla_chunk_indices(cu), first, last)]
        return dev[0], torch.tensor(cu, dtype=torch.long), *dev[1:], len(cu) - 1

    return layout.cached("fla_conv_plan", device, build)


def fla_causal_conv1d(x_BTC, weight_CW, layout: DocLayout, initial_BPC, activation, kernel=None):
    """``causal_conv1d`` (+ ``activation``: None or "silu", applied in fp32 before the cast) through
    FLA's kernel (``kernel``: a callable with the signature of
    ``fla.modules.causal_conv1d.causal_conv1d``; None: FLA's, or its reference under the
    emulated-CUDA mode, FLA's again with ``real_kernels``) -> (y [B, T, C], final [B, P, C]).
    Rows back to back as documents; FLA's state per document is its last W inputs [N, C, W]
    (column W - 1 the newest; column 0 unread): the row's window goes to its first document,
    the final window is read off its last."""
    _check(x_BTC, weight_CW, layout, initial_BPC)
    B, T, C = x_BTC.shape
    cu, cu_cpu, idx, first, last, N = _conv_plan(layout, x_BTC.device)
    h0 = None
    if initial_BPC is not None:
        h0 = x_BTC.new_zeros(N, C, weight_CW.shape[1])
        h0 = h0.index_copy(0, first, F.pad(initial_BPC.transpose(1, 2), (1, 0)).to(h0.dtype))
    args = dict(bias=None, initial_state=h0, output_final_state=True, activation=activation)
    args.update(cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, chunk_indices=idx)
    x = x_BTC.reshape(1, B * T, C)
    fake = is_fake(x) or x.device.type == "meta"
    if kernel is None and emulation.real_kernels() and not fake:
        kernel = CAUSAL_CONV1D.load()  # on the CPU tensors, through Triton's interpreter
    if kernel is not None:
        y, hT = CAUSAL_CONV1D.call(kernel, x, weight_CW, **args)
    elif emulation.active() or not x.is_cuda:
        # the CUDA branch on CPU (emulated, or the planner's dry run on fake CPU tensors): the
        # contract, counted as FLA's kernels
        ref = _shapes_only if fake else reference_fla_causal_conv1d
        y, hT = standin(
            lambda x, w, h0: CAUSAL_CONV1D.call(ref, x, w, **{**args, "initial_state": h0}),
            FLA_CONV_FWD,
            FLA_CONV_BWD,
            x,
            weight_CW,
            h0,
        )
    else:
        y, hT = CAUSAL_CONV1D.call(CAUSAL_CONV1D.load(), x, weight_CW, **args)
    return y.view(B, T, C), hT.index_select(0, last)[:, :, 1:].transpose(1, 2)


def _shapes_only(x, weight, cu_seqlens=None, **unused):
    """FLA conv's output shapes, for fake-tensor rehearsals (no data to read the boundaries from)."""
    N, (C, W) = cu_seqlens.shape[0] - 1, weight.shape
    return x * weight[:, -1], x.new_zeros(N, C, W)


def reference_fla_causal_conv1d(
    x,
    weight,
    bias=None,
    initial_state=None,
    output_final_state=False,
    activation=None,
    cu_seqlens=None,
    chunk_indices=None,
    **unused,
):
    """``fla.modules.causal_conv1d.causal_conv1d``'s contract (x [1, S, C], weight [C, W],
    per-document states [N, C, W]) in plain fp32 PyTorch, for the glue's tests and the emulated-CUDA mode;
    ``chunk_indices``, when given, must be what FLA derives from ``cu_seqlens`` (checked)."""
    S, C = x.shape[1:]
    W = weight.shape[1]
    cu = cu_seqlens.tolist() if cu_seqlens is not None else [0, S]
    if chunk_indices is not None:
        assert chunk_indices.tolist() == fla_chunk_indices(cu), "wrong chunk_indices"
    w = weight.float()
    ys, finals = [], []
    for n in range(len(cu) - 1):
        xs = x[0, cu[n] : cu[n + 1]].float()  # [L, C]
        h = initial_state[n].float().t() if initial_state is not None else xs.new_zeros(W, C)
        ext = torch.cat([h[1:], xs])  # [W - 1 + L, C]
        L = xs.shape[0]
        y = sum(ext[i : i + L] * w[:, i] for i in range(W))
        if bias is not None:
            y = y + bias.float()
        ys.append(F.silu(y) if activation in ("silu", "swish") else y)
        finals.append(torch.cat([h, xs])[-W:].t())
    y = torch.cat(ys)[None].to(x.dtype)
    return y, (torch.stack(finals).to(x.dtype) if output_final_state else None)


class CausalConv1d(nn.Module):
    """Holds the depthwise weight [C, 1, W] (nn.Conv1d / HF layout) and applies ``causal_conv1d``."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        if channels <= 0 or kernel_size <= 0:
            raise ValueError(
                f"CausalConv1d needs positive channels and kernel_size, got {channels}, {kernel_size}"
            )
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    @staticmethod
    def _fused(x) -> bool:
        return select("conv", "causal", emulation.kind(x), x.dtype).name == "fla_causal_conv1d"

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
        if activation in (None, F.silu) and self._fused(x_BTC):
            act_name = None if activation is None else "silu"
            return fla_causal_conv1d(x_BTC, self.weight[:, 0], layout, initial_BPC, act_name)
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

"""Packed-document causal attention through PyTorch's flash kernels (``varlen_attn``).

``torch.nn.attention.varlen.varlen_attn`` (PyTorch >= 2.10; flash-attention kernels, CUDA
and half precision only) takes the tokens of all documents back to back, [total, heads,
dim], with cumulative document boundaries ``cu_seq`` [docs + 1] (int32), and runs causal
attention inside each document (``window_size=(-1, 0)``), GQA included (``enable_gqa`` where
the installed torch takes it: ``varlen_api.py``).
No mask is built and cross-document tiles are never visited.

This file is the glue: [B, N, T, D] -> packed [B*T, N, D], the boundaries from the
per-document position ids (``DocLayout``: host ints, so building ``cu_seq`` costs no device
sync), and back. The kernel is a parameter so that the glue is tested on CPU with a
reference callable of the same signature and semantics (``reference_varlen_attn``).

Legend: B batch, N query heads, K kv heads, T tokens, D head dim, S total packed tokens.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from bumblebee.primitives.attention.varlen_api import gqa_keyword
from bumblebee.primitives.external_calls import VARLEN_ATTN
from bumblebee.primitives.kernel_region import standin
from bumblebee.primitives.packed import DocLayout, to_device

# Launches per call of the flash kernels (FA2 under torch's varlen_attn), for the launch counter
# (primitives/kernel_region.py): forward 1; backward 4 (dq accumulator fill, dot(do, o), main,
# dq convert).
FLASH_FWD = ("flash varlen fwd", 1)
FLASH_BWD = ("flash varlen bwd", 4)


def cu_seqlens(layout: DocLayout, device) -> tuple[torch.Tensor, int]:
    """(int32 [docs + 1] cumulative boundaries of the rows laid back to back, longest document);
    built once per layout and device."""
    T = layout.seq_len
    cu, longest = [], 0
    for b, bounds in enumerate(layout.bounds):
        cu.extend(b * T + s for s in bounds[:-1])
        longest = max(longest, max(e - s for s, e in zip(bounds[:-1], bounds[1:])))
    cu.append(len(layout.bounds) * T)
    return layout.cached("cu_seqlens", device, lambda: to_device(cu, device, torch.int32)), longest


def cuda_varlen_attn():
    """PyTorch's kernel (imported lazily: absent before PyTorch 2.10); its reference under the
    emulated-CUDA mode."""
    from bumblebee.primitives import emulation

    if emulation.active():
        return emulated_varlen_attn
    from bumblebee.primitives.kernel_choice import use_flash_impl

    use_flash_impl()  # FA3 in torch's dispatcher when present (once)

    return VARLEN_ATTN.load()


def flash_varlen(
    q_BNTD, k_BKTD, v_BKTD, layout: DocLayout, scale: float, kernel=None, *, window: int = 0
):
    """Causal attention per packed document -> o [B, N, T, D] (q's dtype); ``window`` > 0: each
    query sees its last ``window`` keys (flash-attention's left window is ``window - 1``)."""
    kernel = kernel or cuda_varlen_attn()
    B, N, T, D = q_BNTD.shape
    K = k_BKTD.shape[1]
    cu, longest = cu_seqlens(layout, q_BNTD.device)
    q_SND, k_SKD, v_SKD = (
        x.transpose(1, 2).reshape(B * T, x.shape[1], D) for x in (q_BNTD, k_BKTD, v_BKTD)
    )
    o_SND = VARLEN_ATTN.call(
        kernel,
        q_SND,
        k_SKD,
        v_SKD,
        cu,
        cu,
        longest,
        longest,
        scale=scale,
        window_size=(window - 1 if window else -1, 0),
        **gqa_keyword(N, K),
    )
    return o_SND.view(B, T, N, D).transpose(1, 2)


def emulated_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
    """``reference_varlen_attn`` counted as the flash kernels it stands for, forward and backward
    (fake tensors: torch's op, whose fake kernels give the shapes)."""
    if is_fake(q) or q.device.type == "meta":
        return VARLEN_ATTN.load()(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    def run(q, k, v, cu_q, cu_k):
        return reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    return standin(run, FLASH_FWD, FLASH_BWD, q, k, v, cu_q, cu_k)


def reference_varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
):
    """``varlen_attn``'s contract in plain PyTorch (fp32 scores), for CPU tests of the glue:
    per sequence i, queries ``cu_seq_q[i]:cu_seq_q[i+1]`` attend keys ``cu_seq_k[i]:cu_seq_k[i+1]``;
    ``window_size=(-1, 0)`` is causal aligned to the bottom right (query j of Lq sees keys
    <= j + Lk - Lq, flash-attention's convention), ``(w, 0)`` also keys >= j + Lk - Lq - w;
    LSE is fp32 [heads, total_q] (the layout of the kernel and of its fake implementation).
    Empty sequences are allowed."""
    Sq, N, D = query.shape
    G = N // key.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = query.new_zeros(query.shape)
    lse = torch.full((N, Sq), float("-inf"), dtype=torch.float32, device=query.device)
    cq, ck = cu_seq_q.tolist(), cu_seq_k.tolist()
    for i in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if q1 == q0 or k1 == k0:
            continue
        q = query[q0:q1].float().transpose(0, 1)  # [N, Lq, D]
        k = key[k0:k1].float().transpose(0, 1).repeat_interleave(G, 0)
        v = value[k0:k1].float().transpose(0, 1).repeat_interleave(G, 0)
        s = q @ k.transpose(-1, -2) * scale
        if window_size[1] == 0:
            Lq, Lk = q1 - q0, k1 - k0
            i_q, i_k = (torch.arange(n, device=s.device) for n in (Lq, Lk))  # on the scores' device
            diag = i_q[:, None] + (Lk - Lq)
            allowed = i_k[None, :] <= diag
            if window_size[0] >= 0:
                allowed &= i_k[None, :] >= diag - window_size[0]
            s = s.masked_fill(~allowed, float("-inf"))
        l = torch.logsumexp(s, -1)  # noqa: E741
        p = torch.exp(s - torch.where(torch.isinf(l), torch.zeros_like(l), l)[..., None])
        out[q0:q1] = (p @ v).transpose(0, 1).to(out.dtype)
        lse[:, q0:q1] = l
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out

"""Ring attention whose per-step block work runs a varlen flash kernel (``cp_attention = "ring"`` on
CUDA in bf16/fp16; ``primitives/kernel_choice.py`` decides).

The ring is the one of ``ring.py`` (K/V blocks travel r -> r+1; backward sends them round
again with their dK/dV accumulators). What changes is the work per step: instead of fp32
score tiles with masks, every (local query chunk, received key chunk) pair that the causal
and document masks do not exclude becomes one varlen call whose sequences are the document
pieces the pair shares. With zigzag shards (chunks of n tokens, rank r holds chunks r and
2C-1-r) a pair of global chunks (i, j) is one of:

- j > i: skipped (every key is in the future);
- j = i (step 0, same slot): causal attention inside each document piece of the chunk,
  one sequence per piece (documents crossing the chunk borders are cut at them; the part
  in earlier chunks is another pair);
- j < i: only the document open at the start of chunk i can reach chunk j; one sequence
  per row: that document's queries in chunk i against its keys in chunk j, no mask (all
  keys precede all queries).

These decisions use the host copy of the global document boundaries (``CPShards.docs``),
so a step issues its kernels without a device-to-host sync. Partial results merge with
their log-sum-exp (fp32), o = sum_p exp(lse_p - lse) o_p. Backward hands each pair the
*final* output and LSE (flash backward computes P = exp(S - lse) and
Delta = rowsum(dO * O) from them), so forward and backward use the same scores: the kernel's
own precision in both.

The block kernel is a parameter ``BlockKernel(forward, backward)``: ``cuda_block_kernel()``
calls PyTorch's flash ops (``torch.ops.torch_attn._varlen_attn`` / ``_varlen_attn_backward``,
the ops behind ``varlen_attn``, through ``attention/varlen_api.py``; their public wrapper ignores
the LSE gradient, so the ring calls forward and backward itself); ``reference_block_kernel()``
is the same contract in fp32 PyTorch, which is how the glue is tested on CPU.

Legend: B batch, N query heads, K kv heads, L local tokens (2n), D head dim, S packed tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from bumblebee.primitives import emulation
from bumblebee.primitives.attention import varlen_api
from bumblebee.primitives.attention.flash import FLASH_BWD, FLASH_FWD, reference_varlen_attn
from bumblebee.primitives.cp.ring_comm import backward_hop
from bumblebee.primitives.cp.ring_comm import ring_pass as _ring_pass
from bumblebee.primitives.cp.zigzag import CPShards
from bumblebee.primitives.kernel_region import kernel
from bumblebee.primitives.packed import to_device


@dataclass(frozen=True)
class BlockKernel:
    # forward(q [S,N,D], k [Sk,K,D], v, cu_q, cu_k, max_q, max_k, causal, scale) -> (o [S,N,D], lse fp32 [N,S])
    forward: Callable
    # backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale) -> (dq, dk, dv)
    backward: Callable


def cuda_block_kernel() -> BlockKernel:
    """PyTorch's flash ops; ``reference_block_kernel()`` under the emulated-CUDA mode."""
    if emulation.active():
        return reference_block_kernel(as_kernel=True)
    from bumblebee.primitives.kernel_choice import use_flash_impl

    use_flash_impl()  # FA3 in torch's dispatcher when present (once)

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        window = [-1, 0] if causal else [-1, -1]
        return varlen_api.forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window)

    def bwd(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        window = [-1, 0] if causal else [-1, -1]
        return varlen_api.backward(
            do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale, window
        )

    return BlockKernel(fwd, bwd)


def reference_block_kernel(as_kernel: bool = False) -> BlockKernel:
    """The flash ops' contract in plain PyTorch; ``as_kernel``: counted as the flash kernels
    (``kernel_region``), as the emulated-CUDA mode runs it."""
    from torch.nn.attention.varlen import AuxRequest

    if as_kernel:
        ref = reference_block_kernel()

        def fwd(*a):
            with kernel(*FLASH_FWD):
                return ref.forward(*a)

        def bwd(*a):
            with kernel(*FLASH_BWD):
                return ref.backward(*a)

        return BlockKernel(fwd, bwd)

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        return reference_varlen_attn(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            return_aux=AuxRequest(lse=True),
            scale=scale,
            window_size=(-1, 0) if causal else (-1, -1),
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def bwd(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        G = q.shape[1] // k.shape[1]
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for i in range(len(cq) - 1):
            q0, q1, k0, k1 = cq[i], cq[i + 1], ck[i], ck[i + 1]
            qs, dos, os_ = (x[q0:q1].float().transpose(0, 1) for x in (q, do, o))  # [N, Lq, D]
            ks, vs = (x[k0:k1].float().transpose(0, 1).repeat_interleave(G, 0) for x in (k, v))
            s = qs @ ks.transpose(-1, -2) * scale
            if causal:
                Lq, Lk = q1 - q0, k1 - k0
                i_q, i_k = (
                    torch.arange(n, device=s.device) for n in (Lq, Lk)
                )  # on the scores' device
                allowed = i_k[None, :] <= i_q[:, None] + (Lk - Lq)
                s = s.masked_fill(~allowed, float("-inf"))
            p = torch.exp(s - lse[:, q0:q1, None])
            delta = (dos * os_).sum(-1, keepdim=True)
            ds = p * (dos @ vs.transpose(-1, -2) - delta)
            dq[q0:q1] = (ds @ ks * scale).transpose(0, 1).to(dq.dtype)
            dk_i = (ds.transpose(-1, -2) @ qs * scale).unflatten(0, (-1, G)).sum(1)
            dv_i = (p.transpose(-1, -2) @ dos).unflatten(0, (-1, G)).sum(1)
            dk[k0:k1] = dk_i.transpose(0, 1).to(dk.dtype)
            dv[k0:k1] = dv_i.transpose(0, 1).to(dv.dtype)
        return dq, dk, dv

    return BlockKernel(fwd, bwd)


@dataclass(frozen=True)
class Pair:
    """One kernel call: packed query rows and key rows (flat b * L + t indices), boundaries."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool


def _pack(pieces, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[(flat start, flat end)] -> (index [S], cu int32 [len + 1], longest piece)."""
    idx, cu = [], [0]
    for s, e in pieces:
        idx.extend(range(s, e))
        cu.append(cu[-1] + e - s)
    longest = max(e - s for s, e in pieces)
    return to_device(idx, device), to_device(cu, device, torch.int32), longest


def step_pairs(layout: CPShards, src: int) -> list[Pair]:
    """The kernel calls of the ring step holding rank ``src``'s K/V, decided on the host once per
    layout (every layer's forward, recompute and backward reuse the index tensors)."""
    return layout.cached(
        ("ring_pairs", src), layout.index_L.device, lambda: _step_pairs(layout, src)
    )


def _step_pairs(layout: CPShards, src: int) -> list[Pair]:
    C, r, n = layout.size, layout.rank, layout.chunk
    L = 2 * n
    chunks = lambda rank: (rank, 2 * C - 1 - rank)  # noqa: E731  (global chunk of slot 0, slot 1)
    device = layout.index_L.device
    out = []
    for a, qi in enumerate(chunks(r)):
        for c, kj in enumerate(chunks(src)):
            if kj > qi:
                continue
            q_pieces, k_pieces = [], []
            for b, bounds in enumerate(layout.docs.bounds):
                if kj == qi:  # the chunk's document pieces, causal inside each
                    lo, hi = qi * n, (qi + 1) * n
                    for s, e in zip(bounds[:-1], bounds[1:]):
                        s, e = max(s, lo), min(e, hi)
                        if s < e:
                            piece = (b * L + a * n + s - lo, b * L + a * n + e - lo)
                            q_pieces.append(piece)
                            k_pieces.append((b * L + c * n + s - lo, b * L + c * n + e - lo))
                    continue
                # the document open at the start of chunk qi: [ds, de)
                start = qi * n
                d = max(i for i, s in enumerate(bounds[:-1]) if s <= start)
                ds, de = bounds[d], bounds[d + 1]
                k_lo, k_hi = max(ds, kj * n), (kj + 1) * n
                if k_lo >= k_hi:
                    continue  # the document starts after chunk kj
                q_hi = min(de, (qi + 1) * n)
                q_pieces.append((b * L + a * n, b * L + a * n + q_hi - start))
                k_pieces.append((b * L + c * n + k_lo - kj * n, b * L + (c + 1) * n))
            if q_pieces:
                qx, cq, mq = _pack(q_pieces, device)
                kx, ck, mk = _pack(k_pieces, device)
                out.append(Pair(qx, kx, cq, ck, mq, mk, kj == qi))
    return out


def _flat(x_BHLD: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] -> [B*L, H, D], contiguous (with one row ``reshape`` would return a strided view;
    the blocks travel the ring and the kernels index rows of it)."""
    B, H, L, D = x_BHLD.shape
    return x_BHLD.transpose(1, 2).reshape(B * L, H, D).contiguous()


def forward_step(
    q, o, lse, k, v, layout: CPShards, src: int, scale: float, kernel: BlockKernel
) -> None:
    """Merge local queries x rank ``src``'s K/V block into the running (o, lse), in place.
    q [B*L, N, D], o fp32 like q, lse fp32 [N, B*L], k / v [B*L, K, D]."""
    for p in step_pairs(layout, src):
        o_p, lse_p = kernel.forward(
            q[p.q_index],
            k[p.k_index],
            v[p.k_index],
            p.cu_q,
            p.cu_k,
            p.max_q,
            p.max_k,
            p.causal,
            scale,
        )
        old = lse[:, p.q_index]
        new = torch.logaddexp(old, lse_p.float())
        keep, add = torch.exp(old - new).T[..., None], torch.exp(lse_p - new).T[..., None]
        o[p.q_index] = o[p.q_index] * keep + o_p.float() * add
        lse[:, p.q_index] = new


def backward_step(
    do, q, out, lse, dq, k, v, dk, dv, layout: CPShards, src: int, scale: float, kernel: BlockKernel
) -> None:
    """Add local queries x rank ``src``'s block to dq and the block's dk / dv (fp32, in place);
    ``out`` / ``lse`` are the forward's final output and log-sum-exp."""
    for p in step_pairs(layout, src):
        dq_p, dk_p, dv_p = kernel.backward(
            do[p.q_index],
            q[p.q_index],
            k[p.k_index],
            v[p.k_index],
            out[p.q_index],
            lse[:, p.q_index],
            p.cu_q,
            p.cu_k,
            p.max_q,
            p.max_k,
            p.causal,
            scale,
        )
        dq.index_add_(0, p.q_index, dq_p.float())
        dk.index_add_(0, p.k_index, dk_p.float())
        dv.index_add_(0, p.k_index, dv_p.float())


class RingFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BNLD, k_BKLD, v_BKLD, layout: CPShards, scale: float, kernel: BlockKernel):
        B, N, L, D = q_BNLD.shape
        q = _flat(q_BNLD)
        o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((N, B * L), float("-inf"), dtype=torch.float32, device=q.device)
        k, v = _flat(k_BKLD), _flat(v_BKLD)
        for step in range(layout.size):
            src = (layout.rank - step) % layout.size
            if step + 1 < layout.size:
                (k_next, v_next), wait = _ring_pass([k, v], layout)
            forward_step(q, o, lse, k, v, layout, src, scale, kernel)
            if step + 1 < layout.size:
                wait()
                k, v = k_next, v_next
        out = o.to(q_BNLD.dtype)
        ctx.save_for_backward(q, _flat(k_BKLD), _flat(v_BKLD), out, lse)
        ctx.layout, ctx.scale, ctx.kernel, ctx.shape = layout, scale, kernel, (B, N, L, D)
        return out.view(B, L, N, D).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_BNLD):
        q, k, v, out, lse = ctx.saved_tensors
        layout, scale, kernel = ctx.layout, ctx.scale, ctx.kernel
        B, N, L, D = ctx.shape
        do = _flat(grad_BNLD.to(q.dtype).contiguous())
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        for step in range(layout.size):
            src = (layout.rank - step) % layout.size
            backward_step(do, q, out, lse, dq, k, v, dk, dv, layout, src, scale, kernel)
            (k, v), (dk, dv) = backward_hop(step, layout, [k, v], [dk, dv])
        K = k.shape[1]
        unflat = lambda x, H, dt: x.view(B, L, H, D).transpose(1, 2).to(dt)  # noqa: E731
        return (
            unflat(dq, N, q.dtype),
            unflat(dk, K, k.dtype),
            unflat(dv, K, v.dtype),
            None,
            None,
            None,
        )


def ring_flash_attention(
    q_BNLD, k_BKLD, v_BKLD, layout: CPShards, scale: float, kernel: BlockKernel | None = None
):
    return RingFlashAttention.apply(
        q_BNLD, k_BKLD, v_BKLD, layout, scale, kernel or cuda_block_kernel()
    )

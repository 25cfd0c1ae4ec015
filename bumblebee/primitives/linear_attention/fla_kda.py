"""The per-channel gated delta rule (Kimi Delta Attention) on CUDA through flash-linear-attention's
``fla.ops.kda.chunk_kda``, behind the ``linear_attention`` contract of ``gated_delta_rule.py``.

``chunk_kda`` (fla-core, Triton) takes q, k [1, S, H, K], v [1, S, H, V], the per-channel log
decays g [1, S, H, K] (``use_gate_in_kernel=False``: g is the finished decay, as bumblebee's
mixer computes it), write strengths beta [1, S, H], ``scale``, one ``initial_state`` per
sequence [N, H, K, V], ``use_qk_l2norm_in_kernel`` and packed sequences as ``cu_seqlens`` (int64
[N + 1]) with its host copy ``cu_seqlens_cpu`` (so the kernel derives its chunk list without
reading the device), and returns o and (``output_final_state``) one final state per sequence.
This adapter is written from that documented signature and is exercised on CPU against
``reference_chunk_kda``, the same contract in plain PyTorch, and with FLA's ``chunk_kda`` itself
run through Triton's interpreter (``tests/unit/test_real_kernels.py``).

The glue mirrors ``fla.py``'s for the scalar gate: rows laid back to back, a row's carried state
placed on its first document, the final state of its last document picked out, and the
documents that need no state run in a second call without any (no per-document [H, K, V]
fp32 state for many short documents). FLA's chunk_kda is an ``autograd.Function`` and is
called directly (no custom op around it: fake-tensor rehearsals of this path are not
supported). In the emulated-CUDA mode (``primitives/emulation.py``) the reference stands in (FLA's
kernel itself, through Triton's interpreter, with ``real_kernels``).

Legend: B batch, T tokens, H heads, K key dim, V value dim, S = B*T, N documents.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from bumblebee.primitives.external_calls import CHUNK_KDA
from bumblebee.primitives.kernel_region import kernel as region
from bumblebee.primitives.linear_attention.fla import _groups
from bumblebee.primitives.packed import DocLayout, to_device

# FLA's chunk_kda per call, for the launch counter: l2norm q, l2norm k, gate cumsum, intra-chunk
# (Akk, Aqk), solve, w/u, state pass, output (an estimate from its source layout, not counted on
# a GPU)
FLA_KDA_FWD = ("fla chunk_kda fwd", 8, 0)


class _ShapesOnly(torch.autograd.Function):
    """``chunk_kda`` on fake tensors (the planner's dry run): its outputs' shapes, its inputs kept
    for backward as FLA's autograd.Function keeps them, input-shaped gradients. FLA's own
    intermediates (chunk cumsum, intra-chunk A matrices: ~[S, H, 64] fp32 each) are not modelled."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cu, final):
        ctx.save_for_backward(q, k, v, g, beta)
        ctx.h0 = h0
        H, K, V = q.shape[2], q.shape[3], v.shape[-1]
        ht = v.new_empty(cu.shape[0] - 1, H, K, V, dtype=torch.float32) if final else None
        return torch.empty_like(v), ht

    @staticmethod
    def backward(ctx, do, dht):
        grads = [torch.empty_like(x) for x in ctx.saved_tensors]
        return (*grads, None if ctx.h0 is None else torch.empty_like(ctx.h0), None, None)


def _shapes_only(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                 **unused):  # fmt: skip
    return _ShapesOnly.apply(q, k, v, g, beta, initial_state, cu_seqlens, output_final_state)


def _kernel(x):
    from bumblebee.primitives import emulation

    if is_fake(x) or x.device.type == "meta":
        return _shapes_only
    # the CUDA branch on CPU: the kernel's contract in plain PyTorch (FLA's own kernel, through
    # Triton's interpreter, under emulate_cuda(real_kernels=True))
    if emulation.active() and not emulation.real_kernels():
        return reference_chunk_kda
    return CHUNK_KDA.load()


class _Plan:
    """``fla._groups`` as device tensors plus host cu_seqlens, built once per layout and device."""

    def __init__(self, layout: DocLayout, dev):
        (edge_idx, edge_cu), (mid_idx, mid_cu), first, last = _groups(layout)
        self.edge_docs = len(edge_cu) - 1
        self.edge_cu_cpu = torch.tensor(edge_cu, dtype=torch.long)
        self.edge_cu, self.first, self.last = (to_device(x, dev) for x in (edge_cu, first, last))
        self.edge = self.mid = self.mid_cu = self.mid_cu_cpu = self.order = None
        if mid_idx:
            self.edge, self.mid, self.mid_cu = (
                to_device(x, dev) for x in (edge_idx, mid_idx, mid_cu)
            )
            self.mid_cu_cpu = torch.tensor(mid_cu, dtype=torch.long)
            self.order = torch.empty(len(edge_idx) + len(mid_idx), dtype=torch.long, device=dev)
            self.order[torch.cat([self.edge, self.mid])] = torch.arange(
                self.order.numel(), device=dev
            )


def fla_kda(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, layout: DocLayout, initial_state=None,
            kernel=None):  # fmt: skip
    """The ``linear_attention`` contract with a per-channel gate through ``chunk_kda`` (``kernel``:
    a callable with its signature; None: FLA's, or the reference when emulating)."""
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    if k_BTHK.shape[2] != v_BTHV.shape[2]:
        raise ValueError("fla_kda: key heads must equal value heads (KDA has no grouped keys)")
    dev = q_BTHK.device
    plan = layout.cached("fla_kda_plan", dev, lambda: _Plan(layout, dev))
    kernel = kernel or _kernel(q_BTHK)
    flat = lambda x: x.reshape((1, B * T) + tuple(x.shape[2:]))  # noqa: E731
    xs = [flat(q_BTHK), flat(k_BTHK), flat(v_BTHV.to(q_BTHK.dtype)), flat(g_BTHK.float()),
          flat(beta_BTH.to(q_BTHK.dtype))]  # fmt: skip

    def run(xs, h0, cu, cu_cpu, final):
        with region(*FLA_KDA_FWD):
            return CHUNK_KDA.call(kernel, *xs, scale=K**-0.5, initial_state=h0, output_final_state=final,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)  # fmt: skip

    h0, one_doc = None, plan.edge_docs == B  # one_doc: each row one document, states as given
    if initial_state is not None and one_doc:
        h0 = initial_state.float().contiguous()
    elif initial_state is not None:
        h0 = torch.zeros(plan.edge_docs, H, K, V, dtype=torch.float32, device=dev)
        h0 = h0.index_copy(0, plan.first, initial_state.float())
    if plan.mid is None:  # every document is an edge document: one call in token order
        o, ht = run(xs, h0, plan.edge_cu, plan.edge_cu_cpu, True)
    else:
        o_edge, ht = run([x.index_select(1, plan.edge) for x in xs], h0, plan.edge_cu,
                         plan.edge_cu_cpu, True)  # fmt: skip
        o_mid, _ = run([x.index_select(1, plan.mid) for x in xs], None, plan.mid_cu,
                       plan.mid_cu_cpu, False)  # fmt: skip
        o = torch.cat([o_edge, o_mid], 1).index_select(1, plan.order)
    return o.reshape(B, T, H, V).to(v_BTHV.dtype), (ht if one_doc else ht[plan.last]).float()


def reference_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None,
                        **unused):  # fmt: skip
    """``chunk_kda``'s contract (``use_gate_in_kernel=False``), token by token in fp32: the glue's
    test double and the emulated-CUDA stand-in. ``cu_seqlens_cpu`` must equal ``cu_seqlens``."""
    B, S, H, K = q.shape
    assert unused.get("use_gate_in_kernel") in (None, False), "g must be the finished decay"
    assert cu_seqlens is None or B == 1, "FLA wants batch 1 with cu_seqlens"
    if cu_seqlens_cpu is not None:
        assert cu_seqlens is not None and cu_seqlens_cpu.tolist() == cu_seqlens.tolist()
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * scale
    cu = cu_seqlens.tolist() if cu_seqlens is not None else [i * S for i in range(B + 1)]
    q, k, v, g, beta = (x.reshape((1, B * S) + tuple(x.shape[2:])) for x in (q, k, v, g, beta))
    outs, finals = [], []
    for i in range(len(cu) - 1):
        state = (
            initial_state[i].float()
            if initial_state is not None
            else torch.zeros(H, K, v.shape[-1], device=v.device)
        )
        for t in range(cu[i], cu[i + 1]):
            state = state * g[0, t].exp()[:, :, None]  # per key channel
            pred = torch.einsum("hk,hkv->hv", k[0, t], state)
            state = state + k[0, t][:, :, None] * ((v[0, t] - pred) * beta[0, t][:, None])[:, None]
            outs.append(torch.einsum("hk,hkv->hv", q[0, t], state))
        finals.append(state)
    o = torch.stack(outs)[None].reshape(v.shape[0], -1, H, v.shape[-1])
    o = o.reshape(B, S, H, -1) if cu_seqlens is None else o
    return o.to(out_dtype), (torch.stack(finals) if output_final_state else None)

"""The gated delta rule on CUDA through flash-linear-attention (FLA), behind the
``linear_attention`` contract of ``gated_delta_rule.py``.

``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (fla-core, Triton; ``pip install -e
".[gpu]"``) takes q, k [1, S, G, K], v [1, S, H, V] (H a multiple of G: value head i reads
key head i // (H/G), our convention), log decays g and write strengths beta [1, S, H],
``cu_seqlens`` (int64 [docs + 1]) for packed sequences, one ``initial_state`` per sequence
[docs, H, K, V], and returns o and (``output_final_state``) one final state per sequence.
``use_qk_l2norm_in_kernel=True`` with ``scale = K^-1/2`` is the normalization of the
PyTorch paths.

The glue here: rows laid back to back, document boundaries from the layout's host ints,
the row's carried state placed on its first document (every later document starts from
zero), and the final state of each row's last document picked out. Only those edge documents
get states (the others run in a second call without any), so packing many short documents
costs no per-document [H, K, V] fp32 tensors. On CUDA the kernel runs
inside the custom op ``bumblebee::fla_gdn`` (``register_fake`` gives fake-tensor runs its
shapes; its backward re-runs FLA's forward under autograd, so the op saves only its inputs;
that inner autograd is why the op is not ``torch.compile``-able, which bumblebee never asks). Tests
pass ``kernel=reference_chunk_gated_delta_rule``: FLA's
signature and semantics in plain PyTorch.

Legend: B batch, T tokens, G key heads, H value heads, K key dim, V value dim, S = B*T,
N documents.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from bumblebee.primitives.external_calls import CHUNK_GATED_DELTA_RULE
from bumblebee.primitives.kernel_region import kernel as region
from bumblebee.primitives.packed import DocLayout, to_device
from bumblebee.primitives.recompute_scope import in_recompute

# What one call of FLA's chunk_gated_delta_rule (fla-core, use_qk_l2norm_in_kernel, cu_seqlens and
# chunk_indices given) launches, for the launch counter (primitives/kernel_region.py). Forward:
# l2norm q, l2norm k, gate cumsum, kkt + solve, w/u, state pass, output = 7 Triton kernels.
# Backward: w/u, state pass, local dv, dh pass, dq/dk/dw/dg, WY backward, reverse cumsum, 2
# l2norm backwards = 9. Without chunk_indices FLA would build them per call from cu_seqlens
# (~6 small ops and a host read: repeat_interleave on device counts).
FLA_FWD = ("fla chunk_gated_delta_rule fwd", 7, 0)
FLA_BWD = ("fla chunk_gated_delta_rule bwd", 9, 0)
CHUNK = 64  # FLA's chunk size for the gated delta rule and the causal conv (their default)


def fla_chunk_indices(cu: list[int], chunk: int = CHUNK) -> list[list[int]]:
    """FLA's ``prepare_chunk_indices`` from host ints: (sequence, chunk within it) per chunk."""
    return [[n, i] for n in range(len(cu) - 1) for i in range(-(-(cu[n + 1] - cu[n]) // chunk))]


def doc_plan(layout: DocLayout) -> tuple[list[int], list[int], list[int]]:
    """(cu_seqlens of the rows laid back to back, index of each row's first document, of its last)."""
    T, cu, first, last = layout.seq_len, [], [], []
    for b, bounds in enumerate(layout.bounds):
        first.append(len(cu))
        cu.extend(b * T + s for s in bounds[:-1])
        last.append(len(cu) - 1)
    cu.append(len(layout.bounds) * T)
    return cu, first, last


def _fla_kernel(q, k, v, g, beta, initial_state, cu_seqlens, chunk_idx, scale, final_state):
    from bumblebee.primitives import emulation

    # the CUDA branch on CPU: the kernel's contract in plain PyTorch (FLA's own kernel, on the CPU
    # tensors through Triton's interpreter, under emulate_cuda(real_kernels=True))
    if emulation.active() and not emulation.real_kernels():
        chunk_gated_delta_rule = reference_chunk_gated_delta_rule
    else:
        chunk_gated_delta_rule = CHUNK_GATED_DELTA_RULE.load()

    # autocast off: the op's body runs with autocast excluded when a dispatch mode (the memory
    # tracker) handles the op, and enabled when a checkpoint's recompute calls it directly
    # (_Recomputed); a pinned state makes the forward, the recompute and the backward's re-run one
    # computation, so the recompute routes the MoE after it as the forward did
    off = torch.autocast(q.device.type, enabled=False)
    with region(*FLA_FWD), off:  # counted as FLA's kernels, whatever stands in for them
        return CHUNK_GATED_DELTA_RULE.call(
            chunk_gated_delta_rule,
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=final_state,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_seqlens,
            chunk_indices=chunk_idx,
        )


@torch.library.custom_op("bumblebee::fla_gdn", mutates_args=())
def fla_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    chunk_idx: torch.Tensor,
    scale: float,
    final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        o, ht = _fla_kernel(
            q, k, v, g, beta, initial_state, cu_seqlens, chunk_idx, scale, final_state
        )
    return o, (ht if final_state else v.new_empty(0, dtype=torch.float32))


@fla_gdn.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, chunk_idx, scale, final_state):
    H, V = v.shape[-2:]
    states = (cu_seqlens.shape[0] - 1) if final_state else 0
    return torch.empty_like(v), v.new_empty(states, H, q.shape[-1], V, dtype=torch.float32)


def _recompute_grads(
    do, dht, q, k, v, g, beta, initial_state, cu_seqlens, chunk_idx, scale, final_state
):
    """Input gradients by re-running the kernel under autograd (FLA's kernel is an autograd.Function;
    its emulated stand-in, plain PyTorch ops). Runs at the autograd level, not inside a custom
    op: below the op's dispatch, plain PyTorch ops record no graph."""
    xs = [q, k, v, g, beta] + ([initial_state] if initial_state is not None else [])
    inputs = [x.detach().requires_grad_() for x in xs]
    h0 = inputs[5] if initial_state is not None else None
    # FLA's backward kernels; the forward re-run inside counts as a forward of its own
    with region(*FLA_BWD), torch.enable_grad():
        o, ht = _fla_kernel(*inputs[:5], h0, cu_seqlens, chunk_idx, scale, final_state)
        outs, grads_out = ((o, ht), (do, dht)) if final_state else ((o,), (do,))
        grads = torch.autograd.grad(outs, inputs, grads_out, allow_unused=True)
    return [torch.zeros_like(x) if d is None else d for x, d in zip(inputs, grads)]


@torch.library.custom_op("bumblebee::fla_gdn_backward", mutates_args=())
def fla_gdn_backward(
    do: torch.Tensor,
    dht: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    chunk_idx: torch.Tensor,
    scale: float,
    final_state: bool,
) -> list[torch.Tensor]:
    """The backward as an op of its own: fake-tensor rehearsals (benchmarks/rehearsal.py) get its shapes."""
    return _recompute_grads(
        do, dht, q, k, v, g, beta, initial_state, cu_seqlens, chunk_idx, scale, final_state
    )


@fla_gdn_backward.register_fake
def _(do, dht, q, k, v, g, beta, initial_state, cu_seqlens, chunk_idx, scale, final_state):
    xs = [q, k, v, g, beta] + ([initial_state] if initial_state is not None else [])
    return [torch.empty_like(x) for x in xs]


def _save(ctx, q, k, v, g, beta, h0, cu, chunk_idx, scale, final_state, handle):
    """What the op keeps for backward, the same in the forward and in a checkpoint's recompute
    (``_Recomputed``): the inputs and a ``handle``, an empty tensor that the recompute's may carry
    the kernel's own autograd graph on (``bb_graph``)."""
    ctx.has_h0 = h0 is not None
    saved = (q, k, v, g, beta, cu, chunk_idx, *([h0] if ctx.has_h0 else []), handle)
    ctx.save_for_backward(*saved)
    ctx.scale, ctx.final_state = scale, final_state


def _setup(ctx, inputs, output):
    _save(ctx, *inputs, inputs[0].new_empty(0))


def _backward(ctx, do, dht):
    q, k, v, g, beta, cu, chunk_idx, *h0, handle = ctx.saved_tensors
    h0 = h0[0] if ctx.has_h0 else None
    graph = getattr(handle, "bb_graph", None)
    if graph is not None:  # the recompute ran the kernel under autograd: its backward only
        del handle.bb_graph
        inputs, outs = graph
        outs, grads_out = (outs, (do, dht)) if ctx.final_state else (outs[:1], (do,))
        with region(*FLA_BWD):
            grads = torch.autograd.grad(outs, inputs, grads_out, allow_unused=True)
        grads = [torch.zeros_like(x) if d is None else d for x, d in zip(inputs, grads)]
        return (*grads[:5], grads[5] if ctx.has_h0 else None, None, None, None, None)
    args = (do.contiguous(), dht.contiguous(), q, k, v, g, beta, h0, cu, chunk_idx)
    args += (ctx.scale, ctx.final_state)
    fake = (
        is_fake(q) or q.device.type == "meta"
    )  # a rehearsal: the op's fake kernel gives the shapes
    if fake:  # the op stands for FLA's forward re-run and its backward kernels
        with region(*FLA_BWD), region(*FLA_FWD):
            grads = torch.ops.bumblebee.fla_gdn_backward(*args)
    else:
        grads = _recompute_grads(*args)
    return (*grads[:5], grads[5] if ctx.has_h0 else None, None, None, None, None)


fla_gdn.register_autograd(_backward, setup_context=_setup)


class _Recomputed(torch.autograd.Function):
    """The op inside a checkpoint's recompute (``recompute_scope.in_recompute()``): FLA's forward
    runs under autograd and its graph rides on the saved handle, so the op's backward runs FLA's
    backward kernels without a third forward. It saves exactly what the op saves (a non-reentrant
    checkpoint matches the recompute's saved tensors one by one against the first forward's); the
    kernel's own saved tensors go through identity hooks, outside the checkpoint's matching."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, cu, chunk_idx, scale, final_state):
        xs = [q, k, v, g, beta] + ([h0] if h0 is not None else [])
        inputs = [x.detach().requires_grad_() for x in xs]
        h0_in = inputs[5] if h0 is not None else None
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with hooks, torch.enable_grad():
            o, ht = _fla_kernel(*inputs[:5], h0_in, cu, chunk_idx, scale, final_state)
        handle = q.new_empty(0)
        handle.bb_graph = (inputs, (o, ht) if final_state else (o,))
        _save(ctx, q, k, v, g, beta, h0, cu, chunk_idx, scale, final_state, handle)
        ht = ht if final_state else v.new_empty(0, dtype=torch.float32)
        return o.detach(), ht.detach()

    @staticmethod
    def backward(ctx, do, dht):  # never reached: the first forward's graph runs the backward
        raise RuntimeError("fla_gdn: the recompute's graph is not differentiated")


def fla_gdn_op(q, k, v, g, beta, h0, cu, chunk_idx, scale: float, final_state: bool):
    """``bumblebee::fla_gdn``, or inside a checkpoint's recompute ``_Recomputed`` (FLA forward twice
    per layer under full recompute: the forward and the recompute; not three times)."""
    args = (q, k, v, g, beta, h0, cu, chunk_idx, scale, final_state)
    fake = is_fake(q) or q.device.type == "meta"
    if in_recompute() and torch.is_grad_enabled() and not fake:
        return _Recomputed.apply(*args)
    with region(*FLA_FWD):  # the region around the op: a launch counter does not see inside it
        return torch.ops.bumblebee.fla_gdn(*args)


def _groups(layout: DocLayout):
    """The documents that need a state in or out (each row's first: the carried state; its last: the
    returned one) and the rest, each as (token index [S_group], cu_seqlens, row -> document slot).
    One fp32 [H, K, V] state per document would be ~4 MiB per document at Qwen3.5's dims under
    CP; with many short documents only the <= 2B edge documents get one."""
    cu, first, last = doc_plan(layout)
    edge = sorted(set(first) | set(last))
    middle = [d for d in range(len(cu) - 1) if d not in set(edge)]

    def pack(docs):
        idx, bounds = [], [0]
        for d in docs:
            idx.extend(range(cu[d], cu[d + 1]))
            bounds.append(len(idx))
        return idx, bounds

    slot = {d: i for i, d in enumerate(edge)}
    return pack(edge), pack(middle), [slot[d] for d in first], [slot[d] for d in last]


def fla_gated_delta_rule(
    q_BTGK, k_BTGK, v_BTHV, g_BTH, beta_BTH, layout: DocLayout, initial_state=None, kernel=None
):
    """The ``linear_attention`` contract through FLA's chunk kernel (``kernel``: a callable with
    ``chunk_gated_delta_rule``'s signature; None: the ``bumblebee::fla_gdn`` op over FLA). Rows
    holding more than two documents take two kernel calls: the edge documents with states, the
    others without (their tokens gathered; the outputs put back in order)."""
    B, T, G, K = q_BTGK.shape
    H, V = v_BTHV.shape[2:]
    dev = q_BTGK.device
    plan = layout.cached("fla_plan", dev, lambda: _DevicePlan(layout, dev))
    flat = lambda x: x.reshape((1, B * T) + tuple(x.shape[2:]))  # noqa: E731
    # one dtype for q, k, v (the CP probe hands fp32 values [v | 0]; the zeros are exact in bf16)
    xs = [
        flat(q_BTGK),
        flat(k_BTGK),
        flat(v_BTHV.to(q_BTGK.dtype)),
        flat(g_BTH.float()),
        flat(beta_BTH.to(q_BTGK.dtype)),
    ]

    def run(xs, h0, cu_t, idx_t, final):
        if kernel is None:
            return fla_gdn_op(*xs, h0, cu_t, idx_t, K**-0.5, final)
        return kernel(
            *xs,
            scale=K**-0.5,
            initial_state=h0,
            output_final_state=final,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_t,
            chunk_indices=idx_t,
        )

    h0, one_doc = None, plan.edge_docs == B  # one_doc: each row one document, states as given
    if initial_state is not None and one_doc:
        h0 = initial_state.float().contiguous()
    elif initial_state is not None:
        h0 = torch.zeros(plan.edge_docs, H, K, V, dtype=torch.float32, device=dev)
        h0 = h0.index_copy(0, plan.first, initial_state.float())
    if plan.mid is None:  # every document is an edge document: one call in token order
        o, ht = run(xs, h0, plan.edge_cu, plan.edge_idx, True)
    else:
        edge = [x.index_select(1, plan.edge) for x in xs]
        o_edge, ht = run(edge, h0, plan.edge_cu, plan.edge_idx, True)
        mid = [x.index_select(1, plan.mid) for x in xs]
        o_mid, _ = run(mid, None, plan.mid_cu, plan.mid_idx, False)
        o = torch.cat([o_edge, o_mid], 1).index_select(1, plan.order)
    return o.reshape(B, T, H, V).to(v_BTHV.dtype), (ht if one_doc else ht[plan.last]).float()


class _DevicePlan:
    """``_groups`` as device tensors, built once per layout and device (every GDN layer, its
    recompute and its backward share them: no host-to-device copy per call)."""

    def __init__(self, layout: DocLayout, dev):
        (edge_idx, edge_cu), (mid_idx, mid_cu), first, last = _groups(layout)
        self.edge_docs = len(edge_cu) - 1
        self.edge_cu, self.first, self.last = (to_device(x, dev) for x in (edge_cu, first, last))
        # FLA's chunk indices, once per layout (FLA would derive them per call, with a host read)
        self.edge_idx = to_device(fla_chunk_indices(edge_cu), dev)
        self.edge = self.mid = self.mid_cu = self.mid_idx = self.order = None
        if mid_idx:
            self.edge, self.mid, self.mid_cu = (
                to_device(x, dev) for x in (edge_idx, mid_idx, mid_cu)
            )
            self.mid_idx = to_device(fla_chunk_indices(mid_cu), dev)
            self.order = torch.empty(len(edge_idx) + len(mid_idx), dtype=torch.long, device=dev)
            self.order[torch.cat([self.edge, self.mid])] = torch.arange(
                self.order.numel(), device=dev
            )


def reference_chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    chunk_indices=None,
    **unused,
):
    """``chunk_gated_delta_rule``'s contract, token by token in fp32 (tests of the glue only);
    ``chunk_indices``, when given, must be what FLA derives from ``cu_seqlens`` (checked)."""
    B, S, G, K = q.shape
    H, V = v.shape[2:]
    assert cu_seqlens is None or B == 1, "FLA wants batch 1 with cu_seqlens"
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k = q.float(), k.float()
    if use_qk_l2norm_in_kernel:  # x / sqrt(sum x^2 + 1e-6), as FLA's l2norm
        q, k = (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q, k = q.repeat_interleave(H // G, 2) * scale, k.repeat_interleave(H // G, 2)
    v, g, beta = v.float(), g.float(), beta.float()
    cu = cu_seqlens.tolist() if cu_seqlens is not None else [i * S for i in range(B + 1)]
    if chunk_indices is not None:
        assert chunk_indices.tolist() == fla_chunk_indices(cu), "wrong chunk_indices"
    if cu_seqlens is None:
        q, k, v, g, beta = (x.reshape((1, B * S) + tuple(x.shape[2:])) for x in (q, k, v, g, beta))
    o = torch.zeros_like(v)
    finals = []
    for i in range(len(cu) - 1):
        state = (
            initial_state[i].float()
            if initial_state is not None
            else torch.zeros(H, K, V, device=v.device)
        )
        for t in range(cu[i], cu[i + 1]):
            state = state * g[0, t].exp()[:, None, None]
            pred = torch.einsum("hk,hkv->hv", k[0, t], state)
            state = (
                state + k[0, t][:, :, None] * ((v[0, t] - pred) * beta[0, t][:, None])[:, None, :]
            )
            o[0, t] = torch.einsum("hk,hkv->hv", q[0, t], state)
        finals.append(state)
    o = o.reshape(B, S, H, V) if cu_seqlens is None else o
    return o.to(out_dtype), (torch.stack(finals) if output_final_state else None)

"""Chunked expert-parallel overlap (slot ``moe_comm``, ``chunked``), valid under full recompute.

``alltoall`` runs dispatch -> expert GEMMs -> combine one after the other, so both
all-to-alls are exposed. Overlapping them across micro-batches (1F1B) does not
work under full recompute, the default here; splitting the local tokens of one
MoE layer into k chunks (``[primitives] moe_chunks``, 2..4) does. Per chunk c:
own count exchange, dispatch all-to-all, grouped GEMMs, combine all-to-all, all
issued asynchronously (gloo/CPU: ``async_op=True`` work handles; CUDA: a side
communication stream joined by events), in this order (the published chunked EP overlap schedule):

  forward   comm:    counts 0..k-1 | dispatch 0, 1, ..., k-1 | combine 0 | combine 1 ...
            compute:                 GEMM 0        | GEMM 1    | GEMM 2 ...
            (dispatch c+1 runs under GEMM c, combine c under GEMM c+1)
  backward  comm:    combine-bwd 0..k-1 | dispatch-bwd 0 | ... | dispatch-bwd k-1
            compute:   dgrad 0 | dgrad 1 | ... | dgrad k-1 | wgrad (all chunks)
            (expert weight gradients wait until after the last dgrad, so they
            overlap the tail dispatch-bwd)

Every rank takes part in every chunk's collectives, also with zero rows. The
whole layer is one ``autograd.Function`` (so the backward order is ours, not the
engine's), called once per layer inside ``Experts.forward`` through
``MoE._run_experts(schedule=...)``: FSDP2 gathers the expert weights once per
layer and reduce-scatters their gradients once. The SwiGLU maths is the one of
``experts.py``, with ``torch._grouped_mm`` where ``experts = grouped`` would use
it and the per-expert loop otherwise.

Router weights (gradient placement). The forward weights and sums the k choices
at home after the combine, exactly as ``alltoall``. Backward sends the
*unweighted* output gradient g and the router weight w of each row to the
experts; there dA' = g W_down (fc2 dgrad), grad w = <dA', a> (equal to <g, fc2(a)>
because fc2 is linear), dA = w dA', dW_down = g^T (w a). So nothing in backward
reads the expert output or the combined rows.

Full recompute. Under ``recompute = full`` (or ``selective`` with ``moe``) the
layer is re-run in backward only to re-create what autograd saved; the return
value of that run is discarded (``recompute_scope.in_recompute()``). What backward
reads is saved: router weights, W_gate_up, W_down and per chunk the row order,
the expert grouping, the fc1 input and fc1 output h. The recompute forward
therefore runs routing, count exchanges, dispatch and fc1, and skips (a) the
SwiGLU product and the fc2 GEMM (a is rebuilt from h in backward; fc2's output
feeds only the combine), (b) the combine all-to-all and (c) the weighted sum,
returning zeros [T, H] backed by one element. Safe because no saved tensor depends on
them and the models only add the MoE output to the residual (an add saves
nothing); the paired tests check gradients against ``alltoall`` under full.

Legend: T local tokens, H hidden, K choices per token, E experts, L local experts,
R ep ranks, N routed rows of a chunk at home (sorted by expert), M rows a chunk
brings to this rank's experts (grouped by local expert), F expert FFN, G = 2F.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from bumblebee.primitives import emulation
from bumblebee.primitives.moe.alltoall import regroup_by_expert
from bumblebee.primitives.moe.chunk_plan import chunk_bounds
from bumblebee.primitives.moe.costs import MoeCommCosts
from bumblebee.primitives.moe.experts import (
    GroupedGemms,
    experts_grouped,
    experts_loop,
    grouped_mm_supported,
)
from bumblebee.primitives.moe.local import combine_into, permute, unsort_rows
from bumblebee.primitives.moe.needs import EXCHANGES
from bumblebee.primitives.packed import to_device
from bumblebee.primitives.recompute_scope import host_read, in_recompute
from bumblebee.registry import Need, register

CHUNKS = (2, 3, 4)


class _Pending:
    """One all-to-all in flight; ``wait()`` orders the caller after it and returns its output."""

    def __init__(self, out, work=None, event=None, keep=None):
        self.out, self.work, self.event, self.keep = out, work, event, keep

    def wait(self) -> torch.Tensor:
        """Once only: drops every reference (the input may be freed only after this point, the
        output lives as long as the caller keeps it)."""
        out, work, event = self.out, self.work, self.event
        self.out = self.work = self.event = self.keep = None
        if work is not None:
            work.wait()
        if event is not None:
            emulation.current_stream(out.device).wait_event(event)
        return out


@dataclass
class _Comm:
    """Asynchronous ``all_to_all_single`` over the ep group (splits None: even split)."""

    group: object
    ep: int
    stream: object  # CUDA side stream, or None (work handles)

    def a2a(self, x: torch.Tensor, send=None, recv=None) -> _Pending:
        if self.ep == 1:
            return _Pending(x)
        x = x.contiguous()
        out = (
            torch.empty_like(x) if recv is None else x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        )
        if self.stream is None:
            work = dist.all_to_all_single(out, x, recv, send, group=self.group, async_op=True)
            return _Pending(out, work=work, keep=x)
        self.stream.wait_stream(emulation.current_stream(x.device))  # x is ready
        with emulation.use_stream(self.stream):
            dist.all_to_all_single(out, x, recv, send, group=self.group)
            event = emulation.new_event(x.device)
            event.record(self.stream)
        return _Pending(out, event=event, keep=x)


@dataclass
class _Setup:
    num_experts: int
    num_chunks: int
    comm: _Comm
    grouped: bool
    recompute: bool  # inside a recompute forward: skip what only the discarded output needs
    drops: bool = False  # capacity: ids == num_experts mark dropped pairs (cut by permute)
    weights: tuple | None = None  # token share of each chunk (chunk_plan.py); None: even


class _ChunkedExperts(torch.autograd.Function):
    """x_TH, weight_TK, W_gate_up, W_down -> y_TH for one MoE layer, in k chunks."""

    @staticmethod
    def forward(ctx, x_TH, weight_TK, w1_EGH, w2_EHF, idx_TK, s: _Setup):
        (T, K), H, ep = idx_TK.shape, x_TH.shape[1], s.comm.ep
        chunks = []  # per chunk: [lo, hi, order_N, send, recv, local, by_expert]
        for lo, hi in chunk_bounds(T, s.num_chunks, s.weights):
            order_N, counts_E = permute(idx_TK[lo:hi], s.num_experts, s.drops)
            chunks.append([lo, hi, order_N, counts_E])
        # every chunk's counts in one exchange and one device-to-host read (a read per chunk would
        # drain the stream once per chunk): sent [C, ep, L] destination-major, received [ep, C, L]
        n, L = len(chunks), s.num_experts // ep
        sent_CRL = torch.stack([c[3] for c in chunks]).view(n, ep, L)
        recv_RCL = s.comm.a2a(sent_CRL.transpose(0, 1).reshape(ep * n, L)).wait()
        # the recompute takes the forward's read (recompute_scope.host_read): one sync per layer
        host = host_read(torch.cat([sent_CRL.flatten(), recv_RCL.flatten()]))
        sent_CRL, recv_RCL = host[: n * ep * L].view(n, ep, L), host[n * ep * L :].view(ep, n, L)
        pending_x = []
        for i, c in enumerate(chunks):  # host-side splits of chunk i, then issue its dispatch
            with record_function(f"chunked.fwd.dispatch_issue{i}"):
                lo, hi, order_N = c[:3]
                recv_RL = recv_RCL[:, i]
                send, recv = sent_CRL[i].sum(1).tolist(), recv_RL.sum(1).tolist()
                by_expert = to_device(regroup_by_expert(recv_RL), x_TH.device)
                c[3:] = [send, recv, recv_RL.sum(0).tolist(), by_expert]
                pending_x.append(s.comm.a2a(x_TH[lo:hi][order_N // K], send, recv))
        saved, pending_y = [], []
        for i, (c, px) in enumerate(zip(chunks, pending_x)):
            lo, hi, order_N, send, recv, local, by_expert = c
            with record_function(f"chunked.fwd.dispatch_wait{i}"):
                x_recv = px.wait()
            with record_function(f"chunked.fwd.gemm{i}"):
                gemm = GroupedGemms(local, s.grouped, x_TH.device)
                x_MH = x_recv[by_expert]
                h_MG = gemm.fwd(x_MH, w1_EGH)
                saved += [order_N, by_expert, x_MH, h_MG]
                if s.recompute:  # fc2 and the combine feed only the discarded output
                    continue
                gate, up = h_MG.chunk(2, dim=-1)
                y_MH = gemm.fwd(F.silu(gate) * up, w2_EHF)
                y_recv = torch.empty_like(y_MH).index_copy_(0, by_expert, y_MH)
            pending_y.append(s.comm.a2a(y_recv, recv, send))
        ctx.save_for_backward(weight_TK, w1_EGH, w2_EHF, *saved)
        ctx.meta = [(c[0], c[1], c[3], c[4], c[5]) for c in chunks]  # lo, hi, send, recv, local
        ctx.setup, ctx.K = s, K
        if s.recompute:  # zeros backed by one element (not a view: FSDP2 warns about views)
            return torch.empty_strided((T, H), (0, 0), dtype=x_TH.dtype, device=x_TH.device).zero_()
        y_TH = x_TH.new_empty(T, H)
        for i, ((lo, hi, order_N, *_), py) in enumerate(zip(chunks, pending_y)):
            with record_function(f"chunked.fwd.combine_wait{i}"):
                y_back = py.wait()
            combine_into(y_TH[lo:hi], y_back, order_N, K, weight_TK[lo:hi])
        return y_TH

    @staticmethod
    def backward(ctx, g_TH):
        s, K = ctx.setup, ctx.K
        weight_TK, w1_EGH, w2_EHF, *saved = (
            ctx.saved_tensors
        )  # under checkpoint: recomputes the layer
        per_chunk = [saved[4 * i : 4 * i + 4] for i in range(len(ctx.meta))]
        need_x, need_w, need_w1, need_w2 = ctx.needs_input_grad[:4]
        g_TH, (T, H) = g_TH.contiguous(), g_TH.shape
        sent = []  # 1. combine-backward: unweighted output gradients (+ router weights) to the experts
        for (lo, hi, send, recv, _), (order_N, *_) in zip(ctx.meta, per_chunk):
            w_N = weight_TK[lo:hi].reshape(-1)[order_N].to(g_TH.dtype)
            sent.append(
                (s.comm.a2a(g_TH[lo:hi][order_N // K], send, recv), s.comm.a2a(w_N, send, recv))
            )
        later, back = [], []
        for i, ((_lo, _hi, send, recv, local), (_, by_expert, x_MH, h_MG), (pg, pw)) in enumerate(
            zip(ctx.meta, per_chunk, sent)
        ):
            with record_function(f"chunked.bwd.combine_wait{i}"):
                g_MH, w_M = pg.wait()[by_expert], pw.wait()[by_expert, None]
            with record_function(f"chunked.bwd.dgrad{i}"):  # 2. expert dgrad of chunk i
                gemm = GroupedGemms(local, s.grouped, g_TH.device)
                gate, up = h_MG.chunk(2, dim=-1)
                sig, silu = torch.sigmoid(gate), F.silu(gate)
                dA_MF = gemm.dgrad(g_MH, w2_EHF)  # unweighted: g W_down
                dw_M = (dA_MF * (silu * up)).sum(-1)  # router-weight gradient <g, fc2(a)>
                dA_MF = dA_MF * w_M
                dh_MG = torch.cat([dA_MF * up * sig * (1 + gate * (1 - sig)), dA_MF * silu], dim=-1)
                dx_MH = gemm.dgrad(dh_MG, w1_EGH)
                later.append((gemm, x_MH, h_MG, dh_MG, g_MH, w_M))  # a is rebuilt from h for wgrad
                dx_recv = torch.empty_like(dx_MH).index_copy_(0, by_expert, dx_MH)
                dw_recv = torch.empty_like(dw_M).index_copy_(0, by_expert, dw_M)
            back.append((s.comm.a2a(dx_recv, recv, send), s.comm.a2a(dw_recv, recv, send)))
        dw1 = dw2 = None
        with record_function("chunked.bwd.wgrad"):  # 3. delayed wgrad, under the tail dispatch-bwd
            while later:
                gemm, x_MH, h_MG, dh_MG, g_MH, w_M = later.pop(0)
                if need_w1:
                    dw1 = gemm.wgrad(dh_MG, x_MH) if dw1 is None else dw1 + gemm.wgrad(dh_MG, x_MH)
                if need_w2:
                    gate, up = h_MG.chunk(2, dim=-1)
                    aw_MF = F.silu(gate) * up * w_M  # dW_down = g^T (w a)
                    dw2 = gemm.wgrad(g_MH, aw_MF) if dw2 is None else dw2 + gemm.wgrad(g_MH, aw_MF)
        dx_TH, dweight_TK = g_TH.new_empty(T, H), torch.empty_like(weight_TK)
        for i, ((lo, hi, *_), (order_N, *_), (px, pw)) in enumerate(zip(ctx.meta, per_chunk, back)):
            with record_function(f"chunked.bwd.dispatch_wait{i}"):  # 4. back home, sum over choices
                dx_N, dw_N = px.wait(), pw.wait()
            inv_N = combine_into(dx_TH[lo:hi], dx_N, order_N, K)  # sum over choices
            if inv_N is not None:  # the fused path's inverse permutation: a gather, no copy
                torch.index_select(dw_N, 0, inv_N, out=dweight_TK[lo:hi].view(-1))
            else:
                dweight_TK[lo:hi] = unsort_rows(dw_N, order_N, (hi - lo) * K).view(hi - lo, K)
        return (dx_TH if need_x else None, dweight_TK if need_w else None, dw1, dw2, None, None)


@register(
    "moe_comm",
    "chunked",
    summary="k token chunks; async dispatch/combine under the expert GEMMs",
    needs=(
        EXCHANGES,
        Need(
            "plain SwiGLU experts (this model's experts have biases and another GLU): use "
            "'alltoall' (ep > 1) or 'local'",
            lambda f: not f.moe_bias,
            layout=False,
        ),
        Need(
            "primitives.moe_chunks of 2, 3 or 4 (got {prims.moe_chunks})",
            lambda f: f.prims.moe_chunks in (2, 3, 4),
            layout=False,
        ),
        # the overlap's recompute ordering is validated under full (or no) recompute only
        Need(
            "full recompute or none (validated under those only)",
            lambda f: f.prims.recompute != "selective",
            plan_only=True,
        ),
    ),
    options=("moe_chunk_weights",),
    costs=MoeCommCosts(
        # backward: its peak is the first delayed wgrad (every chunk's g and dh, the last chunk's
        # dgrad locals, dx sent and received; fc1's weight gradient); "bwd_wgrad": the second one
        # (the first chunk's g and dh freed; fc1's gradient summed: dw1 + new -> sum, fc2's)
        routed=lambda c, last: {
            "fwd": (((1 + 1 / c, 0), (2 + 2 / c, 2)),),
            "recompute": (((1, 0), (1, 2 / c)),),
            "bwd": (((1, 0), (3 + 1 / c, 4 + 5 / c)),),
            "bwd_wgrad": (((1, 0), (3, 4 + 2 / c)),),
        },
        overlap="chunks",
        # its recompute skips fc2 and the combine: the dispatch's all-to-all only
        recompute_exchanges=1,
        # the first delayed wgrad holds fc1's; the second sums fc1's over chunks beside fc2's
        expert_grads=lambda fc1, fc2, phase: fc1 if phase == "bwd" else 3 * fc1 + fc2,
        searched=({"moe_chunks": 2}, {"moe_chunks": 4}),
        preference=1,
        label=lambda p: f"chunkedx{p.moe_chunks}",
        baseline="alltoall",
        explain="chunked x{prims.moe_chunks}: hides dispatch/combine under expert GEMMs "
        "({gain:+.1%} tok/s vs plain all-to-all)",
    ),
)
class ChunkedDispatch:
    """``chunk_weights``: [] (even chunks), one list of ``num_chunks`` positive token shares for
    every MoE layer, or one list (2-4 shares) per MoE layer in order (``for_layer``)."""

    def __init__(
        self,
        num_experts: int,
        ep_group=None,
        num_chunks: int = 2,
        chunk_weights=(),
        ep_size: int | None = None,
        **_unused,
    ):
        from bumblebee.config import ConfigError  # lazily, as registry.get does

        if isinstance(num_chunks, bool) or num_chunks not in CHUNKS:
            raise ConfigError(
                f"primitives.moe_chunks must be 2, 3 or 4 with moe_comm = 'chunked', got "
                f"{num_chunks!r}"
            )
        self.num_experts, self.num_chunks, self.group = num_experts, num_chunks, ep_group
        per_layer = bool(chunk_weights) and all(isinstance(w, list | tuple) for w in chunk_weights)
        # the lists to check: one per MoE layer, the one shared list, or none (even chunks)
        lists = chunk_weights if per_layer else [chunk_weights] if chunk_weights else []
        for w in lists:
            ok = all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in w)
            if not ok or len(w) not in CHUNKS or (not per_layer and len(w) != num_chunks):
                raise ConfigError(
                    f"primitives.moe_chunk_weights: {list(chunk_weights)!r} must be [] (even), "
                    f"{num_chunks} positive numbers (moe_chunks) or one list of 2-4 positive "
                    "numbers per MoE layer"
                )
        self.per_layer = [tuple(w) for w in chunk_weights] if per_layer else None
        self.weights = tuple(chunk_weights) if chunk_weights and not per_layer else None
        self.ep = ep_size or (1 if ep_group is None else dist.get_world_size(ep_group))
        if num_experts % self.ep:
            raise ValueError(
                f"num_experts ({num_experts}) must be divisible by the ep group size ({self.ep})"
            )
        self._streams = {}  # device -> CUDA communication stream

    def for_layer(self, j: int, layers: int) -> ChunkedDispatch:
        """The dispatcher of MoE layer ``j`` of ``layers``: this one, or with that layer's
        chunk weights (streams shared)."""
        if self.per_layer is None:
            return self
        if len(self.per_layer) != layers:
            from bumblebee.config import ConfigError

            raise ConfigError(
                f"primitives.moe_chunk_weights has {len(self.per_layer)} per-layer lists; the model "
                f"has {layers} MoE layers"
            )
        out = copy.copy(self)
        out.weights, out.num_chunks, out.per_layer = self.per_layer[j], len(self.per_layer[j]), None
        return out

    def __call__(
        self,
        x_TH: torch.Tensor,
        idx_TK: torch.Tensor,
        weight_TK: torch.Tensor,
        expert_fn,
        drops: bool = False,
    ) -> torch.Tensor:
        if "schedule" not in inspect.signature(expert_fn).parameters:
            raise ValueError(
                "moe_comm = 'chunked' schedules the expert GEMMs itself and needs an expert_fn "
                "accepting schedule= (the MoE block's _run_experts)"
            )
        schedule = functools.partial(
            self._schedule, idx_TK=idx_TK, weight_TK=weight_TK, drops=drops
        )
        return expert_fn(x_TH, None, schedule=schedule)

    def _schedule(
        self,
        x_TH,
        _counts,
        w_gate_up_EGH,
        w_down_EHF,
        *,
        idx_TK,
        weight_TK,
        expert_fn,
        drops=False,
        bias=None,
        act=None,
    ):
        """Runs inside ``Experts.forward`` with the (gathered) weights of this rank's experts."""
        if bias is not None or act is not None:
            raise ValueError(
                "moe_comm = 'chunked' runs plain SwiGLU experts without biases; these experts have "
                "biases or another GLU: use moe_comm = 'alltoall' or 'local'"
            )
        if expert_fn is experts_loop:
            grouped = False
        elif expert_fn is experts_grouped:
            grouped = grouped_mm_supported(x_TH)
        else:
            raise ValueError(
                "moe_comm = 'chunked' runs the SwiGLU expert GEMMs itself (split dgrad / wgrad); "
                "it supports experts = 'loop' or 'grouped'"
            )
        stream = None
        if emulation.kind(x_TH) == "cuda" and self.ep > 1:
            if x_TH.device not in self._streams:
                self._streams[x_TH.device] = emulation.side_stream(x_TH.device)
            stream = self._streams[x_TH.device]
        setup = _Setup(
            self.num_experts,
            self.num_chunks,
            _Comm(self.group, self.ep, stream),
            grouped,
            recompute=in_recompute(),
            drops=drops,
            weights=self.weights,
        )
        dtype = x_TH.dtype  # the experts' compute dtype (Experts.forward applied autocast)
        return _ChunkedExperts.apply(
            x_TH, weight_TK, w_gate_up_EGH.to(dtype), w_down_EHF.to(dtype), idx_TK, setup
        )

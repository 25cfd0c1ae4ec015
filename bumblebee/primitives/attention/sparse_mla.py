"""MLA with DeepSeek Sparse Attention: a lightning indexer picks each query's top-k keys
(``primitives/attention/dsa.py`` holds the maths; this is the module around it).

Per layer: MLA's projections (``mla.py``, same parameter names) plus ``indexer``:

    qi = RoPE(wq_b(q_resid)) [Hi, Di]   (q_resid = MLA's normalized q latent, detached)
    ki = RoPE(LayerNorm(wk(x))) [Di]     one key per token, shared by the indexer heads
    w  = weights_proj(x) * Hi^-0.5       per-head weights of the query

RoPE covers the first R = qk_rope_head_dim dims of Di, half-split (DeepSeek-V3.2) or
interleaved pairs (``index_rope_interleave``, GLM-5). The indexer's inputs are detached, so
its parameters learn from the indexer KL loss only, and the main model never from it.

Training stages (``[primitives]``): ``dsa_stage = "dense_warmup"`` attends every allowed key
and trains the indexer toward the dense attention (the model freezes everything but the
indexers); ``"sparse"`` attends the top ``index_topk`` keys and trains the indexer over the
selected set. ``dsa_indexer_loss`` weighs the KL, summed over the forward's query tokens and
divided by the training step's global tokens (``step_tokens``, set by ``CausalLM.set_step_tokens``;
0: this forward's tokens, B x the row), as the step divides the LM loss: micro-batches, DP and CP
ranks each add their share of one mean. It enters through ``AddLoss``: a gradient, not a logged
loss term (the last per-forward mean is ``indexer_kl``). ``dsa_impl``: ``blockwise`` (default) or
``reference`` (dense [T, T]).

Under context parallelism the queries stay local and the keys are global: the indexer keys [Di]
of the row are all-gathered (``GatherSequence``), and the sparse stage fetches only the latent
rows [C + R] its queries selected from their owners (``dsa_cp.py``); the dense warm-up stage and
the reference core all-gather the latents too. The expanded per-head keys never travel.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from bumblebee.primitives.attention.dsa import AddLoss, _up, dsa_blockwise, dsa_reference
from bumblebee.primitives.attention.dsa_cp import dsa_fetched
from bumblebee.primitives.attention.mla import MultiHeadLatentAttention
from bumblebee.primitives.cp.allgather import GatherSequence
from bumblebee.primitives.cp.zigzag import CPShards
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.rope import apply_rope

STAGES, IMPLS = ("sparse", "dense_warmup"), ("blockwise", "reference")


class LightningIndexer(nn.Module):
    def __init__(self, hidden: int, q_lora_rank: int, heads: int, dim: int, rope: int, interleave):
        super().__init__()
        self.heads, self.dim, self.rope, self.interleave = heads, dim, rope, interleave
        self.wq_b = nn.Linear(q_lora_rank, heads * dim, bias=False)
        self.wk = nn.Linear(hidden, dim, bias=False)
        self.k_norm = nn.LayerNorm(dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)

    def _rope(self, x, cos, sin):
        if self.interleave:  # first R dims in (even, odd) pairs -> half-split
            r = self.rope
            x = torch.cat((x[..., 0:r:2], x[..., 1:r:2], x[..., r:]), dim=-1)
        return apply_rope(x, cos, sin)

    def forward(self, x_BTH, q_resid, cos, sin):
        """(qi [B, T, Hi, Di], ki [B, T, Di], w [B, T, Hi]) from detached inputs."""
        B, T, _ = x_BTH.shape
        x, q_resid = x_BTH.detach(), q_resid.detach()
        qi = self.wq_b(q_resid).view(B, T, self.heads, self.dim).transpose(1, 2)
        qi = self._rope(qi, cos, sin).transpose(1, 2)
        ki = self._rope(self.k_norm(self.wk(x))[:, None], cos, sin)[:, 0]
        w = _up(self.weights_proj(x)) * self.heads**-0.5
        return qi, ki, w


class SparseLatentAttention(MultiHeadLatentAttention):
    def __init__(
        self,
        hidden: int,
        heads: int,
        *,
        index_heads: int,
        index_dim: int,
        index_topk: int,
        index_rope_interleave: bool,
        stage: str = "sparse",
        impl: str = "blockwise",
        block: int = 128,
        loss_weight: float = 1.0,
        **mla,
    ):
        super().__init__(hidden, heads, **mla)
        if not self.q_lora_rank:
            raise ValueError(
                "DeepSeek Sparse Attention needs q_lora_rank > 0 (its indexer reads q)"
            )
        if stage not in STAGES or impl not in IMPLS or block < 1:
            raise ValueError(
                f"dsa_stage must be one of {STAGES}, dsa_impl one of {IMPLS} and dsa_block >= 1; "
                f"got {stage!r}, {impl!r}, {block}"
            )
        self.indexer = LightningIndexer(
            hidden, self.q_lora_rank, index_heads, index_dim, self.rope, index_rope_interleave
        )
        self.topk, self.stage, self.impl, self.block = index_topk, stage, impl, block
        self.loss_weight = loss_weight
        self.indexer_kl = None  # last forward's mean indexer KL (detached), for logs and tests
        # set by a model that freezes everything but the indexers (the dense warm-up stage): the
        # dense core's main attention then runs without a graph (the residual stream still
        # requires grad through AddLoss, and its per-head probabilities would be kept for a
        # gradient no parameter uses)
        self.main_frozen = False
        # tokens of the training step's global batch (``CausalLM.set_step_tokens``); 0: this
        # forward's tokens
        self.step_tokens = 0

    def forward(self, x_BTH, cos, sin, layout):
        if not isinstance(layout, (CPShards, DocLayout)):
            raise NotImplementedError(
                "K/V-cache decoding with DeepSeek Sparse Attention (an indexer-key cache) is not built"
            )
        B, T, _ = x_BTH.shape
        N, C = self.n_heads, self.kv_lora_rank
        q_resid = self.q_a_layernorm(self.q_a_proj(x_BTH))
        q_nope, q_rope = (
            self.q_b_proj(q_resid).view(B, T, N, self.head_dim).split([self.nope, self.rope], -1)
        )
        q_rope = self._rope(q_rope.transpose(1, 2), cos, sin).transpose(1, 2)
        c_kv, k_rope = self.latents(x_BTH)
        lat = torch.cat((c_kv, self._rope(k_rope, cos, sin)[:, 0]), dim=-1)  # [B, T, C + R]
        qi, ki, w = self.indexer(x_BTH, q_resid, cos, sin)
        w_kvb = self.kv_b_proj.weight.view(N, self.nope + self.v_dim, C)
        w_uk, w_uv = w_kvb.split([self.nope, self.v_dim], dim=1)
        q_abs = torch.cat((torch.einsum("btnd,ndc->btnc", q_nope, w_uk), q_rope), dim=-1)
        lat = lat.to(q_abs.dtype)
        dense = self.stage == "dense_warmup"
        if dense and self.main_frozen:
            q_abs, lat = q_abs.detach(), lat.detach()
        kw = dict(topk=self.topk, scale=self.scale, index_scale=self.indexer.dim**-0.5)
        kw.update(block=self.block, C=C)
        rows = layout.seq_len if isinstance(layout, CPShards) else T
        if isinstance(layout, CPShards):  # local queries, the row's keys in global order
            ki = GatherSequence.apply(ki[:, None], layout)[:, 0]
        if isinstance(layout, CPShards) and not dense and self.impl == "blockwise":
            # fetch only the selected latents from their owners (dsa_cp.py)
            core = functools.partial(dsa_fetched, layout=layout, **kw)
            args = (q_abs, lat, qi, ki, w)
        else:
            if isinstance(layout, CPShards):  # every key is read: all-gather the latents
                lat = GatherSequence.apply(lat[:, None], layout)[:, 0]
                qpos, doc_k = layout.index_L, layout.doc_BT
                doc_q = doc_k[:, qpos]
            else:
                qpos, doc_k = torch.arange(T, device=x_BTH.device), layout.doc_ids(x_BTH.device)
                doc_q = doc_k
            core = dsa_blockwise if self.impl == "blockwise" else dsa_reference
            core = functools.partial(core, dense=dense, **kw)
            args = (q_abs, lat, qi, ki, w, qpos, doc_q, doc_k)
        out = self.recompute.module("attn_core", core, *args)
        o_lat, kl = out[0], out[1]
        o = torch.einsum("btnc,nvc->btnv", o_lat, w_uv).reshape(B, T, N * self.v_dim)
        self.indexer_kl = (kl / (B * rows)).detach()
        if self.loss_weight and kl.requires_grad:  # this forward's share of the step's mean
            o = AddLoss.apply(o, kl * (self.loss_weight / (self.step_tokens or B * rows)))
        return self.o_proj(o)

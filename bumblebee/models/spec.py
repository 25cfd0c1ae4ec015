"""A model as arithmetic: parameter counts, per-layer shapes and FLOPs per token.

Each family's arch builds one (``arch.to_spec()``); the planner reads nothing else
about a model, and the runtime reads it for its own estimates, so there is one copy
of this arithmetic. The families today:

- ``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B): every layer is GQA attention
  with q/k RMSNorm, then a routed MoE (or a dense SwiGLU on ``mlp_only_layers``);
- ``qwen3_5_moe`` (Qwen3.5-35B-A3B, text part): ``layer_types`` mixes Gated
  DeltaNet ("linear_attention") and gated full attention (q_proj also emits a
  sigmoid output gate); every MLP is routed experts plus one shared expert with
  a sigmoid gate.
- ``deepseek_v3`` (DeepSeek-V3, Kimi-K2): every token mixer is Multi-head Latent
  Attention (``ATTN`` with ``mla_kv_rank > 0``: low-rank q / kv projections, decoupled
  rope dims, per-head value dim ``mla_v_dim``); the first layers are dense SwiGLU, the rest
  routed experts plus ungated shared experts (``shared_gate = False``).
- ``qwen3_next`` (Qwen3-Next-80B-A3B): Qwen3.5's hybrid (same parameter counts: its fused GDN
  projections hold the same weights), with HF's optional dense layers;
- ``kimi_linear`` (Kimi-Linear-48B-A3B): Kimi Delta Attention (``GDN`` with ``kda_gate_rank``:
  per-channel decay, low-rank decay / output gates) in a 3:1 hybrid with MLA without RoPE, and
  DeepSeek-V3's MLP pattern;
- ``glm4_moe`` (GLM-4.5 / 4.6 / 4.7, GLM-4.5-Air): GQA with q/k/v biases (``attn_bias``) and
  optional q/k norm (``qk_norm``), DeepSeek-V3's MLP pattern (dense first layers, routed +
  ungated shared experts).
- ``gpt_oss`` (gpt-oss-20b / 120b): GQA with q/k/v and output biases (``o_bias``), per-head
  sinks (``attn_sinks``), sliding-window layers (``windows``: a window bounds the keys each
  query reads, so those layers' attention FLOPs stop growing with the sequence), routed experts
  only, with router and expert biases (``moe_bias``).

``mtp_depth`` multi-token-prediction modules (``models/mtp.py``) each add one more
(attention, MoE) layer, a [2H -> H] projection and three norms, and one more
LM-head pass per token.

Vision towers are outside the spec (text training only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

ATTN, GDN = "attention", "gdn"  # token-mixer kinds
MOE, DENSE = "moe", "dense"  # MLP kinds


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    family: str  # the family's registry name (for labels; nothing branches on it)
    vocab: int
    hidden: int
    mixers: tuple[str, ...]  # per layer: ATTN | GDN
    mlps: tuple[str, ...]  # per layer: MOE | DENSE
    n_heads: int
    n_kv_heads: int
    head_dim: int
    attn_gate: bool  # Qwen3.5 gated attention: q_proj emits q and an output gate
    qk_norm: bool = True  # per-head q/k RMSNorm weights (GLM-4.5-Air has none)
    # the q and k norms each span all heads of a token (MiniMax-M2): (N + K) x D weights, not 2D
    qk_norm_all_heads: bool = False
    attn_bias: bool = False  # q/k/v projection biases (GLM)
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    gdn_conv: int = 0
    # Kimi Delta Attention (> 0): the linear mixer's decay is per key channel and its decay and
    # output gates are low rank (D -> rank -> H*K each); separate q/k/v projections, no z / a
    # projections. 0: Gated DeltaNet (per-head decay, full-rank z).
    kda_gate_rank: int = 0
    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int  # 0 = no shared expert
    shared_gate: bool = True  # Qwen3.5: the shared expert has a sigmoid gate [1, H]
    dense_ffn: int  # FFN of dense-MLP layers
    tied: bool
    # Multi-head Latent Attention (0 = plain GQA): q / kv latent ranks, rope dims, value dim
    mla_q_rank: int = 0
    mla_kv_rank: int = 0
    mla_rope_dim: int = 0
    mla_v_dim: int = 0
    mtp_depth: int = 0  # multi-token-prediction modules
    # gpt-oss: output-projection bias, per-head sink logits, per-layer attention window (0 or
    # absent: full), router bias [E] and expert biases [E, 2F] + [E, H]
    o_bias: bool = False
    attn_sinks: bool = False
    windows: tuple[int, ...] = ()
    moe_bias: bool = False
    # DeepSeek Sparse Attention (0 = dense): keys per query, lightning-indexer heads and head dim
    dsa_topk: int = 0
    dsa_heads: int = 0
    dsa_dim: int = 0
    # the norm keeps an fp32 normalized value for backward (a zero-centered (1 + w) norm in fp32)
    # instead of a bf16 cast: 10H instead of 8H bytes per token (plan/layer_bytes.py)
    fp32_norm: bool = False
    # bf16 [t, H] tensors a decoder layer holds as locals while its MLP block runs (the residual
    # and the block's normed input; a layer that also keeps its mixer's input and output: 4)
    stream_tensors: int = 2

    @property
    def mla(self) -> bool:
        return self.mla_kv_rank > 0

    @property
    def layers(self) -> int:
        return len(self.mixers)

    # ------------------------------------------------------------------ parameters
    def mixer_params(self, kind: str) -> int:
        h = self.hidden
        if kind == ATTN and self.mla:
            return (
                self._mla_weights()
                + self.mla_q_rank
                + self.mla_kv_rank
                + h
                + self._indexer_weights()
                + 2 * self.dsa_dim
            )  # + q / kv latent norms, input norm; DSA's indexer and its key LayerNorm
        if kind == ATTN:
            q_out = self.n_heads * self.head_dim * (2 if self.attn_gate else 1)
            kv = 2 * self.n_kv_heads * self.head_dim
            bias = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim * self.attn_bias
            norms = (
                (self.n_heads + self.n_kv_heads) * self.head_dim
                if self.qk_norm_all_heads
                else 2 * self.head_dim * self.qk_norm
            )
            extra = h * self.o_bias + self.n_heads * self.attn_sinks
            return h * (q_out + kv) + self.n_heads * self.head_dim * h + bias + norms + h + extra
        kd, vd = self.gdn_k_heads * self.gdn_k_dim, self.gdn_v_heads * self.gdn_v_dim
        conv_ch = 2 * kd + vd
        if self.kda_gate_rank:
            r, hv = self.kda_gate_rank, self.gdn_v_heads
            return (
                h * conv_ch  # q, k, v projections
                + conv_ch * self.gdn_conv
                + (h * r + r * kd)
                + kd
                + hv  # decay gate f_a, f_b, dt_bias [H*K], A_log [H]
                + (h * r + r * vd)  # output gate g_a, g_b
                + h * hv  # b_proj
                + self.gdn_v_dim  # gated norm
                + vd * h
                + h
            )  # o_proj, input_layernorm
        return (
            h * (conv_ch + vd + 2 * self.gdn_v_heads)  # in_proj qkv, z, b, a
            + conv_ch * self.gdn_conv
            + 2 * self.gdn_v_heads
            + self.gdn_v_dim  # conv, A_log, dt_bias, norm
            + vd * h
            + h
        )  # out_proj, input_layernorm

    def _mla_weights(self) -> int:
        """Matmul weights of one MLA layer: q (LoRA or plain), kv down + up, output."""
        h, n, d, r, c = (
            self.hidden,
            self.n_heads,
            self.head_dim,
            self.mla_rope_dim,
            self.mla_kv_rank,
        )
        q = (h * self.mla_q_rank + self.mla_q_rank * n * d) if self.mla_q_rank else h * n * d
        nope = d - r
        return q + h * (c + r) + c * n * (nope + self.mla_v_dim) + n * self.mla_v_dim * h

    def _indexer_weights(self) -> int:
        """Matmul weights of DSA's lightning indexer: q from the q latent, one key, head weights."""
        return (
            self.mla_q_rank * self.dsa_heads * self.dsa_dim
            + self.hidden * self.dsa_dim
            + self.hidden * self.dsa_heads
        )

    def dsa_keys(self, seq: int) -> float:
        """Mean over a ``seq``-token causal row of the keys a query's main attention reads:
        min(topk, t) for the query at position t (all of them without DSA, seq / 2)."""
        k = self.dsa_topk
        if not k or seq <= k:
            return seq / 2
        return k - k * (k - 1) / (2.0 * seq)

    def mlp_params(self, kind: str) -> tuple[int, int]:
        """(non-expert, routed-expert) parameters of one MLP block incl. its norm."""
        h = self.hidden
        if kind == DENSE:
            return 3 * h * self.dense_ffn + h, 0
        shared = (
            (3 * h * self.shared_ffn + h * self.shared_gate) if self.shared_ffn else 0
        )  # + sigmoid gate [1, H]
        expert = self.experts * (
            3 * h * self.expert_ffn + (2 * self.expert_ffn + h) * self.moe_bias
        )
        return self.experts * (h + self.moe_bias) + shared + h, expert

    def layer_params(self, i: int) -> tuple[int, int]:
        dense, expert = self.mlp_params(self.mlps[i])
        return self.mixer_params(self.mixers[i]) + dense, expert

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """LM head (0 when tied to the embedding) plus the final norm."""
        return (0 if self.tied else self.vocab * self.hidden) + self.hidden

    def mtp_params(self) -> tuple[int, int]:
        """(non-expert, routed-expert) parameters of the MTP modules: per module one attention + MoE
        layer, the [2H -> H] projection and three norms (Qwen3.5 shares the last two across depths)."""
        if not self.mtp_depth:
            return 0, 0
        dense, expert = self.mlp_params(MOE)
        dense += self.mixer_params(ATTN) + 2 * self.hidden * self.hidden + 3 * self.hidden
        return self.mtp_depth * dense, self.mtp_depth * expert

    def num_params(self) -> dict[str, int]:
        return dict(self._param_counts)

    @functools.cached_property
    def _param_counts(self) -> dict[str, int]:
        mtp_dense, mtp_expert = self.mtp_params()
        dense = (
            sum(self.layer_params(i)[0] for i in range(self.layers))
            + self.embed_params
            + self.head_params
            + mtp_dense
        )
        expert = sum(self.layer_params(i)[1] for i in range(self.layers)) + mtp_expert
        return {"total": dense + expert, "dense": dense, "expert": expert}

    # ------------------------------------------------------------------ FLOPs (forward, per token)
    def mixer_gemm_flops(self, kind: str) -> float:
        """2 x matmul weights of the token mixer (projections only)."""
        h = self.hidden
        if kind == ATTN and self.mla:
            return 2.0 * (self._mla_weights() + self._indexer_weights())
        if kind == ATTN:
            q_out = self.n_heads * self.head_dim * (2 if self.attn_gate else 1)
            return (
                2.0
                * h
                * (q_out + 2 * self.n_kv_heads * self.head_dim + self.n_heads * self.head_dim)
            )
        kd, vd = self.gdn_k_heads * self.gdn_k_dim, self.gdn_v_heads * self.gdn_v_dim
        if self.kda_gate_rank:
            r = self.kda_gate_rank
            return 2.0 * (h * (2 * kd + vd + self.gdn_v_heads + 2 * r) + r * (kd + vd) + vd * h)
        return 2.0 * h * (2 * kd + 2 * vd + 2 * self.gdn_v_heads + vd)

    def attn_core_flops(self, seq: int, window: int = 0) -> float:
        """Causal softmax attention, mean over a sequence of ``seq`` tokens: QK^T and PV
        over seq/2 keys on average (2 matmuls x 2 FLOPs x N*D x seq/2); MLA's PV runs over
        its value dim. A ``window`` shorter than ``seq``: query t reads min(t + 1, window) keys,
        W (W + 1) / 2 + (seq - W) W over the sequence. DSA: the absorbed MLA over the selected
        latents plus the indexer over all earlier keys."""
        if self.dsa_topk:  # absorbed MLA over the selected latents + the indexer over all keys
            c, r = self.mla_kv_rank, self.mla_rope_dim
            main = (
                2.0 * self.n_heads * (2 * c + r) * self.dsa_keys(seq)
            )  # QK^T over C + R, PV over C
            return main + 2.0 * self.dsa_heads * (self.dsa_dim + 1) * seq / 2
        per_key = (
            2.0 * self.n_heads * (self.head_dim + (self.mla_v_dim if self.mla else self.head_dim))
        )
        if window and window < seq:
            return per_key * (window * (window + 1) / 2 + (seq - window) * window) / seq
        return per_key * seq / 2

    def mean_attn_core_flops(self, seq: int) -> float:
        """``attn_core_flops`` averaged over the attention layers (the planner times layers by
        kind; windowed and full layers alternate, so the mean carries the total)."""
        ws = [self.window(i) for i, m in enumerate(self.mixers) if m == ATTN] or [0]
        return sum(self.attn_core_flops(seq, w) for w in ws) / len(ws)

    def window(self, i: int) -> int:
        """Layer ``i``'s attention window (0: full)."""
        return self.windows[i] if self.windows else 0

    def gdn_core_flops(self, chunk: int = 64) -> float:
        """Chunked gated delta rule (Yang et al. 2024, "Gated Delta Networks", chunkwise
        form): per value head and token, three state products (k S, q S, k^T u) of
        Dk x Dv and the intra-chunk C x (Dk + Dv) attention-like products, x2 FLOPs."""
        dk, dv = self.gdn_k_dim, self.gdn_v_dim
        if self.kda_gate_rank:  # per-channel decay: the C x C pair products carry a K-wide factor
            # (FLA's chunk_kda forms them in sub-chunks; counted as one extra C x Dk product)
            return 2.0 * self.gdn_v_heads * (3 * dk * dv + 2 * chunk * (2 * dk + dv))
        return 2.0 * self.gdn_v_heads * (3 * dk * dv + 2 * chunk * (dk + dv))

    def moe_gemm_flops(self, kind: str) -> tuple[float, float]:
        """(dense GEMMs incl. router and shared expert, routed grouped GEMMs) per token."""
        h = self.hidden
        if kind == DENSE:
            return 2.0 * 3 * h * self.dense_ffn, 0.0
        dense = 2.0 * h * self.experts + (
            2.0 * 3 * h * self.shared_ffn + 2.0 * h * self.shared_gate if self.shared_ffn else 0.0
        )
        return dense, 2.0 * 3 * h * self.expert_ffn * self.top_k

    def layer_flops(self, seq: int) -> tuple[list[float], float]:
        """Forward FLOPs of one ``seq``-token sequence through each decoder layer (mixer
        projections and core, then the MLP block), and through the LM head (the embedding is a
        lookup). Pipeline stages balance on these."""
        layers = [
            seq
            * (
                self.mixer_gemm_flops(mixer)
                + (
                    self.attn_core_flops(seq, self.window(i))
                    if mixer == ATTN
                    else self.gdn_core_flops()
                )
                + sum(self.moe_gemm_flops(mlp))
            )
            for i, (mixer, mlp) in enumerate(zip(self.mixers, self.mlps))
        ]
        return layers, 2.0 * seq * self.hidden * self.vocab

    def model_flops_per_token(self, seq: int) -> float:
        """Forward+backward model FLOPs per token (3x forward, no recompute, causal
        attention at half the square): the convention TFLOPs/GPU figures are quoted in."""
        fwd = 2.0 * self.hidden * self.vocab  # LM head
        mtp = ((ATTN, MOE),) * self.mtp_depth  # each MTP module: one more layer + projection + head
        windows = [self.window(i) for i in range(self.layers)] + [0] * self.mtp_depth
        for (mixer, mlp), w in zip(tuple(zip(self.mixers, self.mlps)) + mtp, windows):
            fwd += self.mixer_gemm_flops(mixer) + sum(self.moe_gemm_flops(mlp))
            fwd += self.attn_core_flops(seq, w) if mixer == ATTN else self.gdn_core_flops()
        fwd += self.mtp_depth * (
            2.0 * 2 * self.hidden * self.hidden + 2.0 * self.hidden * self.vocab
        )
        return 3.0 * fwd

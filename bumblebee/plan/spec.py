"""The model description the planner works from, read straight from HF config dicts.

The planner never builds a model: it needs parameter counts, per-layer shapes
and FLOPs. ``ModelSpec`` holds exactly that, for both families:

- ``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B): every layer is GQA attention
  with q/k RMSNorm, then a routed MoE (or a dense SwiGLU on ``mlp_only_layers``);
- ``qwen3_5_moe`` (Qwen3.5-35B-A3B, text part): ``layer_types`` mixes Gated
  DeltaNet ("linear_attention") and gated full attention (q_proj also emits a
  sigmoid output gate); every MLP is routed experts plus one shared expert with
  a sigmoid gate.

It reads the dicts directly (``model_type`` ``qwen3_moe``, ``qwen3_5_moe_text``,
or a multimodal ``qwen3_5_moe`` whose ``text_config`` is the text part), so it
does not depend on the model family code being present. Vision towers are
outside the plan (text training only).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

from bumblebee.config import ConfigError
from bumblebee.models.presets import PRESETS

ATTN, GDN = "attention", "gdn"  # token-mixer kinds
MOE, DENSE = "moe", "dense"  # MLP kinds


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    family: str  # qwen3_moe | qwen3_5_moe
    vocab: int
    hidden: int
    mixers: tuple[str, ...]  # per layer: ATTN | GDN
    mlps: tuple[str, ...]  # per layer: MOE | DENSE
    n_heads: int
    n_kv_heads: int
    head_dim: int
    attn_gate: bool  # Qwen3.5 gated attention: q_proj emits q and an output gate
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    gdn_conv: int = 0
    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int  # 0 = no shared expert
    dense_ffn: int  # FFN of dense-MLP layers
    tied: bool

    @property
    def layers(self) -> int:
        return len(self.mixers)

    # ------------------------------------------------------------------ parameters
    def mixer_params(self, kind: str) -> int:
        h = self.hidden
        if kind == ATTN:
            q_out = self.n_heads * self.head_dim * (2 if self.attn_gate else 1)
            kv = 2 * self.n_kv_heads * self.head_dim
            return h * (q_out + kv) + self.n_heads * self.head_dim * h + 2 * self.head_dim + h
        kd, vd = self.gdn_k_heads * self.gdn_k_dim, self.gdn_v_heads * self.gdn_v_dim
        conv_ch = 2 * kd + vd
        return (h * (conv_ch + vd + 2 * self.gdn_v_heads)  # in_proj qkv, z, b, a
                + conv_ch * self.gdn_conv + 2 * self.gdn_v_heads + self.gdn_v_dim  # conv, A_log, dt_bias, norm
                + vd * h + h)  # out_proj, input_layernorm

    def mlp_params(self, kind: str) -> tuple[int, int]:
        """(non-expert, routed-expert) parameters of one MLP block incl. its norm."""
        h = self.hidden
        if kind == DENSE:
            return 3 * h * self.dense_ffn + h, 0
        shared = (3 * h * self.shared_ffn + h) if self.shared_ffn else 0  # + sigmoid gate [1, H]
        return self.experts * h + shared + h, self.experts * 3 * h * self.expert_ffn

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

    def num_params(self) -> dict[str, int]:
        return dict(self._param_counts)

    @functools.cached_property
    def _param_counts(self) -> dict[str, int]:
        dense = sum(self.layer_params(i)[0] for i in range(self.layers)) + self.embed_params + self.head_params
        expert = sum(self.layer_params(i)[1] for i in range(self.layers))
        return {"total": dense + expert, "dense": dense, "expert": expert}

    # ------------------------------------------------------------------ FLOPs (forward, per token)
    def mixer_gemm_flops(self, kind: str) -> float:
        """2 x matmul weights of the token mixer (projections only)."""
        h = self.hidden
        if kind == ATTN:
            q_out = self.n_heads * self.head_dim * (2 if self.attn_gate else 1)
            return 2.0 * h * (q_out + 2 * self.n_kv_heads * self.head_dim + self.n_heads * self.head_dim)
        kd, vd = self.gdn_k_heads * self.gdn_k_dim, self.gdn_v_heads * self.gdn_v_dim
        return 2.0 * h * (2 * kd + 2 * vd + 2 * self.gdn_v_heads + vd)

    def attn_core_flops(self, seq: int) -> float:
        """Causal softmax attention, mean over a sequence of ``seq`` tokens: QK^T and PV
        over seq/2 keys on average (2 matmuls x 2 FLOPs x N*D x seq/2)."""
        return 2.0 * self.n_heads * self.head_dim * seq

    def gdn_core_flops(self, chunk: int = 64) -> float:
        """Chunked gated delta rule (Yang et al. 2024, "Gated Delta Networks", chunkwise
        form): per value head and token, three state products (k S, q S, k^T u) of
        Dk x Dv and the intra-chunk C x (Dk + Dv) attention-like products, x2 FLOPs."""
        dk, dv = self.gdn_k_dim, self.gdn_v_dim
        return 2.0 * self.gdn_v_heads * (3 * dk * dv + 2 * chunk * (dk + dv))

    def moe_gemm_flops(self, kind: str) -> tuple[float, float]:
        """(dense GEMMs incl. router and shared expert, routed grouped GEMMs) per token."""
        h = self.hidden
        if kind == DENSE:
            return 2.0 * 3 * h * self.dense_ffn, 0.0
        dense = 2.0 * h * self.experts + (2.0 * 3 * h * self.shared_ffn + 2.0 * h if self.shared_ffn else 0.0)
        return dense, 2.0 * 3 * h * self.expert_ffn * self.top_k

    def model_flops_per_token(self, seq: int) -> float:
        """Forward+backward model FLOPs per token (3x forward, no recompute, causal
        attention at half the square): the convention TFLOPs/GPU figures are quoted in."""
        fwd = 2.0 * self.hidden * self.vocab  # LM head
        for mixer, mlp in zip(self.mixers, self.mlps):
            fwd += self.mixer_gemm_flops(mixer) + sum(self.moe_gemm_flops(mlp))
            fwd += self.attn_core_flops(seq) if mixer == ATTN else self.gdn_core_flops()
        return 3.0 * fwd


# ---------------------------------------------------------------------------------------------
# building a spec from a preset name or a config.json


def _text_part(d: dict) -> dict:
    if d.get("model_type") == "qwen3_5_moe" and isinstance(d.get("text_config"), dict):
        return {**d["text_config"], "model_type": "qwen3_5_moe_text",
                "tie_word_embeddings": d["text_config"].get("tie_word_embeddings", d.get("tie_word_embeddings", False))}
    return d


def _need(d: dict, key: str, where: str):
    if key not in d:
        raise ConfigError(f"{where}: config is missing {key!r}")
    return d[key]


def spec_from_hf_dict(d: dict, name: str = "custom") -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face config dict of either family."""
    d = _text_part(d)
    mt = d.get("model_type")
    where = f"model {name}"
    if mt not in ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text"):
        raise ConfigError(f"{where}: unsupported model_type {mt!r}; valid: qwen3_moe, qwen3_5_moe, qwen3_5_moe_text")
    g = lambda k: _need(d, k, where)  # noqa: E731
    layers, hidden, heads = int(g("num_hidden_layers")), int(g("hidden_size")), int(g("num_attention_heads"))
    experts = int(d.get("num_experts", d.get("num_local_experts", 0)))
    common = dict(name=name, vocab=int(g("vocab_size")), hidden=hidden, n_heads=heads,
                  n_kv_heads=int(d.get("num_key_value_heads", heads)),
                  head_dim=int(d.get("head_dim") or hidden // heads), experts=experts,
                  top_k=int(d.get("num_experts_per_tok", 1)), expert_ffn=int(d.get("moe_intermediate_size", 0)),
                  tied=bool(d.get("tie_word_embeddings", False)))
    if mt == "qwen3_moe":
        dense_layers = set(d.get("mlp_only_layers") or [])
        step = int(d.get("decoder_sparse_step", 1) or 1)
        mlps = tuple(MOE if experts and i not in dense_layers and (i + 1) % step == 0 else DENSE
                     for i in range(layers))
        spec = ModelSpec(family="qwen3_moe", mixers=(ATTN,) * layers, mlps=mlps, attn_gate=False,
                         shared_ffn=0, dense_ffn=int(d.get("intermediate_size", 0)), **common)
    else:
        types = d.get("layer_types")
        if types is None:
            every = int(d.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]
        if len(types) != layers or set(types) - {"full_attention", "linear_attention"}:
            raise ConfigError(f"{where}: layer_types must list {layers} of full_attention/linear_attention")
        spec = ModelSpec(family="qwen3_5_moe", mixers=tuple(ATTN if t == "full_attention" else GDN for t in types),
                         mlps=(MOE,) * layers, attn_gate=True,
                         gdn_k_heads=int(g("linear_num_key_heads")), gdn_v_heads=int(g("linear_num_value_heads")),
                         gdn_k_dim=int(g("linear_key_head_dim")), gdn_v_dim=int(g("linear_value_head_dim")),
                         gdn_conv=int(d.get("linear_conv_kernel_dim", 4)),
                         shared_ffn=int(d.get("shared_expert_intermediate_size", 0)), dense_ffn=0, **common)
    if spec.experts <= 0 or not 1 <= spec.top_k <= spec.experts or spec.expert_ffn <= 0:
        raise ConfigError(f"{where}: the planner needs an MoE config (num_experts, num_experts_per_tok, "
                          f"moe_intermediate_size > 0)")
    if spec.n_heads % spec.n_kv_heads:
        raise ConfigError(f"{where}: num_attention_heads must be divisible by num_key_value_heads")
    return spec


def preset_names() -> dict[str, str]:
    """Real-size preset name -> family (the ``tiny`` test presets are reachable as ``family/tiny``)."""
    names = {}
    for family, presets in PRESETS.items():
        for name in presets:
            names[name if name != "tiny" else f"{family}/tiny"] = family
    return names


def load_spec(model: str) -> tuple[ModelSpec, dict]:
    """``--model`` (a preset name or a path to a config.json / HF directory) -> (spec, HF dict)."""
    names = preset_names()
    if model in names:
        family = names[model]
        d = PRESETS[family][model.split("/")[-1]]
        return spec_from_hf_dict(d, name=model), dict(d)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if os.path.isfile(path):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--model {model}: cannot read JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"--model {model}: expected a JSON object")
        return spec_from_hf_dict(d, name=os.path.basename(os.path.dirname(os.path.abspath(path))) or path), d
    raise ConfigError(f"unknown model {model!r}; valid: {', '.join(names)}, or a path to a config.json")

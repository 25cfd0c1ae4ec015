"""Qwen3.5-MoE (the hybrid Gated DeltaNet / gated attention MoE) composed from primitives.

Decoder layer i (``arch.layer_types[i]``): x + Mixer(RMSNorm(x)), then
h + MoE(RMSNorm(h)) with

- ``linear_attention``: Gated DeltaNet (Yang et al., ICLR 2025), see
  ``primitives/linear_attention/gdn.py``; its core is the ``linear_attention`` slot;
- ``full_attention``: GQA with per-head q/k RMSNorm, partial RoPE on per-document
  positions, and a sigmoid output gate: ``q_proj`` emits [query | gate] per head
  and ``o_proj(attn * sigmoid(gate))`` (HF ``Qwen3_5MoeAttention``); its core is
  the ``attention`` slot;
- MoE: the routed experts (router, expert FFN and dispatch slots, as Qwen3-MoE)
  plus one shared SwiGLU expert scaled by ``sigmoid(shared_expert_gate(x))``.

Context parallelism (``parallel.cp > 1``): the residual stream is zigzag-sharded
(``primitives/cp/layout.py``) and the layout is a ``CPLayout``. Full attention runs
the ``cp`` slot (allgather / ring) on it; Gated DeltaNet runs on the same zigzag
shards with its state carried across ranks by an affine prefix scan
(``primitives/linear_attention/cp.py``), so no layer converts the residual stream.
The balance loss is reduced over the CP group (as Qwen3-MoE).

Every RMSNorm except the GDN output norm is zero-centered, ``(1 + w)`` in fp32
(HF ``Qwen3_5MoeRMSNorm``). Module and parameter names follow HF's
``Qwen3_5MoeForCausalLM`` so checkpoints map one to one (experts stacked, see
``models/hf.py``). The released checkpoints' multi-token-prediction head ``mtp.*`` is
``MultiTokenPredictor`` (``models/mtp.py``), same names.

Legend: B batch, T tokens, D hidden.
"""

from __future__ import annotations

from torch import nn

from bumblebee import registry
from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.blocks import Attention, DecoderLayer, feed_forward
from bumblebee.models.mtp import combine
from bumblebee.models.qwen3_5_moe.arch import Qwen3_5MoeArch
from bumblebee.primitives import init
from bumblebee.primitives.linear_attention.gdn import GatedDeltaNet
from bumblebee.primitives.norms import ZeroCenteredRMSNorm


def gated_attention(arch: Qwen3_5MoeArch, attend, recompute) -> Attention:
    """HF ``Qwen3_5MoeAttention``: q_proj emits [query | gate] per head, (1 + w) q/k norms."""
    return Attention(arch, attend, recompute, gate=True, norm=ZeroCenteredRMSNorm)


class MultiTokenPredictor(nn.Module):
    """The released ``mtp.*`` head (``models/mtp.py``): ``fc`` over [pre_fc_norm_embedding(emb) ;
    pre_fc_norm_hidden(h)] shared by every depth, one gated full-attention MoE layer per depth
    (``layers.{k}``), then ``norm``. The embedding and LM head are the main model's."""

    def __init__(self, arch: Qwen3_5MoeArch, layers: list[nn.Module]):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, eps)
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(h, eps)

    def forward(self, h_BTD, emb_BTD, cos, sin, layout, k: int):
        x = combine(self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.fc, emb_BTD, h_BTD)
        x, aux = self.layers[k](x, cos, sin, layout)
        return self.norm(x), aux


class Qwen3_5MoeForCausalLM(CausalLM):
    """Qwen3.5-MoE: the shared causal LM (models/base.py) over the shared pre-norm layer with a
    Gated DeltaNet or gated attention mixer and routed + gated shared experts."""

    family = "qwen3_5_moe"
    norm_cls = ZeroCenteredRMSNorm
    linear_mixer: type = GatedDeltaNet  # (Qwen3-Next: the same with its fused projections)

    def make_layer(self, index: int, parts: LayerParts, kind: str = "") -> nn.Module:
        """Layer ``index`` of ``arch.layer_types`` (``kind``: of that type instead, always MoE)."""
        a = self.arch
        moe = True if kind else None
        kind = kind or a.layer_types[index]
        if kind == "linear_attention":
            mixer = self.linear_mixer(
                a.hidden_size,
                a.linear_num_key_heads,
                a.linear_num_value_heads,
                a.linear_key_head_dim,
                a.linear_value_head_dim,
                a.linear_conv_kernel_dim,
                a.rms_norm_eps,
                registry.get("linear_attention", parts.prims.linear_attention).factory,
                parts.recompute,
                cp_carry=parts.prims.linear_attention_cp,
            )
        else:
            mixer = gated_attention(a, parts.attend, parts.recompute)
        return DecoderLayer(
            a,
            parts,
            mixer,
            feed_forward(a, index, parts, moe, shared="gated"),
            norm=ZeroCenteredRMSNorm,
            layer_type=kind,
            mixer_name="linear_attn" if kind == "linear_attention" else "self_attn",
            keep_mixer_io=True,  # as the spec counts (stream_tensors = 4)
        )

    def make_mtp(self, parts: LayerParts):
        n = self.arch.mtp_num_hidden_layers
        if not n:
            return None
        layers = [self.make_layer(0, parts, kind="full_attention") for _ in range(n)]
        return MultiTokenPredictor(self.arch, layers)

    def mtp_modules(self) -> int:
        return 0 if self.mtp is None else len(self.mtp.layers)

    def mtp_forward(self, k: int, h_BTD, emb_BTD, cos, sin, layout):
        return self.recompute.layer(self.mtp, h_BTD, emb_BTD, cos, sin, layout, k)

    def mtp_units(self) -> list[nn.Module]:
        return [self.mtp]

    def rotary_dim(self) -> int:
        return self.arch.rotary_dim

    def init_vectors(self, std: float) -> dict:
        """Zeros for the (1 + w) norms, then the GDN's own rules (ones for its output norm and
        dt_bias, A_log = log U(0.01, 16))."""
        rules = {}
        for mn, m in self.named_modules():
            if isinstance(m, ZeroCenteredRMSNorm):
                rules[f"{mn}.weight"] = init.const(0.0)
            elif isinstance(m, GatedDeltaNet):
                rules.update({f"{mn}.{pn}": fill for pn, fill in m.init_rules(std).items()})
        return rules

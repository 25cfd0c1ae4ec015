"""GLM-4.5 / 4.6 / 4.7 (HF ``glm4_moe``) composed from primitives.

Decoder layer i: x + Attn(RMSNorm(x)), then h + FFN(RMSNorm(h)) with

- Attn: GQA with q/k/v biases (``attention_bias``), per-head q/k RMSNorm when
  ``use_qk_norm`` (GLM-4.5 on, GLM-4.5-Air off) and partial RoPE (the first
  ``head_dim x partial_rotary_factor`` dims, HF's half-split layout); its core is the
  ``attention`` slot (the ``cp`` slot when the sequence is split: every head is whole on
  every rank, so CP needs nothing of this family);
- FFN: a dense SwiGLU on the first ``first_k_dense_replace`` layers, then DeepSeek-V3's MoE
  block (``deepseek_v3/model.py``: routed experts over the ``sigmoid_bias`` router with its
  correction bias and group-limited top-k, plus ungated shared experts).

Multi-token prediction: ``num_nextn_predict_layers`` modules (``models/mtp.py``), each a MoE
decoder layer of this family plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``,
stored as ``model.layers.{L + k}`` like DeepSeek-V3's (``transformers`` drops these tensors on
load; bumblebee trains and exports them).
"""

from __future__ import annotations

from torch import nn

from bumblebee.models import blocks
from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.deepseek_v3.model import MOE_TRAITS, ROUTER, LayerMTP, mtp_layer_class
from bumblebee.models.glm4_moe.arch import Glm4MoeArch
from bumblebee.primitives.norms import RMSNorm

__all__ = ["ROUTER", "Glm4MoeForCausalLM"]


class DecoderLayer(blocks.DecoderLayer):
    """The shared pre-norm layer over GLM's attention (HF ``Glm4MoeAttention``) and DeepSeek-V3's
    MoE (``moe``: MoE regardless of ``first_k_dense_replace``)."""

    def __init__(self, arch: Glm4MoeArch, idx: int, parts: LayerParts, moe: bool | None = None):
        attention = blocks.Attention(
            arch,
            parts.attend,
            parts.recompute,
            qk_norm="head" if arch.use_qk_norm else "",
            bias=arch.attention_bias,
        )
        mlp = blocks.feed_forward(arch, idx, parts, moe, **MOE_TRAITS)
        super().__init__(arch, parts, attention, mlp)


class Glm4MoeForCausalLM(LayerMTP, CausalLM):
    """GLM-4.5: the shared causal LM (models/base.py) over GQA + DeepSeek-style MoE layers."""

    family = "glm4_moe"
    norm_cls = RMSNorm
    mtp_layer = mtp_layer_class(DecoderLayer)

    def make_layer(self, index: int, parts: LayerParts, moe: bool | None = None) -> nn.Module:
        return DecoderLayer(self.arch, index, parts, moe)

    def rotary_dim(self) -> int:
        return self.arch.rotary_dim

    def init_vectors(self, std: float) -> dict:
        """Ones for the norm weights, zeros for the q/k/v biases (HF's init)."""
        from bumblebee.primitives import init

        return {
            name: init.const(0.0 if name.endswith(".bias") else 1.0)
            for name, p in self.named_parameters()
            if p.dim() == 1
        }

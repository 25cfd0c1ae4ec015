"""gpt-oss (HF ``gpt_oss``) composed from primitives.

Decoder layer i: x + Attn(RMSNorm(x)), then h + MoE(RMSNorm(h)) with

- Attn: GQA with q/k/v/o biases, YaRN RoPE over the whole head, and the attention core given
  the generic options (primitives/attention/options.py): this layer's sliding window
  (``layer_types[i] == "sliding_attention"``: ``sliding_window`` keys) and the layer's per-head
  sink logits ``sinks`` [N]. Every head is whole on every rank, so CP needs nothing of this family
  (the ring masks the window and merges the sinks itself);
- MoE: the ``topk_softmax`` router (biased logits, top-k, softmax over the k), experts with
  biases and the clamped ``(up + 1)`` SwiGLU (``experts.ClampedSwiGLU``), no shared expert.

Checkpoint names (models/hf_stored.py, the family's ``hf_stored``): the router is
``mlp.router`` (bumblebee's MoE block calls it ``mlp.gate``); the experts are stored fused,
transposed (``x @ W``) with gate and up columns interleaved: ``gate_up_proj`` [E, H, 2F],
``gate_up_proj_bias`` [E, 2F], ``down_proj`` [E, F, H], ``down_proj_bias`` [E, H].

Legend: B batch, T tokens, H hidden, N query heads, K kv heads, D head dim.
"""

from __future__ import annotations

from torch import nn

from bumblebee.models.base import CausalLM, LayerParts
from bumblebee.models.blocks import Attention, DecoderLayer, feed_forward
from bumblebee.primitives import init
from bumblebee.primitives.moe.experts import ClampedSwiGLU
from bumblebee.primitives.norms import RMSNorm

ROUTER = "topk_softmax"  # the architecture's router


class GptOssForCausalLM(CausalLM):
    """gpt-oss: the shared causal LM (models/base.py) over the shared pre-norm layer with sink /
    sliding-window GQA (HF ``GptOssAttention``) and biased clamped-SwiGLU experts (``GptOssMLP``)."""

    family = "gpt_oss"
    norm_cls = RMSNorm

    def make_layer(self, index: int, parts: LayerParts) -> nn.Module:
        a, rc = self.arch, parts.recompute
        bias = a.attention_bias
        attention = Attention(
            a,
            parts.attend,
            rc,
            qk_norm="",
            bias=bias,
            o_bias=bias,
            sinks=True,
            window=a.window(index),
        )
        act = ClampedSwiGLU(a.swiglu_alpha, a.swiglu_limit)
        moe = feed_forward(a, index, parts, router=ROUTER, expert_bias=True, act=act)
        return DecoderLayer(a, parts, attention, moe, layer_type=a.layer_types[index])

    def init_vectors(self, std: float) -> dict:
        """HF's init: ones for the norm weights, zeros for the projection and expert biases,
        normal(std) for the sinks and the router bias."""
        rules = {}
        for name, p in self.named_parameters():
            if name.endswith(("sinks", "gate.bias")):
                rules[name] = init.normal(std)
            elif name.endswith(("experts.b_gate_up", "experts.b_down")) or name.endswith(".bias"):
                rules[name] = init.const(0.0)
            elif p.dim() == 1:
                rules[name] = init.const(1.0)
        return rules

"""DeepSeek-V3.2 (HF ``deepseek_v32``): DeepSeek-V3's model with DeepSeek Sparse Attention.

Every decoder layer is DeepSeek-V3's (``models/deepseek_v3/model.py``: MLA, dense then routed
MLPs, MTP in DeepSeek's layout) with its attention replaced by MLA plus a lightning indexer
(``primitives/attention/sparse_mla.py``): each query attends its ``index_topk`` highest-scored
keys. The ``dsa_*`` primitives choose the training stage, the core and the indexer loss weight;
in the ``dense_warmup`` stage every parameter outside the indexers is frozen (DeepSeek-V3.2's
recipe: only the indexer learns while the attention stays dense).
"""

from __future__ import annotations

from torch import nn

from bumblebee.models.base import LayerParts
from bumblebee.models.deepseek_v3.model import (
    DecoderLayer,
    DeepseekV3ForCausalLM,
    mla_args,
    mtp_layer_class,
)
from bumblebee.primitives import init
from bumblebee.primitives.attention.sparse_mla import SparseLatentAttention


class SparseDecoderLayer(DecoderLayer):
    def make_attention(self, arch, parts: LayerParts) -> nn.Module:
        p = parts.prims
        args = mla_args(arch, parts, eps=arch.latent_norm_eps)
        args.pop("cp_latents")  # DSA gathers its own latents under CP
        return SparseLatentAttention(
            arch.hidden_size,
            arch.num_attention_heads,
            index_heads=arch.index_n_heads,
            index_dim=arch.index_head_dim,
            index_topk=arch.index_topk,
            index_rope_interleave=arch.index_rope_interleave,
            stage=p.dsa_stage,
            impl=p.dsa_impl,
            block=p.dsa_block,
            loss_weight=p.dsa_indexer_loss,
            **args,
        )


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: DeepSeek-V3 with sparse attention layers (and MTP over the same layer)."""

    family = "deepseek_v32"
    mtp_layer = mtp_layer_class(SparseDecoderLayer)

    def __init__(self, arch, prims=None, groups=None):
        super().__init__(arch, prims, groups)
        if self.prims.dsa_stage == "dense_warmup":  # only the indexers learn
            for name, p in self.named_parameters():
                p.requires_grad_(".indexer." in name)
            for m in self.modules():  # so no gradient needs the main attention's graph
                if isinstance(m, SparseLatentAttention):
                    m.main_frozen = True

    def make_layer(self, index: int, parts: LayerParts, moe: bool | None = None) -> nn.Module:
        return SparseDecoderLayer(self.arch, index, parts, moe)

    def init_vectors(self, std: float) -> dict:
        rules = super().init_vectors(std)  # LayerNorm biases start at 0, not at 1 as norm weights
        rules.update(
            {n: init.const(0.0) for n, _ in self.named_parameters() if n.endswith("k_norm.bias")}
        )
        return rules

    def indexer_losses(self) -> list:
        """The last forward's indexer KL per decoder layer (detached; None before a forward)."""
        return [
            layer.self_attn.indexer_kl
            for layer in self.decoder_layers
            if hasattr(layer, "self_attn")
        ]

"""A K/V cache for token-by-token decoding through a model's own forward (``CausalLM.forward_cached``).

The decoder layers run unchanged: the cache travels where the document layout usually
goes, and the attention core of every layer (``models/base.py`` wraps the configured one)
sees it, writes the new keys and values at ``start`` and attends over the filled slots
with ``mask``. Sampling code (``rl/sampler.py``) therefore never re-implements attention.
Linear-attention layers (Gated DeltaNet) would need their recurrent state here instead
and are refused.

Legend: R rows, T new tokens, S cache length, N query heads, K kv heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    def __init__(
        self, num_layers: int, rows: int, kv_heads: int, length: int, head_dim: int, dtype, device
    ):
        shape = (rows, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.layer = 0  # the layer being run (set by forward_cached)
        self.start = 0  # cache slot of the first new token
        self.mask_R1TS: torch.Tensor | None = None  # True where a new token may attend a slot

    def attend(self, q_RNTD, k_RKTD, v_RKTD, scale: float) -> torch.Tensor:
        """Store the new keys/values of the current layer, attend over slots [0, start + T)."""
        end = self.start + k_RKTD.shape[2]
        k_cache, v_cache = self.k[self.layer], self.v[self.layer]
        k_cache[:, :, self.start : end], v_cache[:, :, self.start : end] = k_RKTD, v_RKTD
        return F.scaled_dot_product_attention(
            q_RNTD,
            k_cache[:, :, :end],
            v_cache[:, :, :end],
            attn_mask=self.mask_R1TS,
            scale=scale,
            enable_gqa=q_RNTD.shape[1] != k_RKTD.shape[1],
        )


def cache_aware(attend):
    """The attention core ``attend(q, k, v, layout, scale, **options)`` (window, sinks:
    primitives/attention/options.py), or the cache's when ``layout`` is one."""

    def core(q, k, v, layout, scale, **options):
        if isinstance(layout, KVCache):
            if any(o is not None and o is not False and o != 0 for o in options.values()):
                raise NotImplementedError(
                    f"K/V-cache decoding takes no attention options ({', '.join(options)})"
                )
            return layout.attend(q, k, v, scale)
        return attend(q, k, v, layout, scale, **options)

    return core


class CachedDecoding:
    """The decoding part of ``CausalLM`` (models/base.py): the same layers, the cache in the
    layout's place. A mixin: it reads the model's ``decoder_layers``, ``arch`` and head."""

    def new_kv_cache(self, rows: int, length: int) -> KVCache:
        """An empty cache for ``rows`` sequences of up to ``length`` tokens (full attention only)."""
        if any(
            getattr(layer, "layer_type", "full_attention") != "full_attention"
            for layer in self.decoder_layers
        ):
            raise NotImplementedError(
                f"{self.family}: K/V-cache decoding needs full attention in every layer "
                "(linear attention would carry a recurrent state instead)"
            )
        a, w = self.arch, self.lm_head_weight
        return KVCache(
            len(self.decoder_layers),
            rows,
            a.num_key_value_heads,
            length,
            a.head_dim,
            w.dtype,
            w.device,
        )

    @torch.no_grad()
    def forward_cached(
        self, ids_RT, position_ids_RT, cache: KVCache, start: int, mask_R1TS
    ) -> torch.Tensor:
        """Logits [R, T, V] (fp32) of new tokens ``ids_RT`` whose keys/values go to cache slots
        ``[start, start + T)``; ``mask_R1TS`` says which slots each new token attends."""
        x = self.model.embed_tokens(ids_RT)
        cos, sin = self.rope_tables(position_ids_RT, x.dtype)
        cache.start, cache.mask_R1TS = start, mask_R1TS
        for i, layer in enumerate(self.decoder_layers):
            cache.layer = i
            x, _ = layer(x, cos, sin, cache)
        return self.apply_head(F.linear, self.model.norm(x)).float()

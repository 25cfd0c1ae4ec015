"""MiniMax-M2 / M2.1 presets: Hugging Face ``config.json`` dictionaries (``tiny`` for tests and the
CPU demo; ``minimax-m2`` / ``minimax-m2.1`` carry the released dimensions)."""

from __future__ import annotations

# MiniMaxAI/MiniMax-M2 (~230B total, ~10B active): transformers 5.23's MiniMaxM2Config defaults
# (62 layers, hidden 3072, 48 heads of 128 over 8 KV heads, 256 experts of 1536 top-8, vocab
# 200064, rope_theta 5e6, 196608 positions, eps 1e-6) plus the released config.json's
# rotary_dim 64 (half of each head rotates; HF's default without it rotates all of it)
_M2 = {
    "model_type": "minimax_m2",
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "num_hidden_layers": 62,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
    "rotary_dim": 64,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    "router_aux_loss_coef": 0.001,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 196608,
    "tie_word_embeddings": False,
}
PRESETS: dict[str, dict] = {
    "tiny": {
        "model_type": "minimax_m2",
        "vocab_size": 272,
        "hidden_size": 128,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5e6,
            "partial_rotary_factor": 0.5,
        },
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "minimax-m2": _M2,
    # MiniMax-M2.1: M2's architecture (same config.json dimensions), further trained
    "minimax-m2.1": dict(_M2),
}

"""Qwen3-Next presets: Hugging Face ``config.json`` dictionaries (``tiny`` for tests and the CPU demo;
the others carry the public dimensions of the released configs)."""

from __future__ import annotations

_HYBRID = ["linear_attention"] * 3 + ["full_attention"]

PRESETS: dict[str, dict] = {
    "tiny": {
        "model_type": "qwen3_next",
        "vocab_size": 272,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": _HYBRID,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
        },
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-Next-80B-A3B-{Instruct,Thinking}: 48 layers (3 GDN : 1 gated attention), 512
    # experts top-10 + 1 shared; the release also carries one mtp.* layer
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "num_hidden_layers": 48,
        "layer_types": _HYBRID * 12,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
        },
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "norm_topk_prob": True,
        "mtp_num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
    },
}

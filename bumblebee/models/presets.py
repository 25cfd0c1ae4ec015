"""Named model presets, stored as Hugging Face ``config.json`` dictionaries.

Real-size presets carry the public dimensions of the released Hugging Face configs (used by the
planner and by dry runs); the ``tiny`` presets are what tests and the default
run train on a CPU. A preset is plain data so that every layer (models, plan)
can read it without building anything.
"""

from __future__ import annotations

QWEN3_MOE: dict[str, dict] = {
    "tiny": {
        "model_type": "qwen3_moe",
        "vocab_size": 272,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
    },
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
    },
}

_HYBRID = ["linear_attention"] * 3 + ["full_attention"]

QWEN3_5_MOE: dict[str, dict] = {
    "tiny": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 272,
        "hidden_size": 128,
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
    "qwen3.5-35b-a3b": {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "layer_types": _HYBRID * 10,
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
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
    },
}

# DeepSeek-V3 architecture: the public config.json of deepseek-ai/DeepSeek-V3 (671B, 37B active)
# and of moonshotai/Kimi-K2-Instruct (1T, 32B active: 384 experts, 64 heads, one dense layer).
_DSV3_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
_DSV3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840,
    "rope_parameters": _DSV3_YARN,
    "rope_interleave": True,
    "tie_word_embeddings": False,
}
DEEPSEEK_V3: dict[str, dict] = {
    "tiny": {
        "model_type": "deepseek_v3",
        "vocab_size": 272,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 24,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    },
    "deepseek-v3-671b": _DSV3,
    "kimi-k2": {
        **_DSV3,
        "vocab_size": 163840,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 1,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "n_routed_experts": 384,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": 131072,
        "rope_parameters": {**_DSV3_YARN, "rope_theta": 50000.0, "factor": 32.0},
    },
}

PRESETS: dict[str, dict[str, dict]] = {
    "qwen3_moe": QWEN3_MOE,
    "qwen3_5_moe": QWEN3_5_MOE,
    "deepseek_v3": DEEPSEEK_V3,
}


def preset(family: str, name: str) -> dict:
    """The HF config dict of a preset (a copy)."""
    import copy

    return copy.deepcopy(PRESETS[family][name])

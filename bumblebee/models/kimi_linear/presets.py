"""Kimi Linear presets: Hugging Face ``config.json`` dictionaries (``tiny`` for tests and the CPU
demo; ``kimi-linear-48b-a3b`` carries the public dimensions of the release)."""

from __future__ import annotations

_L, _F = "linear_attention", "full_attention"

PRESETS: dict[str, dict] = {
    "tiny": {
        "model_type": "kimi_linear",
        "vocab_size": 272,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": [_L, _L, _L, _F],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "linear_num_heads": 4,
        "linear_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.446,
        "tie_word_embeddings": False,
    },
    # moonshotai/Kimi-Linear-48B-A3B-{Base,Instruct} config.json (the numbers also equal
    # transformers 5.23's KimiLinearConfig defaults): 27 layers, MLA at 1-based layers
    # 4, 8, ..., 24 and 27 (7 MLA, 20 KDA), 32 KDA heads of 128, 256 experts top-8 + 1 shared,
    # layer 1 dense; no MTP
    "kimi-linear-48b-a3b": {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "moe_intermediate_size": 1024,
        "num_hidden_layers": 27,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "linear_attn_config": {
            "head_dim": 128,
            "num_heads": 32,
            "short_conv_kernel_size": 4,
            "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        },
        "first_k_dense_replace": 1,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "routed_scaling_factor": 2.446,
        "rms_norm_eps": 1e-5,
        "model_max_length": 1048576,
        "tie_word_embeddings": False,
    },
}

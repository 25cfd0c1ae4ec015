"""GLM-5 presets: Hugging Face ``config.json`` dictionaries (``tiny`` for tests and the CPU demo;
``glm-5`` carries HF's ``GlmMoeDsaConfig`` defaults, GLM-5's public dimensions)."""

from __future__ import annotations

from bumblebee.models.deepseek_v32.presets import PRESETS as V32

PRESETS: dict[str, dict] = {
    "tiny": {
        **V32["tiny"],
        "model_type": "glm_moe_dsa",
        "rms_norm_eps": 1e-5,
        "n_group": 1,
        "topk_group": 1,
    },
    "glm-5": {
        "model_type": "glm_moe_dsa",
        "vocab_size": 154880,
        "hidden_size": 6144,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 78,
        "first_k_dense_replace": 3,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5,
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 32,
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
    },
}

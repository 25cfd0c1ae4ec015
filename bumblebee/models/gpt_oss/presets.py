"""gpt-oss presets: Hugging Face ``config.json`` dictionaries (``tiny`` for tests and the CPU demo;
the released sizes from ``transformers``' ``GptOssConfig`` defaults (gpt-oss-20b) and OpenAI's
model card (gpt-oss-120b: 36 layers, 128 experts; everything else as the 20b))."""

from __future__ import annotations

_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000.0,
}

# openai/gpt-oss-20b (21B total, 3.6B active): 24 layers alternating sliding (128) / full, 64
# heads of 64 over 8 KV heads, 32 experts top-4 of FFN 2880
_GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "attention_bias": True,
    "sliding_window": 128,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "rope_parameters": _YARN,
    "tie_word_embeddings": False,
}

PRESETS: dict[str, dict] = {
    "tiny": {
        **_GPT_OSS_20B,
        "vocab_size": 272,
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {**_YARN, "factor": 4.0, "original_max_position_embeddings": 1024},
    },
    "gpt-oss-20b": _GPT_OSS_20B,
    # openai/gpt-oss-120b (117B total, 5.1B active): 36 layers, 128 experts top-4
    "gpt-oss-120b": {**_GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128},
}

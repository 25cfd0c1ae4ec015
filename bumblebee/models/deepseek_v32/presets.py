"""DeepSeek-V3.2 presets: Hugging Face ``config.json`` dictionaries (``tiny`` for tests and the CPU
demo; ``deepseek-v3.2`` carries the public dimensions of deepseek-ai/DeepSeek-V3.2-Exp)."""

from __future__ import annotations

from bumblebee.models.deepseek_v3.presets import PRESETS as V3

_INDEXER = {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}
PRESETS: dict[str, dict] = {
    "tiny": {
        **V3["tiny"],
        "model_type": "deepseek_v32",
        "index_topk": 16,
        "index_head_dim": 16,
        "index_n_heads": 4,
    },
    "deepseek-v3.2": {**V3["deepseek-v3-671b"], "model_type": "deepseek_v32", **_INDEXER},
}
for _p in PRESETS.values():
    _p.pop("rope_interleave", None)

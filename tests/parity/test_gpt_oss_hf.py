"""Parity of bumblebee's gpt-oss family with Hugging Face ``transformers``' ``GptOssForCausalLM``.

Tiny random models are saved with ``save_pretrained`` and loaded with ``bumblebee.from_hf``;
configurations vary the window (shorter than the sequence, so the sliding layers differ from
the full ones), GQA groups, YaRN against default RoPE, the layer pattern, top-k and the clamp
(low enough that it binds). Every 1-D parameter (norms, biases, sinks) and the expert biases
are perturbed so that none sits at its init.

- logits (fp32): 1e-4 max-abs against HF (eager attention: HF's reference, sinks included);
- gradients (fp32): every parameter within 1e-4 relative after one backward, through the
  fused, transposed, interleaved expert tensors of the checkpoint (models/hf_stored.py);
- ``to_hf`` writes a directory ``transformers`` loads with equal logits, and bumblebee reads its
  own output bit for bit; a packed row (``varlen``: windows and sinks per document) equals HF
  on each document.
"""

from __future__ import annotations

import parity_utils as pu
import pytest
import torch
import transformers

import bumblebee
from bumblebee.config import PrimitivesConfig
from bumblebee.models.hf_stored import stored_entry

VOCAB, T = pu.VOCAB, 40
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=7,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 150000.0,
    },
    swiglu_limit=0.5,
    tie_word_embeddings=False,
)
CONFIGS = {
    "yarn_window7_clamped": {},
    "default_rope_full_first_mqa_top3": dict(
        num_key_value_heads=1,
        num_experts_per_tok=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        swiglu_limit=7.0,
        sliding_window=12,
    ),
}


def perturb(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias"):
                p.add_(0.2 * torch.randn_like(p))
            if name.endswith("gate_up_proj"):
                p.mul_(20.0)  # pre-activations beyond the clamp


def config_clamp(hf):
    """``hf``'s experts clamped as its config says. transformers 5.17's ``GptOssExperts`` fixes
    ``alpha = 1.702`` and ``limit = 7.0`` (its ``GptOssConfig`` has no ``swiglu_limit``), later
    releases read ``config.swiglu_limit`` / ``swiglu_alpha``, as bumblebee does (gpt-oss's
    config.json carries them): the experts take the config's values, as those releases set them
    (a no-op there)."""
    for layer in hf.model.layers:
        experts = layer.mlp.experts
        experts.limit = getattr(hf.config, "swiglu_limit", experts.limit)
        experts.alpha = getattr(hf.config, "swiglu_alpha", experts.alpha)
    return hf


class GptOssLoader:
    """``GptOssForCausalLM.from_pretrained`` with the config's clamp (``config_clamp``)."""

    @staticmethod
    def from_pretrained(path):
        return config_clamp(transformers.GptOssForCausalLM.from_pretrained(path))


def hf_model(seed: int, **overrides):
    cfg = transformers.GptOssConfig(**{**BASE, **overrides})
    cfg._attn_implementation = "eager"
    return config_clamp(pu.hf_model(transformers.GptOssForCausalLM, cfg, seed, perturb))


def grads(bb, hf):
    """(name, bumblebee's gradient, HF's in bumblebee's layout) of every parameter."""
    stored = bumblebee.models.family_of(bb.arch).hf_stored
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    out = {}
    for name, _ in bb.named_parameters():
        entry = stored_entry(stored, name)
        out[name] = (
            entry.from_checkpoint(hf_grads[entry.checkpoint_name(name)])
            if entry
            else hf_grads[name]
        )
    assert len(out) == len(hf_grads)
    return [(n, p.grad, out[n]) for n, p in bb.named_parameters()]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_hf(name, tmp_path):
    hf = hf_model(0, **CONFIGS[name])
    bb = pu.load(hf, tmp_path, "gpt_oss")
    windows = [layer.self_attn.window for layer in bb.model.layers]
    W = hf.config.sliding_window
    assert windows == [W if t == "sliding_attention" else 0 for t in hf.config.layer_types]
    pu.assert_logits_and_grads(bb, hf, T, grads)


def test_to_hf_round_trip_and_packed_rows(tmp_path):
    hf = hf_model(1)
    prims = PrimitivesConfig(attention="varlen")
    bb = pu.load(hf, tmp_path / "src", "gpt_oss", prims=prims)
    pu.assert_to_hf_loads(bb, GptOssLoader, tmp_path / "out", T, src=tmp_path / "src")
    pu.assert_packed_rows(bb, hf, [13, 20, 2, 5])


def test_mxfp4_checkpoint_is_refused(tmp_path):
    hf_model(2).save_pretrained(tmp_path)
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(bumblebee.errors.CheckpointError, match="MXFP4"):
        bumblebee.from_hf(str(tmp_path))


def test_chunked_moe_comm_is_refused_up_front():
    """The chunked EP overlap runs plain SwiGLU GEMMs: biased experts are refused before any rank
    starts, with what to use instead."""
    from bumblebee import load_config
    from bumblebee.errors import ConfigError
    from bumblebee.runtime.resolve import validate_run

    over = ["model.name=gpt_oss", "parallel.ep=2", "primitives.moe_comm=chunked"]
    with pytest.raises(ConfigError, match="alltoall"):
        validate_run(load_config(None, over))


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b"])
def test_released_sizes_count_as_hf_and_windows_bound_attention(preset):
    """The planner's ModelSpec of each released size holds exactly the parameters of HF's model
    (built on the meta device), and a sliding layer's attention FLOPs are those of the keys its
    queries read: sum over t of min(t + 1, W), not the causal T^2 / 2."""
    from bumblebee.models.gpt_oss.presets import PRESETS

    d = dict(PRESETS[preset])
    spec = bumblebee.models.arch_from_hf_dict(dict(d)).to_spec(preset)
    d.pop("model_type")
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**d))
    assert spec.num_params()["total"] == sum(p.numel() for p in hf.parameters())
    seq, W = 4096, d["sliding_window"]
    per_key = 4 * spec.n_heads * spec.head_dim  # QK^T and PV, 2 FLOPs per multiply-add
    keys = sum(min(t + 1, W) for t in range(seq))
    assert spec.windows[:2] == (W, 0)
    assert spec.attn_core_flops(seq, spec.windows[0]) * seq == pytest.approx(per_key * keys)
    assert spec.attn_core_flops(seq, spec.windows[1]) * seq == pytest.approx(
        per_key * seq * seq / 2
    )

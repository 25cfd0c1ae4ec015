"""Parity of bumblebee's MiniMax-M2 family with Hugging Face ``transformers``' ``MiniMaxM2ForCausalLM``.

Tiny random models are saved with ``save_pretrained`` (the released names: Mixtral's
``block_sparse_moe.experts.{e}.w1 / w3 / w2``, the router bias on the block) and loaded with
``bumblebee.from_hf``; configurations vary the rotated fraction (legacy ``rotary_dim`` and
``rope_parameters``), GQA groups (MHA to MQA), experts and top-k, and tied embeddings. Every
1-D parameter (the layer norms and the all-heads q/k norms) and the router's selection bias
are perturbed, so a q/k norm taken per head instead of over all heads shows.

- logits (fp32): 1e-4 max-abs against HF; gradients: every parameter within 1e-4 relative;
- ``to_hf`` writes the released names, bit for bit those of the source; ``transformers`` loads
  it with equal logits; a packed row equals HF on each document;
- a block-FP8 directory of this family (``weight_scale_inv`` on the attention and expert
  matrices, MiniMax's ``quantization_config``) loads equal to the dequantized reference;
- the released config's keys and what bumblebee refuses: per-head q/k norms, lightning
  attention layers, and q/k projections narrower than all heads (split heads).
"""

from __future__ import annotations

import json

import parity_utils as pu
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

import bumblebee
from bumblebee.errors import ConfigError
from bumblebee.models import arch_from_hf_dict
from bumblebee.models.minimax_m2.presets import PRESETS

VOCAB, T = pu.VOCAB, 40
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    rotary_dim=8,  # the released configs' legacy key: half of each head rotates
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    tie_word_embeddings=False,
)
CONFIGS = {
    "gqa_rotary_dim_half": {},
    "mqa_fullrope_top3_tied": dict(
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=8,
        rotary_dim=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0},
        num_local_experts=6,
        num_experts_per_tok=3,
        tie_word_embeddings=True,
    ),
}


def hf_config(**overrides):
    """``MiniMaxM2Config`` of ``BASE`` with ``overrides``, its rotated fraction from the legacy
    ``rotary_dim`` where given. transformers 5.17's config ignores that key (HF then rotates the
    whole head); later releases derive ``rope_parameters["partial_rotary_factor"] = rotary_dim /
    head_dim`` from it (``MiniMaxM2Config.convert_rope_params_to_dict``), as bumblebee does and as
    the released model computes: where the config did not, the test does, as those releases do."""
    cfg = transformers.MiniMaxM2Config(
        **{k: v for k, v in {**BASE, **overrides}.items() if v is not None}
    )
    rotary_dim, rope = getattr(cfg, "rotary_dim", None), cfg.rope_parameters
    if rotary_dim is not None and "partial_rotary_factor" not in rope:
        rope["partial_rotary_factor"] = rotary_dim / cfg.head_dim
    return cfg


def hf_model(seed: int, **overrides):
    return pu.hf_model(transformers.MiniMaxM2ForCausalLM, hf_config(**overrides), seed)


def to_bumblebee_name(name: str) -> str:
    """transformers' in-memory name -> bumblebee's."""
    return name.replace("mlp.experts.gate_up_proj", "mlp.experts.w_gate_up").replace(
        "mlp.experts.down_proj", "mlp.experts.w_down"
    )


def grads(bb, hf):
    return pu.renamed_grads(bb, hf, to_bumblebee_name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_hf(name, tmp_path):
    hf = hf_model(0, **CONFIGS[name])
    bb = pu.load(hf, tmp_path, "minimax_m2")
    pu.assert_logits_and_grads(bb, hf, T, grads)


def test_to_hf_released_names_round_trip_and_packed_rows(tmp_path):
    hf = hf_model(1)
    bb = pu.load(hf, tmp_path / "src", "minimax_m2")
    model_cls = transformers.MiniMaxM2ForCausalLM
    pu.assert_to_hf_loads(bb, model_cls, tmp_path / "out", T, src=tmp_path / "src")
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in out
    assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in out
    pu.assert_packed_rows(bb, hf, [13, 20, 2, 5])


def test_block_fp8_directory_loads_dequantized(tmp_path):
    """MiniMax's released format: fp8 attention and expert matrices, each with its block scales
    (16 x 24 here, so blocks end inside a matrix); router, norms, embedding and head unquantized."""
    hf_model(2).save_pretrained(tmp_path)
    tensors, ref = load_file(tmp_path / "model.safetensors"), {}
    b0, b1 = 16, 24
    matrices = ("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")
    for name in [n for n in tensors if n.endswith(matrices)]:
        w = tensors[name]
        R, C = w.shape  # zero-padded to whole blocks for the block maxima
        padded = F.pad(w, (0, -C % b1, 0, -R % b0))
        scale = padded.unflatten(0, (-1, b0)).unflatten(-1, (-1, b1)).abs().amax((1, 3)) / 448.0
        full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:R, :C]
        q = (w / full).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
        ref[name] = q.float() * full
    assert len(ref) == 2 * (4 + 8 * 3)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "float8_e4m3fn",
        "quant_method": "fp8",
        "weight_block_size": [b0, b1],
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    bb = bumblebee.from_hf(str(tmp_path))
    got = dict(bumblebee.models.hf.hf_state_dict(bb))
    assert set(got) == {n for n in tensors if not n.endswith("_scale_inv")}
    for name, t in got.items():
        assert torch.equal(t, ref.get(name, tensors[name])), name


def test_released_config_keys_and_refusals():
    released = {k: v for k, v in PRESETS["minimax-m2"].items() if k != "rope_parameters"}
    released.update(
        rope_theta=5e6, use_qk_norm=True, qk_norm_type="per_layer", attn_type_list=[1] * 62
    )
    arch = arch_from_hf_dict(released)  # top-level rope_theta and the legacy rotary_dim
    assert (arch.rotary_dim, arch.rope_theta) == (64, 5e6)
    assert arch.to_hf_dict()["rotary_dim"] == 64
    for bad, match in (
        ({"qk_norm_type": "per_head"}, "qk_norm_type"),
        ({"attn_type_list": [0, 1]}, "attn_type_list"),
        ({"intermediate_size": None}, "missing intermediate_size"),
    ):
        with pytest.raises(ConfigError, match=match):
            arch_from_hf_dict({**released, **bad})
    tiny = bumblebee.build_model(arch_from_hf_dict(dict(PRESETS["tiny"])))
    attn = tiny.model.layers[0].self_attn
    half = attn.n_heads // 2 * attn.head_dim  # what a rank would hold with its heads split over 2
    attn.q_proj = torch.nn.Linear(attn.q_proj.in_features, half, bias=False)
    attn.q_norm = bumblebee.primitives.norms.RMSNorm(half)
    with pytest.raises(ConfigError, match="all heads"):
        tiny(torch.randint(0, 272, (1, 8)))


def test_kv_cache_decoding_equals_full_forward():
    """Prefill + one cached step (the RL sampler's path) through the all-heads q/k norm."""
    model = bumblebee.build_model(arch_from_hf_dict(dict(PRESETS["tiny"])), seed=0).eval()
    ids, pos = torch.randint(0, 272, (2, 9)), torch.arange(9).expand(2, 9)
    cache = model.new_kv_cache(rows=2, length=9)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    prefill = model.forward_cached(ids[:, :8], pos[:, :8], cache, 0, causal)
    step = model.forward_cached(ids[:, 8:], pos[:, 8:], cache, 8, None)
    with torch.no_grad():
        full = model(ids).float()
    torch.testing.assert_close(torch.cat([prefill, step], dim=1), full, rtol=1e-5, atol=1e-5)


def test_engine_streams_released_and_transformers_names(tmp_path):
    """The RL Engine's weight stream: ``names="transformers"`` loads strictly into a transformers
    model (router bias on the MoE block) with equal logits; ``names="hf"`` gives the released
    names, also for experts streamed in pieces (buckets smaller than one expert stack)."""
    from bumblebee import load_config
    from bumblebee.rl.engine import Engine

    small = ["model.name=minimax_m2", "model.arch.num_hidden_layers=2", "model.arch.hidden_size=32",
             "model.arch.num_local_experts=4", "model.arch.intermediate_size=16",
             "primitives.attention=sdpa", "train.global_batch=2", f"train.out_dir={tmp_path}"]  # fmt: skip
    e = Engine(load_config(None, small))
    with torch.no_grad():
        for p in e.model.parameters():  # not the init: a tensor under a wrong name would show
            p.add_(torch.randn_like(p) * 0.02)
    cfg = transformers.MiniMaxM2Config(
        **{**e.arch.to_hf_dict(), "bos_token_id": None, "eos_token_id": None}
    )
    hf = transformers.MiniMaxM2ForCausalLM(cfg).float().eval()

    def stream(names):
        buckets = e.weight_buckets(bucket_bytes=4 << 10, dtype=torch.float32, names=names)
        return {n: t.clone() for b in buckets for n, t in b}

    result = hf.load_state_dict(stream("transformers"), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    ids = torch.randint(0, e.arch.vocab_size, (2, 12))
    with torch.no_grad():
        assert (hf(ids).logits - e.model(ids)).abs().max().item() < 1e-4
    hf.save_pretrained(tmp_path / "ref")
    released = stream("hf")
    ref = load_file(tmp_path / "ref" / "model.safetensors")
    assert set(released) == set(ref) and all(torch.equal(released[n], ref[n]) for n in ref)

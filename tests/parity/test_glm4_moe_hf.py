"""Parity of bumblebee's GLM-4.5 family with Hugging Face ``transformers``' ``Glm4MoeForCausalLM``.

Tiny random models are saved with ``save_pretrained`` and loaded with ``bumblebee.from_hf``;
configurations vary q/k norm (GLM-4.5 on, Air off), q/k/v biases, the rotary fraction, GQA
groups, dense first layers, group-limited routing, shared experts, the scaling factor and tied
embeddings. Every 1-D parameter (norms, biases) and the router's selection bias are perturbed.

- logits (fp32): 1e-4 max-abs against HF;
- gradients (fp32): every parameter within 1e-4 relative after one backward;
- ``to_hf`` writes a directory ``transformers`` loads with equal logits, and bumblebee reads its
  own output bit for bit (router bias included); a packed row equals HF on each document;
- MTP (``model.layers.{L + k}``, DeepSeek-V3's layout; ``transformers`` drops these tensors on
  load): the main + MTP loss and every gradient against HF's generic ``MtpModel`` over
  ``Glm4MoeDecoderLayer`` (as test_mtp_hf.py does for DeepSeek-V3), and a bit-exact round trip.
"""

from __future__ import annotations

import parity_utils as pu
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

import bumblebee

VOCAB, T = pu.VOCAB, 40
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    max_position_embeddings=256,
    num_mtp_layers=0,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
)
CONFIGS = {
    "qknorm_bias_groups4of2": {},
    "air_noqknorm_dense2_shared2_tied": dict(
        num_hidden_layers=4,
        first_k_dense_replace=2,
        use_qk_norm=False,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        tie_word_embeddings=True,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
    ),
    "nobias_fullrope": dict(
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0},
    ),  # fmt: skip
}


def hf_model(seed: int, **overrides):
    config = transformers.Glm4MoeConfig(**{**BASE, **overrides})
    return pu.hf_model(transformers.Glm4MoeForCausalLM, config, seed)


def hf_name(name: str) -> str:
    return name.replace("mlp.experts.w_gate_up", "mlp.experts.gate_up_proj").replace(
        "mlp.experts.w_down", "mlp.experts.down_proj"
    )


def checkpoint_grads(bb, hf_grads):
    """(name, bumblebee's gradient, the one in ``hf_grads``: checkpoint name -> gradient)."""
    grads = {n: p.grad for n, p in bb.named_parameters()}
    out = bumblebee.models.family_of(bb.arch).hf_name_out
    assert {hf_name(out(bb.arch, n)) for n in grads} == set(hf_grads)
    return [(n, g, hf_grads[hf_name(out(bb.arch, n))]) for n, g in grads.items()]


def grads(bb, hf):
    return checkpoint_grads(bb, {n: p.grad for n, p in hf.named_parameters()})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_hf(name, tmp_path):
    hf = hf_model(0, **CONFIGS[name])
    bb = pu.load(hf, tmp_path, "glm4_moe")
    assert bb.mtp is None
    pu.assert_logits_and_grads(bb, hf, T, grads)


def test_to_hf_round_trip_and_packed_rows(tmp_path):
    hf = hf_model(1, **CONFIGS["air_noqknorm_dense2_shared2_tied"])
    bb = pu.load(hf, tmp_path / "src", "glm4_moe")
    pu.assert_to_hf_loads(bb, transformers.Glm4MoeForCausalLM, tmp_path / "out", T, "state_dict")
    pu.assert_packed_rows(bb, hf, [13, 20, 2, 5])


def build_with_mtp(path, depth: int, seed: int = 0):
    """(HF main model, HF MtpModel) saved as one checkpoint at ``path`` under GLM's released MTP
    names: ``model.layers.{L + k}.{enorm, hnorm, eh_proj, shared_head.norm, <layer>}`` plus the
    copies of the embedding and head."""
    torch.manual_seed(seed)
    cfg = transformers.Glm4MoeConfig(**{**BASE, "num_mtp_layers": depth})
    main = transformers.Glm4MoeForCausalLM(cfg)
    mtp = MtpModel(main, depth)
    with torch.no_grad():  # MtpModel leaves some expert tensors of later depths uninitialized
        for _, p in mtp.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    pu.perturb(main, mtp)
    main, mtp = main.float().eval(), mtp.float().eval()
    main.save_pretrained(path)
    tensors, L = load_file(path / "model.safetensors"), cfg.num_hidden_layers
    for name, t in mtp.state_dict().items():
        if (ours := mtp_name(L, name)) is None:
            continue
        if ours.endswith("experts.gate_up_proj"):  # released checkpoints: one tensor per expert
            F_ = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[ours.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :F_].clone()
                tensors[ours.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, F_:].clone()
        elif ours.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                tensors[ours.replace("down_proj", f"{e}.down_proj.weight")] = t[e].clone()
        else:
            tensors[ours] = t.contiguous().clone()
    for k in range(depth):
        tensors[f"model.layers.{L + k}.embed_tokens.weight"] = (
            main.model.embed_tokens.weight.clone()
        )
        tensors[f"model.layers.{L + k}.shared_head.head.weight"] = main.lm_head.weight.clone()
    save_file({n: t.detach().contiguous() for n, t in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    return main, mtp


def mtp_name(L: int, name: str) -> str | None:
    """MtpModel name -> GLM's checkpoint name (None: the shared embedding / head)."""
    if name.startswith(("embed_tokens", "shared_head")):
        return None
    _, k, rest = name.split(".", 2)
    rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
    return f"model.layers.{L + int(k)}.{rest}"


def hf_mtp_loss(main, mtp, ids, depth):
    """Summed CE of the main head plus every MTP depth, HF modules run depth by depth."""
    h = main.model(ids).last_hidden_state
    loss = F.cross_entropy(
        main.lm_head(h)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum"
    )
    pos = torch.arange(T)[None].expand(ids.shape[0], T)
    for j in range(depth):
        n = T - (j + 1)
        h = pu.mtp_step(mtp, j, h[:, :n], pos[:, :n], ids[:, j + 1 : j + 1 + n])
        logits = mtp.shared_head(h)[:, : n - 1]
        loss = loss + F.cross_entropy(
            logits.reshape(-1, VOCAB), ids[:, j + 2 :].reshape(-1), reduction="sum"
        )
    return loss


def test_mtp_loss_grads_and_round_trip(tmp_path):
    depth = 2
    main, mtp = build_with_mtp(tmp_path / "src", depth)
    bb = bumblebee.from_hf(str(tmp_path / "src"))
    assert bb.mtp_modules() == depth
    assert bb.arch.num_params()["total"] == sum(p.numel() for p in bb.parameters())
    bb.set_mtp("auto", loss_weight=float(depth))  # weight / depth = 1: every depth counts once
    ids = torch.randint(0, VOCAB, (2, T))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    terms = bb.loss_terms(ids, labels)
    ref = hf_mtp_loss(main, mtp, ids, depth)
    assert abs(terms.loss_sum.item() - ref.item()) < 1e-4 * ref.item()
    terms.loss_sum.backward()
    ref.backward()
    L = main.config.num_hidden_layers
    hf_grads = {n: p.grad for n, p in main.named_parameters()}
    hf_grads.update({mtp_name(L, n): p.grad for n, p in mtp.named_parameters() if mtp_name(L, n)})
    pu.assert_grads_close(checkpoint_grads(bb, hf_grads))
    bumblebee.to_hf(bb, str(tmp_path / "out"))
    src, out = (load_file(tmp_path / d / "model.safetensors") for d in ("src", "out"))
    assert set(src) == set(out) and all(torch.equal(src[n], out[n]) for n in src)

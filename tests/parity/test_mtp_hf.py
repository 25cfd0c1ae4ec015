"""Multi-token prediction (models/mtp.py) against Hugging Face ``transformers``' generic ``MtpModel``.

``transformers`` builds MTP modules for a main model (``modeling_layers.MtpModel``: per depth
``eh_proj`` over [enorm(embedding of token i+k) ; hnorm(previous hidden state)], one decoder
layer of the main model's class, ``post_norm``; embedding and head shared). The checkpoints
here are HF main models saved with ``save_pretrained`` plus the MTP tensors written under
each family's released names:

- DeepSeek-V3: ``model.layers.{L + k}.{enorm, hnorm, eh_proj, shared_head.norm, <layer>}``
  (plus the copies ``embed_tokens`` / ``shared_head.head`` the released checkpoint carries);
- Qwen3.5: ``mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.0.<layer>, norm}``
  (one gated full-attention MoE layer; ``MtpModel`` with one depth is the same computation).

Checked: the main + MTP loss (loss weight = depth, so every depth counts once) and every
parameter's gradient within 1e-4 relative of HF run depth by depth; bit-exact ``to_hf`` round
trips of the MTP tensors; packed rows equal separate documents (targets never cross a
document); and a tiny DeepSeek-V3 with MTP learns (both losses fall).
"""

from __future__ import annotations

import json

import parity_utils as pu
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

import bumblebee

VOCAB, T = 97, 40
DSV3 = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=24,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    max_position_embeddings=256,
)
QWEN = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=40,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    tie_word_embeddings=False,
)
QWEN_MTP_NAMES = {
    "enorm": "pre_fc_norm_embedding",
    "hnorm": "pre_fc_norm_hidden",
    "eh_proj": "fc",
    "post_norm": "norm",
}


def perturb(*models):
    with torch.no_grad():
        for m in models:
            for _, p in m.named_parameters():
                if p.dim() == 1:
                    p.add_(0.2 * torch.randn_like(p))
            for name, b in m.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.05 * torch.randn_like(b))


def mtp_name(family: str, L: int, name: str) -> str | None:
    """MtpModel name -> the released checkpoint's name (None: shared embedding / head)."""
    if name.startswith(("embed_tokens", "shared_head")):
        return None
    _, k, rest = name.split(".", 2)
    if family == "deepseek_v3":
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        return f"model.layers.{L + int(k)}.{rest}"
    first, _, tail = rest.partition(".")
    return (
        f"mtp.layers.{k}.{tail}" if first == "mtp_block" else f"mtp.{QWEN_MTP_NAMES[first]}.{tail}"
    )


def build(family: str, depth: int, path, seed: int = 0):
    """(HF main model, HF MtpModel) saved as one checkpoint at ``path``."""
    torch.manual_seed(seed)
    if family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(**DSV3, num_mtp_layers=depth)
        main = transformers.DeepseekV3ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3_5MoeTextConfig(**QWEN)
        cfg.num_mtp_layers, cfg.mtp_layer_types = depth, ["full_attention"] * depth
        main = transformers.Qwen3_5MoeForCausalLM(cfg)
    mtp = MtpModel(main, depth)
    with torch.no_grad():  # MtpModel leaves some expert tensors of later depths uninitialized
        for _, p in mtp.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    perturb(main, mtp)
    main, mtp = main.float().eval(), mtp.float().eval()
    main.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    L = cfg.num_hidden_layers
    for name, t in mtp.state_dict().items():
        if (ours := mtp_name(family, L, name)) is None:
            continue
        if ours.endswith(
            "experts.gate_up_proj"
        ):  # released checkpoints store one tensor per expert
            F_ = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[ours.replace("gate_up_proj", f"{e}.gate_proj.weight")] = (
                    t[e, :F_].contiguous().clone()
                )
                tensors[ours.replace("gate_up_proj", f"{e}.up_proj.weight")] = (
                    t[e, F_:].contiguous().clone()
                )
        elif ours.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                tensors[ours.replace("down_proj", f"{e}.down_proj.weight")] = (
                    t[e].contiguous().clone()
                )
        else:
            tensors[ours] = t.contiguous().clone()
    if family == "deepseek_v3":
        for k in range(depth):
            tensors[f"model.layers.{L + k}.embed_tokens.weight"] = (
                main.model.embed_tokens.weight.detach().clone()
            )
            tensors[f"model.layers.{L + k}.shared_head.head.weight"] = (
                main.lm_head.weight.detach().clone()
            )
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if family == "qwen3_5_moe":
        cfg_d = json.loads((path / "config.json").read_text())
        cfg_d["mtp_num_hidden_layers"] = depth
        (path / "config.json").write_text(json.dumps(cfg_d))
    return main, mtp


def hf_loss(main, mtp, ids, depth):
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


def shifted_labels(ids):
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    return labels


@pytest.mark.parametrize(
    "family,depth", [("deepseek_v3", 1), ("deepseek_v3", 2), ("qwen3_5_moe", 1)]
)
def test_mtp_loss_and_grads_match_hf(family, depth, tmp_path, monkeypatch):
    if (
        family == "qwen3_5_moe"
    ):  # HF's chunked GDN fallback is ~1e-3 off on dt_bias / A_log gradients
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_mod

        def recurrent(
            query,
            key,
            value,
            g,
            beta,
            chunk_size=64,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=False,
            **_,
        ):
            return hf_mod.torch_recurrent_gated_delta_rule(
                query,
                key,
                value,
                g,
                beta,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )

        monkeypatch.setattr(hf_mod, "torch_chunk_gated_delta_rule", recurrent)
    main, mtp = build(family, depth, tmp_path)
    bb = bumblebee.from_hf(str(tmp_path))
    assert bb.mtp_modules() == depth
    assert bb.arch.num_params()["total"] == sum(p.numel() for p in bb.parameters())
    bb.set_mtp("auto", loss_weight=float(depth))  # weight / depth = 1: every depth counts once
    ids = torch.randint(0, VOCAB, (2, T))
    terms = bb.loss_terms(ids, shifted_labels(ids))
    ref = hf_loss(main, mtp, ids, depth)
    assert abs(terms.loss_sum.item() - ref.item()) < 1e-4 * ref.item()
    assert [int(n) for n in terms.mtp_tokens] == [2 * (T - 1 - k) for k in range(1, depth + 1)]
    terms.loss_sum.backward()
    ref.backward()
    grads = {n: p.grad for n, p in bb.named_parameters()}
    L = main.config.num_hidden_layers
    hf_grads = {n: p.grad for n, p in main.named_parameters()}
    hf_grads.update(
        {
            mtp_name(family, L, n): p.grad
            for n, p in mtp.named_parameters()
            if mtp_name(family, L, n)
        }
    )
    family_out = bumblebee.models.family_of(bb.arch).hf_name_out or (lambda a, n: n)
    checked = 0
    for name, g in grads.items():
        hf_name = (
            family_out(bb.arch, name)
            .replace("mlp.experts.w_gate_up", "mlp.experts.gate_up_proj")
            .replace("mlp.experts.w_down", "mlp.experts.down_proj")
        )
        g_ref = hf_grads[hf_name]
        assert ((g - g_ref).abs().max() / g_ref.abs().max().clamp_min(1e-12)).item() < 1e-4, name
        checked += 1
    assert checked == len(hf_grads) and any(n.startswith("mtp.") for n in grads)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_moe"])
def test_mtp_tensors_round_trip_bit_exact(family, tmp_path):
    build(family, 1, tmp_path / "src", seed=1)
    bb = bumblebee.from_hf(str(tmp_path / "src"))
    bumblebee.to_hf(bb, str(tmp_path / "out"))
    src, out = (
        load_file(tmp_path / "src" / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    mtp_names = [
        n
        for n in src
        if n.startswith("mtp.") or n.startswith(f"model.layers.{DSV3['num_hidden_layers']}.")
    ]
    assert mtp_names and all(torch.equal(src[n], out[n]) for n in mtp_names)
    back = bumblebee.from_hf(str(tmp_path / "out"))
    assert back.mtp_modules() == 1
    for (n, a), (_, b) in zip(bb.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n


def test_packed_rows_equal_separate_documents(tmp_path):
    build("deepseek_v3", 2, tmp_path, seed=2)
    bb = bumblebee.from_hf(str(tmp_path))
    lengths = [9, 17, 2, 12]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)))
    docs = ids.split(lengths, dim=1)
    labels = torch.cat([shifted_labels(d) for d in docs], dim=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = bb.loss_terms(ids, labels, pos)
    alone = [bb.loss_terms(d, shifted_labels(d)) for d in docs]
    for k in range(2):
        assert int(packed.mtp_tokens[k]) == sum(int(a.mtp_tokens[k]) for a in alone)
        assert abs(packed.mtp_sums[k].item() - sum(a.mtp_sums[k].item() for a in alone)) < 1e-4


def test_tiny_deepseek_learns_with_mtp():
    """A tiny DeepSeek-V3 with two MTP depths on a repeating sequence: the main and every MTP
    loss fall over a few AdamW steps (the MTP modules get gradients through the shared head)."""
    from bumblebee.config import PrimitivesConfig
    from bumblebee.models import arch_from_hf_dict, build_model
    from bumblebee.models.presets import preset

    torch.manual_seed(0)
    arch = arch_from_hf_dict(
        {**preset("deepseek_v3", "tiny"), "num_nextn_predict_layers": 2, "num_hidden_layers": 2}
    )
    model = build_model(arch, PrimitivesConfig(moe_comm="local", recompute="none"))
    model.set_mtp("auto", 0.3)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.arange(64).remainder(13)[None].repeat(2, 1) + 5
    labels = shifted_labels(ids)
    first = None
    for _ in range(12):
        terms = model.loss_terms(ids, labels)
        (terms.loss_sum / terms.num_tokens).backward()
        opt.step()
        opt.zero_grad()
        now = [terms.loss_sum.item() - 0.3 / 2 * sum(s.item() for s in terms.mtp_sums)] + [
            (s / n).item() for s, n in zip(terms.mtp_sums, terms.mtp_tokens)
        ]
        first = first or now
    assert all(b < 0.5 * a for a, b in zip(first, now)), (first, now)

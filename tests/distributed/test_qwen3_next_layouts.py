"""Qwen3-Next (Gated DeltaNet with fused qkvz / ba projections + gated attention, routed + gated
shared experts, one MTP depth with Qwen3.5's layout) on 2 gloo ranks equals the single process on
the same global batch: per-step loss and grad norm for fsdp2 + EP all-to-all, CP (the GDN state
carried across zigzag shards by the affine scan, attention over the ring; MTP's targets shifted
on the global row) and pipeline (MTP on the last stage). One spawn runs every layout. A tiny
``transformers`` checkpoint trains from its HF directory and exports back bit for bit."""

import transformers
from family_layouts import check_layouts, train_from_hf_and_export

BASE = [
    "model.name=qwen3_next",
    "model.arch.num_hidden_layers=2",
    "model.arch.layer_types=['linear_attention', 'full_attention']",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=32",
    "model.arch.shared_expert_intermediate_size=32",
    "model.arch.linear_key_head_dim=16",
    "model.arch.linear_value_head_dim=16",
    "model.arch.head_dim=16",
    "model.arch.vocab_size=256",
    "model.arch.mtp_num_hidden_layers=1",
    "mtp.loss_weight=0.3",
    "train.balance=micro_batch",  # what a pipeline schedule needs: every layout uses it
]
STEPS = 2
CASES = [
    ["primitives.sharding=fsdp2", "parallel.ep=2", "primitives.moe_comm=alltoall"],
    [
        "parallel.cp=2",
        "primitives.sharding=fsdp2",
        "primitives.cp_attention=ring",
        "primitives.recompute=full",
    ],
    ["parallel.pp=2", "primitives.pipeline=1f1b", "primitives.sharding=fsdp2"],
]


def test_two_ranks_match_single_process(tmp_path):
    check_layouts(tmp_path, BASE, CASES, STEPS)


def test_train_from_hf_directory_and_export_bit_exact(tmp_path):
    cfg = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    train_from_hf_and_export(tmp_path, transformers.Qwen3NextForCausalLM, cfg, "qwen3_next")

"""GLM-4.5 family (GQA with q/k/v biases, q/k norm and partial RoPE; dense first layer, shared
expert, group-limited sigmoid routing; one MTP depth) on 2 gloo ranks equals the single process
on the same global batch: per-step loss and grad norm for fsdp2 + EP all-to-all, CP ring (every
head whole on every rank, MTP's targets shifted on the global row) and pipeline (MTP on the last
stage). One spawn runs every layout. A tiny ``transformers`` checkpoint trains from its HF
directory and exports back bit for bit."""

import transformers
from family_layouts import check_layouts, train_from_hf_and_export

BASE = [
    "model.name=glm4_moe",
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=96",
    "model.arch.moe_intermediate_size=32",
    "model.arch.vocab_size=256",
    "model.arch.n_routed_experts=8",
    "model.arch.n_group=4",
    "model.arch.topk_group=2",
    "model.arch.num_experts_per_tok=3",
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
    cfg = transformers.Glm4MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, num_mtp_layers=0,
    )  # fmt: skip
    trace, _, out = train_from_hf_and_export(
        tmp_path, transformers.Glm4MoeForCausalLM, cfg, "glm4_moe"
    )
    assert trace[1][0] < trace[0][0] + 1.0
    assert out.mtp is None

"""MiniMax-M2 family (GQA with q/k RMSNorm over all heads of a token and partial RoPE; sigmoid
routing with a correction bias in every layer) on 2 gloo ranks equals the single process on the
same global batch: per-step loss and grad norm for fsdp2 + EP all-to-all, zero1 + EP, CP ring
(the all-heads norm is per token: nothing crosses ranks) and pipeline 1F1B. One spawn runs every
layout. A tiny ``transformers`` checkpoint (the released names) trains from its HF directory and
exports back bit for bit."""

import transformers
from family_layouts import check_layouts, train_from_hf_and_export
from safetensors.torch import load_file

BASE = [
    "model.name=minimax_m2",
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=32",
    "model.arch.vocab_size=256",
    "model.arch.num_local_experts=8",
    "model.arch.num_experts_per_tok=3",
    "train.balance=micro_batch",  # what a pipeline schedule needs: every layout uses it
]
STEPS = 2
CASES = [
    ["primitives.sharding=fsdp2", "parallel.ep=2", "primitives.moe_comm=alltoall"],
    ["primitives.sharding=zero1", "parallel.ep=2", "primitives.moe_comm=alltoall"],
    ["parallel.cp=2", "primitives.sharding=fsdp2", "primitives.cp_attention=ring"],
    ["parallel.pp=2", "primitives.pipeline=1f1b", "primitives.sharding=fsdp2"],
]


def test_two_ranks_match_single_process(tmp_path):
    check_layouts(tmp_path, BASE, CASES, STEPS, step1=1e-6, later=1e-6)


def test_train_from_hf_directory_and_export_bit_exact(tmp_path):
    cfg = transformers.MiniMaxM2Config(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8,
        num_local_experts=8, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    trace, src, _ = train_from_hf_and_export(
        tmp_path, transformers.MiniMaxM2ForCausalLM, cfg, "minimax_m2"
    )
    assert trace[1][0] < trace[0][0]
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(src)

"""Qwen3-Next (Gated DeltaNet with fused qkvz / ba projections + gated attention, routed + gated
shared experts, one MTP depth with Qwen3.5's layout) on 2 gloo ranks equals the single process on
the same global batch: per-step loss and grad norm for fsdp2 + EP all-to-all, CP (the GDN state
carried across zigzag shards by the affine scan, attention over the ring; MTP's targets shifted
on the global row) and pipeline (MTP on the last stage). One spawn runs every layout. A tiny
``transformers`` checkpoint trains from its HF directory and exports back bit for bit."""

import torch
import transformers
from dist_utils import run_distributed
from family_layouts import check, ranks, run, write_data
from safetensors.torch import load_file

import bumblebee
from bumblebee.models.base import persistent_buffers
from bumblebee.runtime.checkpoint.export import export_checkpoint

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
    data = write_data(tmp_path / "docs.jsonl")
    ref = run(BASE, ["primitives.sharding=none", "primitives.moe_comm=local"], data,
              str(tmp_path / "ref"), STEPS)  # fmt: skip
    per_rank = run_distributed(ranks, 2, BASE, CASES, data, str(tmp_path / "runs"), STEPS)
    for i, ov in enumerate(CASES):
        for trace in [r[i] for r in per_rank]:  # (pipeline: the loss on every rank)
            check(trace, ref, " ".join(ov))


def test_train_from_hf_directory_and_export_bit_exact(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    transformers.Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    # bf16 in, bf16 out: every tensor bit for bit
    bumblebee.to_hf(bumblebee.from_hf(str(tmp_path / "src"), torch.bfloat16), str(tmp_path / "rt"))
    src, rt = (load_file(tmp_path / d / "model.safetensors") for d in ("src", "rt"))
    assert set(src) == set(rt) and all(torch.equal(src[n], rt[n]) for n in src)
    # trains from the directory; the checkpoint exports to the trained parameters exactly
    data = write_data(tmp_path / "docs.jsonl")
    over = [f"model.hf_path={tmp_path / 'src'}", "primitives.sharding=none", "primitives.moe_comm=local"]  # fmt: skip
    _, saved, state = run(["model.name=qwen3_next"], over, data, str(tmp_path / "run"), 2, True)
    export_checkpoint(saved, str(tmp_path / "out"), dtype="float32")
    out = bumblebee.from_hf(str(tmp_path / "out"))
    for name, t in list(out.named_parameters()) + persistent_buffers(out):
        assert torch.equal(t, state[name]), name
    back = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ids = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        assert (back(ids).logits - out(ids)).abs().max().item() < 1e-4

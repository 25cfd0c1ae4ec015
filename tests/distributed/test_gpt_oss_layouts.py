"""gpt-oss family (sinks, a sliding layer with a window shorter than a CP chunk and a full layer,
biased top-k-then-softmax router, biased clamped-SwiGLU experts) on 2 gloo ranks equals the
single process on the same global batch: per-step loss and grad norm for fsdp2 + EP all-to-all,
CP ring (the window masks the tiles and picks the blocks to exchange; sinks merged into the
final LSE) with zero1, and pipeline (the window ring at 4 ranks and allgather with the same
options: tests/unit/test_attention_options.py). One spawn runs every layout. A tiny ``transformers``
checkpoint (bf16) round-trips bit for bit, trains from its HF directory and exports back to the
trained parameters exactly."""

import torch
import transformers
from dist_utils import run_distributed
from family_layouts import check, ranks, run, write_data
from safetensors.torch import load_file

import bumblebee
from bumblebee.runtime.checkpoint.export import export_checkpoint

BASE = [
    "model.name=gpt_oss",
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=32",
    "model.arch.sliding_window=12",
    "train.balance=micro_batch",  # what a pipeline schedule needs: every layout uses it
]
STEPS = 2
CASES = [
    ["primitives.sharding=fsdp2", "parallel.ep=2", "primitives.moe_comm=alltoall"],
    [
        "parallel.cp=2",
        "primitives.sharding=zero1",
        "primitives.cp_attention=ring",
        "primitives.recompute=full",
    ],  # fmt: skip
    ["parallel.pp=2", "primitives.pipeline=1f1b", "primitives.sharding=fsdp2"],
]


def test_two_ranks_match_single_process(tmp_path):
    data = write_data(tmp_path / "docs.jsonl")
    ref = run(BASE, ["primitives.sharding=none", "primitives.moe_comm=local"], data,
              str(tmp_path / "ref"), STEPS)  # fmt: skip
    per_rank = run_distributed(ranks, 2, BASE, CASES, data, str(tmp_path / "runs"), STEPS)
    for i, ov in enumerate(CASES):
        for trace in [r[i] for r in per_rank]:  # (pipeline: the loss on every rank)
            check(trace, ref, " ".join(ov), step1=1e-6, later=1e-6)  # measured <= 8.7e-8


def test_train_from_hf_directory_and_export_bit_exact(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=12,
        num_local_experts=8, num_experts_per_tok=2,
    )  # fmt: skip
    transformers.GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    # bf16 in, bf16 out: every tensor bit for bit (fused, transposed, interleaved experts)
    bumblebee.to_hf(bumblebee.from_hf(str(tmp_path / "src"), torch.bfloat16), str(tmp_path / "rt"))
    src, rt = (load_file(tmp_path / d / "model.safetensors") for d in ("src", "rt"))
    assert set(src) == set(rt) and all(torch.equal(src[n], rt[n]) for n in src)
    # trains from the directory; the checkpoint exports to the trained parameters exactly
    data = write_data(tmp_path / "docs.jsonl")
    over = [f"model.hf_path={tmp_path / 'src'}", "primitives.sharding=none", "primitives.moe_comm=local"]  # fmt: skip
    trace, saved, state = run(["model.name=gpt_oss"], over, data, str(tmp_path / "run"), 2, True)
    assert trace[1][0] < trace[0][0] + 1.0
    export_checkpoint(saved, str(tmp_path / "out"), dtype="float32")
    out = bumblebee.from_hf(str(tmp_path / "out"))
    for name, t in out.named_parameters():
        assert torch.equal(t, state[name]), name
    back = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    back.config._attn_implementation = "eager"
    ids = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        assert (back(ids).logits - out(ids)).abs().max().item() < 1e-4

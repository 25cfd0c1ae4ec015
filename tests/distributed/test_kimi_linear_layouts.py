"""Kimi Linear (KDA + NoPE MLA, DeepSeek MoE) across layouts, against the single process on the
same global batch (gloo):

- 2 ranks, one spawn: fsdp2 + EP all-to-all, CP 2 (KDA's state by the affine scan over the
  zigzag chunks, MLA over the latent ring, full recompute), CP 2 with the relay carry, and
  pipeline 2; plus one KDA layer on cp=2 shards against the whole sequence (output, input and
  weight gradients);
- 4 ranks, one spawn: CP 4 (latent all-gather for MLA) and the KDA layer on cp=4 shards;
- CP runs give the cp=1 loss trace to 1e-6 relative (fp32) at every step;
- a tiny ``transformers`` checkpoint trains from its HF directory and exports back bit for bit.
"""

import torch
import transformers
from dist_utils import run_distributed
from family_layouts import check, run, write_data
from safetensors.torch import load_file

import bumblebee
from bumblebee.models.base import persistent_buffers
from bumblebee.primitives.cp.layout import build_cp_layout, shard_sequence, unshard_sequence
from bumblebee.primitives.linear_attention.cp import gated_delta_net_cp
from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_chunked
from bumblebee.primitives.linear_attention.kda import KimiDeltaAttention
from bumblebee.primitives.packed import doc_layout
from bumblebee.primitives.recompute import NoRecompute
from bumblebee.runtime.checkpoint.export import export_checkpoint

BASE = [
    "model.name=kimi_linear",
    "model.arch.num_hidden_layers=2",
    "model.arch.layer_types=['linear_attention', 'full_attention']",
    "model.arch.mlp_layer_types=['dense', 'sparse']",
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=96",
    "model.arch.moe_intermediate_size=32",
    "model.arch.linear_head_dim=16",
    "model.arch.kv_lora_rank=16",
    "model.arch.qk_nope_head_dim=16",
    "model.arch.qk_rope_head_dim=8",
    "model.arch.v_head_dim=16",
    "model.arch.vocab_size=256",
    "train.balance=micro_batch",  # what a pipeline schedule needs: every layout uses it
]
STEPS = 2
CP2 = ["parallel.cp=2", "primitives.sharding=fsdp2", "primitives.cp=ring", "primitives.recompute=full"]  # fmt: skip
CASES = [
    ["primitives.sharding=fsdp2", "parallel.ep=2", "primitives.moe_comm=alltoall"],
    CP2,
    CP2 + ["primitives.linear_attention_cp=relay"],
    ["parallel.pp=2", "primitives.pipeline=1f1b", "primitives.sharding=fsdp2"],
]
CP_CASES = (1, 2)
CP4 = [["parallel.cp=4", "primitives.sharding=zero1", "primitives.cp=allgather"]]
REF = ["primitives.sharding=none", "primitives.moe_comm=local"]

# ---- one KDA layer under CP ----------------------------------------------------------------
T_LAYER = 64
LAYER_DOCS = [[5, 27, 16, 16], [1, 2, 12, 49]]  # boundaries at shard edges, 1- / 2-token docs


def layer_and_inputs():
    torch.manual_seed(0)
    layer = KimiDeltaAttention(32, 2, 8, 4, 1e-5, gated_delta_rule_chunked, NoRecompute())
    with torch.no_grad():
        layer.A_log.copy_(torch.tensor([-3.0, 0.5]).view(1, 1, 2, 1))  # one slow, one fast head
    gen = torch.Generator().manual_seed(1)
    x, w = (torch.randn(len(LAYER_DOCS), T_LAYER, 32, generator=gen) for _ in range(2))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LAYER_DOCS])
    return layer, x, w, pos


def layer_cp(rank, world):
    layer, x, w, pos = layer_and_inputs()
    layout = build_cp_layout(shard_sequence(pos, world, rank), torch.distributed.group.WORLD)
    x_local = shard_sequence(x, world, rank).clone().requires_grad_()
    y = gated_delta_net_cp(layer, x_local, layout)
    (y * shard_sequence(w, world, rank)).sum().backward()
    return y.detach(), x_local.grad, {n: p.grad for n, p in layer.named_parameters()}


def check_layer(results, world):
    layer, x, w, pos = layer_and_inputs()
    x = x.clone().requires_grad_()
    y_ref, _ = layer(x, doc_layout(pos))
    (y_ref * w).sum().backward()
    got = [(unshard_sequence([r[0] for r in results]), y_ref, "output"),
           (unshard_sequence([r[1] for r in results]), x.grad, "input grad")]  # fmt: skip
    got += [(sum(r[2][n] for r in results), p.grad, n) for n, p in layer.named_parameters()]
    for a, ref, name in got:
        err = ((a - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"KDA layer cp={world}: {name} relative error {err:.1e}"


def _ranks(rank, world, cases, data, out_dir):
    traces = [run(BASE, ov, data, f"{out_dir}/{i}/{rank}", STEPS) for i, ov in enumerate(cases)]
    return traces, layer_cp(rank, world)


def check_cp(trace, ref, what):
    for (loss, _), (ref_loss, _) in zip(trace, ref):
        assert abs(loss - ref_loss) <= 1e-6 * ref_loss, (what, trace, ref)


def test_two_ranks_match_single_process(tmp_path):
    data = write_data(tmp_path / "docs.jsonl")
    ref = run(BASE, REF, data, str(tmp_path / "ref"), STEPS)
    per_rank = run_distributed(_ranks, 2, CASES, data, str(tmp_path / "runs"))
    for i, ov in enumerate(CASES):
        for traces, _ in per_rank:  # (pipeline: the loss on every rank)
            check(traces[i], ref, " ".join(ov))
            if i in CP_CASES:
                check_cp(traces[i], ref, " ".join(ov))
    check_layer([r[1] for r in per_rank], 2)


def test_cp4_matches_single_process(tmp_path):
    data = write_data(tmp_path / "docs.jsonl")
    ref = run(BASE, REF, data, str(tmp_path / "ref"), STEPS)
    per_rank = run_distributed(_ranks, 4, CP4, data, str(tmp_path / "runs"))
    for traces, _ in per_rank:
        check(traces[0], ref, "cp=4")
        check_cp(traces[0], ref, "cp=4")
    check_layer([r[1] for r in per_rank], 4)


def test_train_from_hf_directory_and_export_bit_exact(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, linear_head_dim=16,
        linear_num_heads=2, num_local_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, pad_token_id=None, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    transformers.KimiLinearForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    # bf16 in, bf16 out: every tensor bit for bit
    bumblebee.to_hf(bumblebee.from_hf(str(tmp_path / "src"), torch.bfloat16), str(tmp_path / "rt"))
    src, rt = (load_file(tmp_path / d / "model.safetensors") for d in ("src", "rt"))
    assert set(src) == set(rt) and all(torch.equal(src[n], rt[n]) for n in src)
    # trains from the directory; the checkpoint exports to the trained parameters exactly
    data = write_data(tmp_path / "docs.jsonl")
    over = [f"model.hf_path={tmp_path / 'src'}", *REF]
    _, saved, state = run(["model.name=kimi_linear"], over, data, str(tmp_path / "run"), 2, True)
    export_checkpoint(saved, str(tmp_path / "out"), dtype="float32")
    out = bumblebee.from_hf(str(tmp_path / "out"))
    for name, t in list(out.named_parameters()) + persistent_buffers(out):
        assert torch.equal(t, state[name]), name
    back = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    ids = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        assert (back(ids, use_cache=False).logits - out(ids)).abs().max().item() < 1e-4

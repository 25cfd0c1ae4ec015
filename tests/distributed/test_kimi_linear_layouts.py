"""Kimi Linear (KDA + NoPE MLA, DeepSeek MoE) across layouts, against the single process on the
same global batch (gloo):

- 2 ranks, one spawn: fsdp2 + EP all-to-all, CP 2 (KDA's state by the affine scan over the
  zigzag chunks, MLA over the latent ring, full recompute), CP 2 with the relay carry, and
  pipeline 2; plus one KDA layer on cp=2 shards against the whole sequence (output, input and
  weight gradients);
- CP runs give the cp=1 loss trace to 1e-6 relative (fp32) at every step;
- cp = 4 (latent all-gather for MLA, and the KDA layer on cp=4 shards) runs inside
  test_gdn_context_parallel.py's 4-rank spawn (``tests/kda_cp.py``: one spawn fewer);
- a tiny ``transformers`` checkpoint trains from its HF directory and exports back bit for bit.
"""

import pytest
import torch
from dist_utils import run_distributed
from family_layouts import check, run, write_data
from kda_cp import BASE, REF, STEPS, check_cp, check_layer, layer_cp, reference

CP2 = [
    "parallel.cp=2",
    "primitives.sharding=fsdp2",
    "primitives.cp_attention=ring",
    "primitives.recompute=full",
]
CASES = [
    ["primitives.sharding=fsdp2", "parallel.ep=2", "primitives.moe_comm=alltoall"],
    CP2,
    CP2 + ["primitives.linear_attention_cp=relay"],
    ["parallel.pp=2", "primitives.pipeline=1f1b", "primitives.sharding=fsdp2"],
]
CP_CASES = (1, 2)


def _ranks(rank, world, cases, data, out_dir):
    traces = [run(BASE, ov, data, f"{out_dir}/{i}/{rank}", STEPS) for i, ov in enumerate(cases)]
    return traces, layer_cp(rank, world)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("kimi") / "docs.jsonl")


@pytest.fixture(scope="module")
def ref(data, tmp_path_factory):
    return reference(data, tmp_path_factory.mktemp("kimi_ref"))


def test_two_ranks_match_single_process(data, ref, tmp_path):
    per_rank = run_distributed(_ranks, 2, CASES, data, str(tmp_path / "runs"))
    for i, ov in enumerate(CASES):
        for traces, _ in per_rank:  # (pipeline: the loss on every rank)
            check(traces[i], ref, " ".join(ov))
            if i in CP_CASES:
                check_cp(traces[i], ref, " ".join(ov))
    check_layer([r[1] for r in per_rank], 2)


def test_train_from_hf_directory_and_export_bit_exact(tmp_path):
    # imported here: the spawned ranks import this module and need none of them
    import transformers
    from safetensors.torch import load_file

    import bumblebee
    from bumblebee.models.base import persistent_buffers
    from bumblebee.runtime.checkpoint.export import export_checkpoint

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

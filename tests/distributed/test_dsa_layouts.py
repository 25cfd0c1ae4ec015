"""DeepSeek-V3.2 (MLA + DeepSeek Sparse Attention, top-16 keys of 128; dense first layer, shared
experts, sigmoid routing, one MTP depth) on 2 gloo ranks equals the single process on the same
global batch, packed documents of uneven lengths (one spans every CP shard): context parallelism
(local queries, the row's latents and indexer keys all-gathered, the top-k taken over the global
row; with fsdp2 and full recompute) gives the cp = 1 loss trace (2 steps) to 1e-6 and grad norm (the
indexer's KL gradient included). (The dense warm-up stage's CP path, local queries at global
positions against the whole row, is checked against the reference core in tests/unit/test_dsa.py.)"""

import pytest
from dist_utils import run_distributed
from family_layouts import ranks, run, write_data

BASE = [
    "model.name=deepseek_v32",
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=96",
    "model.arch.moe_intermediate_size=32",
    "model.arch.vocab_size=256",
    "model.arch.n_routed_experts=8",
    "model.arch.n_group=4",
    "model.arch.topk_group=2",
    "model.arch.num_experts_per_tok=3",
    "model.arch.index_topk=16",
    "primitives.dsa_block=24",
]
STEPS = 2
CP = ["parallel.cp=2", "primitives.sharding=fsdp2", "primitives.recompute=full"]


def test_two_ranks_match_single_process(tmp_path):
    data = write_data(tmp_path / "docs.jsonl")
    one = ["primitives.sharding=none", "primitives.moe_comm=local"]
    ref = run(BASE, one, data, str(tmp_path / "ref"), STEPS)
    for trace in run_distributed(ranks, 2, BASE, [CP], data, str(tmp_path / "runs"), STEPS):
        for step, ((loss, gnorm), (ref_loss, ref_gnorm)) in enumerate(zip(trace[0], ref)):
            assert loss == pytest.approx(ref_loss, rel=1e-6, abs=0), step
            assert gnorm == pytest.approx(ref_gnorm, rel=1e-4), step

"""DeepSeek-V3.2 (MLA + DeepSeek Sparse Attention, top-16 keys of 128; dense first layer, shared
experts, sigmoid routing, one MTP depth) on 2 gloo ranks equals the single process on the same
global batch, packed documents of uneven lengths (one spans every CP shard): context parallelism
(local queries, the row's latents and indexer keys all-gathered, the top-k taken over the global
row; with fsdp2 and full recompute) gives the cp = 1 loss trace (2 steps) to 1e-6 and grad norm (the
indexer's KL gradient included), and so do EP all-to-all and the dense warm-up stage under CP.
One spawn runs every layout."""

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
WARMUP = ["primitives.dsa_stage=dense_warmup"]
CP = ["parallel.cp=2", "primitives.sharding=fsdp2", "primitives.recompute=full"]
CASES = [CP, CP + WARMUP]


def test_two_ranks_match_single_process(tmp_path):
    data = write_data(tmp_path / "docs.jsonl")
    one = ["primitives.sharding=none", "primitives.moe_comm=local"]
    refs = [
        run(BASE, one + extra, data, str(tmp_path / f"ref{i}"), STEPS)
        for i, extra in enumerate(([], WARMUP))
    ]
    per_rank = run_distributed(ranks, 2, BASE, CASES, data, str(tmp_path / "runs"), STEPS)
    for i, ov in enumerate(CASES):
        ref = refs[1] if "primitives.dsa_stage=dense_warmup" in ov else refs[0]
        for trace in [r[i] for r in per_rank]:
            for step, ((loss, gnorm), (ref_loss, ref_gnorm)) in enumerate(zip(trace, ref)):
                assert loss == pytest.approx(ref_loss, rel=1e-6, abs=0), (ov, step)
                assert gnorm == pytest.approx(ref_gnorm, rel=1e-4), (ov, step)

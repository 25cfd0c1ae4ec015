"""DeepSeek-V3.2 (MLA + DeepSeek Sparse Attention, top-16 keys of 128; dense first layer, shared
experts, sigmoid routing, one MTP depth) on 2 gloo ranks equals the single process on the same
global batch of packed documents of uneven lengths (one spans every CP shard), trained as one
micro-batch of 4 rows:

- cp = 2 (fsdp2, full recompute, 4 micro-batches per rank): local queries, the row's indexer keys
  all-gathered, the top-k over the global row, only the selected latents fetched from their
  owners (primitives/attention/dsa_cp.py);
- dp = 2 (fsdp2, 2 micro-batches per rank): the indexer KL is a mean over the step's global
  tokens like the LM loss, so its gradient (inside the grad norm) matches one micro-batch on one
  rank;

loss trace (2 steps) to 1e-6 and grad norm to 1e-4. The same launch checks the fetched core
against the dense reference in float64 (tests/dsa_fetch_check.py; cp = 4 is run outside the
suite). (The dense warm-up stage's CP path, local queries at global positions against the whole
row, is checked against the reference core in tests/unit/test_dsa.py.)"""

import dsa_fetch_check
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
CASES = {
    "cp2": ["parallel.cp=2", "primitives.sharding=fsdp2", "primitives.recompute=full"],
    "dp2_2mb": ["primitives.sharding=fsdp2"],
}


def both(rank, world, data, out_dir):
    traces = ranks(rank, world, BASE, list(CASES.values()), data, out_dir, STEPS)
    return traces, dsa_fetch_check.rank_check(rank, world)


def test_two_ranks_match_single_process(tmp_path):
    data = write_data(tmp_path / "docs.jsonl")
    one = ["primitives.sharding=none", "primitives.moe_comm=local", "train.micro_batch=4"]
    ref = run(BASE, one, data, str(tmp_path / "ref"), STEPS)
    outs = run_distributed(both, 2, data, str(tmp_path / "runs"))
    for name, trace in zip(CASES, outs[0][0]):
        for step, ((loss, gnorm), (ref_loss, ref_gnorm)) in enumerate(zip(trace, ref)):
            assert loss == pytest.approx(ref_loss, rel=1e-6, abs=0), (name, step)
            assert gnorm == pytest.approx(ref_gnorm, rel=1e-4), (name, step)
    dsa_fetch_check.compare([o[1] for o in outs], 2)

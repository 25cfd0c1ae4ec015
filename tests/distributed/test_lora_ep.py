"""LoRA under expert parallelism on 2 gloo ranks (one launch, several layouts): with ep = 2 each
rank holds only its own experts' adapters (E / 2 stacked rows, the rows the single-process init
gives those experts), and the loss trace, the merged weights and the gathered adapters equal
the ep = 1 run's (fsdp2 over dp = 2) -- with fsdp2 and zero1."""

from __future__ import annotations

import torch
from dist_utils import run_distributed

from bumblebee import load_config
from bumblebee.models.lora import is_lora_name
from bumblebee.primitives.sharding.common import local
from bumblebee.rl.batch import pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import TokenNLL

BASE = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.num_experts=4",
    "model.arch.moe_intermediate_size=32",
    "primitives.attention=sdpa",
    "model.lora.rank=4",
    "model.lora.alpha=8",
    "train.micro_batch=1",
]
LAYOUTS = {
    "fsdp2 ep=1": ["primitives.sharding=fsdp2", "parallel.ep=1"],
    "fsdp2 ep=2": ["primitives.sharding=fsdp2", "parallel.ep=2"],
    "zero1 ep=2": ["primitives.sharding=zero1", "parallel.ep=2"],
}
ADAPTER = "model.layers.1.mlp.experts.lora_A_gate_up"


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, 256, (14,), generator=g).tolist() for _ in range(4)]
    return pack_sequences(tokens, [[i >= 2 for i in range(14)] for _ in tokens], 16)


def _ranks(rank, world, out_dir):
    results = {}
    for name, overrides in LAYOUTS.items():
        e = Engine(load_config(None, BASE + overrides + [f"train.out_dir={out_dir}"]))
        params = dict(e.model.named_parameters())
        adapter = local(params[ADAPTER]).detach().clone()  # this rank's rows at init
        losses = [e.train_step(batch(0), TokenNLL(), lr=2e-2)["loss"] for _ in range(3)]
        merged = {n: t.clone() for n, t in e.named_weights(hf_names=False)}
        factors = {
            n: t.clone()
            for n, t in e.named_weights(hf_names=False, merged=False)
            if is_lora_name(n)
        }
        results[name] = (adapter, losses, merged, factors)
    return results


def test_expert_adapters_live_with_their_experts_and_match_ep1(tmp_path):
    per_rank = run_distributed(_ranks, 2, str(tmp_path))
    one = Engine(load_config(None, BASE + [f"train.out_dir={tmp_path}"]))  # one process: all E
    whole = dict(one.model.named_parameters())[ADAPTER].detach()
    ref_adapter, ref_losses, ref_merged, ref_factors = per_rank[0]["fsdp2 ep=1"]
    assert not any(is_lora_name(n) for n in ref_merged) and ADAPTER in ref_factors
    assert ref_losses[-1] < ref_losses[0]
    for rank, results in enumerate(per_rank):
        for name in ("fsdp2 ep=2", "zero1 ep=2"):
            adapter, losses, merged, factors = results[name]
            # its own experts only: rows [2 rank, 2 rank + 2) of the whole stacked adapter
            assert adapter.shape == (2, *whole.shape[1:])
            assert torch.equal(adapter, whole[2 * rank : 2 * rank + 2])
            torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
            # (Adam turns a rounding-level gradient difference of an element near 0 into up to
            # ~1e-5 of its update: elementwise tolerance above that, far below the lr of 2e-2)
            for n, t in ref_factors.items():
                torch.testing.assert_close(factors[n], t, rtol=1e-4, atol=5e-5)
            for n, t in ref_merged.items():
                torch.testing.assert_close(merged[n], t, rtol=1e-4, atol=5e-5)

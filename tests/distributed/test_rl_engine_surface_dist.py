"""The engine surface on 2 gloo ranks against one process on the same data:

- rank-local batches: each dp rank passes its own rows (1 row on one rank, 4 on the other: the
  engine pads the micro-batch count, and the loss is normalized by the token count summed over
  ranks) through forward_backward + optimizer_step; loss, metrics, grad norm and the updated
  policy equal the single-process train_step on all rows (fsdp2, ep=2);
- token-budget micro-batches (sequences balanced over dp ranks, then repacked under the budget)
  equal one large micro-batch on one process (fsdp2 ep=2, and zero1 cp=2 where the budget rows
  are cut into CP shards);
- routing replay under EP (fsdp2, ep=2): a batch carrying given experts per token and MoE layer (a
  rollout engine's, here random) scores and trains with them -- log-probs, the experts reported back,
  the update's figures and the policy after it equal one process replaying the same experts;
- weight buckets through the gloo BroadcastTransport: rank 1 receives every bucket from rank 0
  (names, shapes, dtypes, one flat buffer per bucket and dtype) and the received stream loads
  into ``transformers`` with the single-process logits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from dist_utils import run_distributed
from safetensors.torch import save_file

from bumblebee import load_config
from bumblebee.rl.batch import pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import PolicyLoss
from bumblebee.rl.transport import BroadcastTransport

BASE = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.num_experts=4",
    "model.arch.moe_intermediate_size=32",
    "primitives.attention=sdpa",
    "train.global_batch=4",
    "train.micro_batch=2",
    "model.arch.router_aux_loss_coef=0.0",
]
EP = ["primitives.sharding=fsdp2", "parallel.ep=2"]
CP = ["primitives.sharding=zero1", "parallel.cp=2"]
LOSS = PolicyLoss(kl_coef=0.05, entropy_coef=0.01, agg="seq-mean-token-sum")
BUDGET = 20


def batch():
    g = torch.Generator().manual_seed(5)
    tokens = [
        torch.randint(0, 256, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
        for _ in range(12)
    ]
    masks = [[i >= 2 for i in range(len(t))] for t in tokens]
    b = pack_sequences(tokens, masks, 26, advantages=torch.randn(12, generator=g).tolist())
    b = b.replace(ref_logprobs=-torch.rand(b.input_ids.shape, generator=g) * 6)
    return b.replace(old_logprobs=-torch.rand(b.input_ids.shape, generator=g) * 4)


def given_routing(b, arch):
    """Distinct random experts per token and MoE layer, [B, T, L, K] (what a rollout engine reports)."""
    g = torch.Generator().manual_seed(11)
    L = arch.num_hidden_layers
    scores = torch.rand(*b.input_ids.shape, L, arch.num_experts, generator=g)
    return scores.argsort(-1)[..., : arch.num_experts_per_tok]


def replay_trace(e):
    rb = batch()
    rb = rb.replace(routing=given_routing(rb, e.arch))
    lp = e.compute_logprobs(rb, return_routing=True)
    m = step_figures(e.train_step(rb, LOSS, lr=1e-2))
    return lp.logprobs, lp.routing, m, e.compute_logprobs(rb).logprobs


def engine(out_dir, layout, **kw):
    return Engine(load_config(None, BASE + layout + [f"train.out_dir={out_dir}"]), **kw)


def step_figures(m):
    return {k: m[k] for k in ("loss", "grad_norm", "kl", "entropy", "clip_frac", "tokens")}


def _ranks(rank, world, out_dir):
    b = batch()
    res = {}
    # rank-local rows, uneven: rank 0 one row, rank 1 the rest
    e = engine(out_dir, EP)
    local = b.select_rows(0, 1) if rank == 0 else b.select_rows(1, b.rows)
    lp = e.forward_backward(local, None, forward_only=True).logprobs
    out = e.forward_backward(local, LOSS)
    opt = e.optimizer_step(lr=1e-2)
    res["local"] = (
        {"loss": out.loss, "grad_norm": opt["grad_norm"], "tokens": out.tokens, **out.metrics},
        lp,
        e.compute_logprobs(b).logprobs,
    )
    # weight buckets from rank 0 to rank 1 through the transport
    transport = BroadcastTransport(src=0)
    received = []
    for bucket in e.weight_buckets(bucket_bytes=16 << 10, dtype=torch.float32):
        got = transport(bucket)
        if rank == 1:
            received.append([(n, t.clone()) for n, t in got])
    transport.finish(e.weight_version)
    res["received"] = (received, transport.version)
    # stacked experts larger than a bucket stream in pieces: FSDP2 shards over 2 ranks (ep = 1)
    e = engine(out_dir, ["primitives.sharding=fsdp2"])
    whole = {n: t.clone() for n, t in e.named_weights(dtype=torch.float32)}
    pieces = [
        (n, t.clone())
        for b_ in e.weight_buckets(bucket_bytes=4096, dtype=torch.float32)
        for n, t in b_
    ]
    res["pieces"] = len(pieces) == len(whole) and all(torch.equal(t, whole[n]) for n, t in pieces)
    res["replay"] = replay_trace(engine(out_dir, EP))
    # token budget: sequences balanced over the ranks, micro-batches under the budget
    for name, layout in (("budget ep", EP), ("budget cp", CP)):
        e = engine(out_dir, layout, max_tokens_per_micro_batch=BUDGET)
        res[name] = (step_figures(e.train_step(b, LOSS, lr=1e-2)), e.compute_logprobs(b).logprobs)
    return res


def test_rank_local_batches_token_budget_and_weight_transport(tmp_path):
    b = batch()
    ref = engine(tmp_path, ["primitives.sharding=none", "train.micro_batch=64"])
    before = ref.compute_logprobs(b).logprobs
    want = step_figures(ref.train_step(b, LOSS, lr=1e-2))
    after = ref.compute_logprobs(b).logprobs
    per_rank = run_distributed(_ranks, 2, str(tmp_path), timeout=300)
    real = b.seq_index >= 0
    for rank in range(2):
        figures, lp, updated = per_rank[rank]["local"]
        rows = slice(0, 1) if rank == 0 else slice(1, b.rows)
        assert torch.allclose(lp, before[rows], atol=1e-5), rank  # this rank's rows only
        for k, v in want.items():
            assert figures[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (rank, k)
        assert torch.allclose(updated, after, atol=1e-5), rank
        for name in ("budget ep", "budget cp"):
            figures, lp = per_rank[rank][name]
            for k, v in want.items():
                assert figures[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (name, rank, k)
            assert torch.allclose(lp[real], after[real], atol=1e-5), (name, rank)
    assert per_rank[0]["pieces"] and per_rank[1]["pieces"]
    replay_ref = replay_trace(engine(tmp_path, ["primitives.sharding=none"]))
    given = given_routing(b, ref.arch)
    assert torch.equal(replay_ref[1], given)  # the reported experts are the given ones
    assert (replay_ref[0] - before).abs().max() > 1e-3  # and they change the log-probs
    for rank in range(2):
        lp, routing, figures, updated = per_rank[rank]["replay"]
        assert torch.allclose(lp, replay_ref[0], atol=1e-5) and torch.equal(routing, given), rank
        for k, v in replay_ref[2].items():
            assert figures[k] == pytest.approx(v, rel=1e-5, abs=1e-7), ("replay", rank, k)
        assert torch.allclose(updated, replay_ref[3], atol=1e-5), rank
    received, version = per_rank[1]["received"]
    assert version == 1 and len(received) > 2
    import transformers

    out = tmp_path / "received"
    os.makedirs(out)
    (out / "config.json").write_text(json.dumps(ref.arch.to_hf_dict()))
    save_file(
        {n: t.contiguous() for bucket in received for n, t in bucket},
        str(out / "model.safetensors"),
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 256, (2, 16))
    with (
        torch.no_grad()
    ):  # the 2-rank policy after its update = the single-process one after train_step
        assert (hf(ids).logits - ref.model(ids)).abs().max().item() < 1e-4

"""Kimi Delta Attention under context parallelism, shared by the layout tests that spawn ranks
(tests/distributed/test_kimi_linear_layouts.py at 2 ranks; test_gdn_context_parallel.py runs the
cp=4 part inside its 4-rank spawn, which saves a spawn): one KDA layer on zigzag shards against
the whole sequence, and the Kimi Linear model's loss trace at cp = 2 / 4 against cp = 1."""

from __future__ import annotations

import torch
from family_layouts import run

from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence, unshard_sequence
from bumblebee.primitives.linear_attention.cp import gated_delta_net_cp
from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_chunked
from bumblebee.primitives.linear_attention.kda import KimiDeltaAttention
from bumblebee.primitives.packed import doc_layout
from bumblebee.primitives.recompute import NoRecompute

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
REF = ["primitives.sharding=none", "primitives.moe_comm=local"]
CP4 = ["parallel.cp=4", "primitives.sharding=zero1", "primitives.cp_attention=allgather"]


def reference(data, out_dir):
    return run(BASE, REF, data, str(out_dir), STEPS)


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
    layout = build_cp_shards(shard_sequence(pos, world, rank), torch.distributed.group.WORLD)
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


def cp4_rank(rank, world, data, out_dir):
    """This rank's part of the cp=4 check: (model trace, KDA layer results)."""
    return run(BASE, CP4, data, f"{out_dir}/kimi_cp4/{rank}", STEPS), layer_cp(rank, world)


def check_cp(trace, ref, what):
    """The CP goal: the cp=1 loss trace to 1e-6 relative (fp32) at every step."""
    for (loss, _), (ref_loss, _) in zip(trace, ref):
        assert abs(loss - ref_loss) <= 1e-6 * ref_loss, (what, trace, ref)


def check_cp4(per_rank, ref):
    for trace, _ in per_rank:
        check_cp(trace, ref, "kimi_linear cp=4")
    check_layer([r[1] for r in per_rank], 4)

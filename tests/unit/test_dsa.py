"""DeepSeek Sparse Attention's primitive (primitives/attention/dsa.py, sparse_mla.py).

- the blockwise core (query blocks, per-block top-k, gathered latents, checkpointed blocks)
  equals the dense masked reference: output, indexer KL and every input gradient, for sparse
  and dense-warm-up selection, packed documents and a query subset at global positions (what
  a CP rank holds);
- with top-k covering every key, the sparse layer equals plain MLA through the ``sdpa`` core
  (the absorbed MQA form against the expanded heads: an independent reference);
- the indexer learns from its KL alone: the loss falls, no gradient reaches the main model;
  ``dense_warmup`` freezes everything but the indexers;
- bad ``dsa_*`` settings are refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bumblebee import load_config
from bumblebee.config import PrimitivesConfig
from bumblebee.errors import ConfigError
from bumblebee.models import arch_from_hf_dict, build_model
from bumblebee.models.deepseek_v32 import PRESETS
from bumblebee.primitives.attention.dsa import dsa_blockwise, dsa_reference
from bumblebee.primitives.attention.mla import MultiHeadLatentAttention
from bumblebee.primitives.attention.sdpa import sdpa_masked
from bumblebee.primitives.attention.sparse_mla import SparseLatentAttention
from bumblebee.primitives.packed import doc_layout
from bumblebee.primitives.recompute import NoRecompute
from bumblebee.primitives.rope import rope_cos_sin

B, S, N, C, R, HI, DI = 2, 48, 3, 8, 4, 4, 8


def inputs(seed, qpos):
    g = torch.Generator().manual_seed(seed)
    Tq = len(qpos)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    doc = torch.tensor([[0] * 20 + [1] * 28, [0] * 48])
    return (
        r(B, Tq, N, C + R),
        r(B, S, C + R),
        r(B, Tq, HI, DI),
        r(B, S, DI),
        r(B, Tq, HI),
        qpos,
        doc[:, qpos],
        doc,
    )


QUERIES = {
    "all": torch.arange(S),
    "zigzag_rank1_of2": torch.cat([torch.arange(12, 24), torch.arange(24, 36)]),
}


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("queries", list(QUERIES))
def test_blockwise_equals_reference(dense, queries):
    args = inputs(0, QUERIES[queries])
    kw = dict(topk=10, scale=0.3, index_scale=DI**-0.5, dense=dense, C=C)
    o_ref, kl_ref, sel = dsa_reference(*args, **kw)
    if not dense:  # the selection really drops keys
        assert (sel.sum(-1) == 10).any() and sel.sum(-1).max() == 10
    grads_ref = torch.autograd.grad((o_ref**2).sum() + kl_ref, [a for a in args[:5]])
    for block in (5, 64):
        o, kl = dsa_blockwise(*args, block=block, **kw)
        torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(kl, kl_ref, rtol=1e-10, atol=1e-10)
        grads = torch.autograd.grad((o**2).sum() + kl, [a for a in args[:5]])
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-10)


def _mla_kwargs():
    return dict(
        q_lora_rank=16,
        kv_lora_rank=C,
        qk_nope_head_dim=8,
        qk_rope_head_dim=R,
        v_head_dim=6,
        eps=1e-6,
        scale=0.25,
        rope_interleave=True,
        recompute=NoRecompute(),
    )


@pytest.mark.parametrize("impl", ["blockwise", "reference"])
def test_full_topk_equals_dense_mla(impl):
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(32, N, attend=sdpa_masked, **_mla_kwargs()).double()
    dsa = SparseLatentAttention(
        32,
        N,
        index_heads=HI,
        index_dim=DI,
        index_topk=S,
        index_rope_interleave=False,
        impl=impl,
        block=7,
        attend=None,
        **_mla_kwargs(),
    ).double()
    dsa.load_state_dict(mla.state_dict(), strict=False)
    x = torch.randn(B, S, 32, dtype=torch.float64)
    pos = torch.cat([torch.arange(20), torch.arange(28)])[None].expand(B, S)
    cos, sin = rope_cos_sin(pos, R, 10000.0, torch.float64)
    layout = doc_layout(pos)
    torch.testing.assert_close(dsa(x, cos, sin, layout), mla(x, cos, sin, layout))


def tiny(**prims):
    arch = arch_from_hf_dict({**PRESETS["tiny"], "num_nextn_predict_layers": 0})
    return build_model(arch, dataclasses.replace(PrimitivesConfig(), **prims), seed=0)


def _layer_and_inputs(seed=0, T=S):
    torch.manual_seed(seed)
    layer = SparseLatentAttention(
        32,
        N,
        index_heads=HI,
        index_dim=DI,
        index_topk=12,
        index_rope_interleave=False,
        block=16,
        attend=None,
        **_mla_kwargs(),
    )
    x = torch.randn(B, T, 32)
    pos = torch.arange(T)[None].expand(B, T)
    cos, sin = rope_cos_sin(pos, R, 10000.0, torch.float32)
    return layer, (x, cos, sin, doc_layout(pos))


def test_indexer_learns_from_its_kl_only():
    layer, args = _layer_and_inputs()
    index = [p for n, p in layer.named_parameters() if n.startswith("indexer.")]
    opt = torch.optim.Adam(index, lr=1e-2)
    kls = []
    for _ in range(15):
        opt.zero_grad(set_to_none=True)
        layer(*args).sum().backward()
        kls.append(float(layer.indexer_kl))
        opt.step()
    assert kls[-1] < 0.7 * kls[0], kls
    # the KL's gradient stays in the indexer: with the main loss at zero weight, nothing else moves
    layer.zero_grad(set_to_none=True)
    (0.0 * layer(*args).sum()).backward()
    for n, p in layer.named_parameters():
        assert bool(p.grad.any()) == n.startswith("indexer."), n


def test_dense_warmup_trains_only_the_indexers():
    model = tiny(dsa_stage="dense_warmup", recompute="none")
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".indexer." in n
    }
    ids = torch.randint(0, 256, (1, 40))
    model(ids, labels=ids).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "override", ["primitives.dsa_stage=warm", "primitives.dsa_impl=flash", "primitives.dsa_block=0"]
)
def test_bad_dsa_settings_are_refused(override):
    with pytest.raises(ConfigError, match="dsa_"):
        load_config(None, ["model.name=deepseek_v32", override])


def test_planner_terms_follow_the_code():
    """The spec's keys per query beyond topk tokens are the mean of min(topk, t + 1) over a causal
    row's queries (what the blockwise core reads), its parameters count the indexer, and the
    planner's DSA buffers keep a constant per-token part and one block growing with the row (the
    selection: block x S x (2 fp32 + 2 bool), no indexer-head factor), never [T, T]."""
    from bumblebee.plan.dsa_terms import dsa_bytes
    from bumblebee.plan.layout import Layout

    model = tiny()
    spec = model.arch.to_spec()
    assert spec.num_params()["total"] == sum(p.numel() for p in model.parameters())
    for seq in (40, 100):  # (up to topk keys: seq / 2, the dense convention of attn_core_flops)
        mean = sum(min(spec.dsa_topk, t + 1) for t in range(seq)) / seq
        assert spec.dsa_keys(seq) == pytest.approx(mean, rel=1e-12), seq
    big = arch_from_hf_dict(PRESETS["deepseek-v3.2"]).to_spec()
    lay = Layout()
    (k1, w1, _), (k2, w2, why) = (dsa_bytes(big, lay, t, 128) for t in (65536, 131072))
    assert k1 == k2 > 0 and w2 - w1 == 2 * 128 * (131072 - 65536) * 10  # fwd + bwd
    assert "selection 160 MiB" in why  # 128 x 131072 x 10 B (measured: skills/models/dsa.md)


def test_planner_prices_the_cp_fetch():
    """Under CP a DSA layer is priced by what it moves (indexer keys all-gathered, the fetched
    latent rows and their int32 ids; no MLA ring re-expansion), its memory keeps the fetched row
    and the int32 top-k slots, and the MLA ring's transients are not charged."""
    from bumblebee.config import PrimitivesConfig
    from bumblebee.plan import perf_layer as perf
    from bumblebee.plan.dsa_terms import COLLECTIVES, dsa_bytes, dsa_cp_traffic
    from bumblebee.plan.hardware import GPUS, Efficiency
    from bumblebee.plan.layout import Layout, Workload
    from bumblebee.plan.memory import cp_extra
    from bumblebee.plan.spec import ATTN, MOE

    spec = arch_from_hf_dict(PRESETS["deepseek-v3.2"]).to_spec()
    lay, t = Layout(cp=8, ep=8, dp_shard=1), 131072 // 8
    m = dsa_cp_traffic(spec, lay, t)
    remote, lat, di = 7 * t, 576, 128
    assert m["forward"] == remote * (di * 2 + lat * 2 + 4)  # ids: 4 B per fetched row
    assert m["backward"] == remote * (di + lat) * 2 == m["allgather"]
    assert dsa_cp_traffic(spec, lay, t, union=0.25)["forward"] < 0.4 * m["forward"]
    assert cp_extra(spec, ATTN, lay) == (0.0, 0.0, "")
    k8, _, _ = dsa_bytes(spec, lay, t, 128)
    k1, _, _ = dsa_bytes(spec, Layout(), t, 128)
    assert k8 - k1 == 7 * (lat + di) * 2 + 2048 * 4
    gpu, eff, prims = GPUS["h200"], Efficiency(), PrimitivesConfig(recompute="full")
    clock = perf.Clock()
    work = Workload(seq=131072, global_batch=1)
    perf.layer_time(spec, (ATTN, MOE), lay, prims, work, gpu, eff, clock)
    bw = perf.link_gbps(8, 1, gpu) * 1e9 * eff.collective
    want = (2 * m["forward"] + m["backward"]) / bw + 3 * COLLECTIVES * perf.P2P_LATENCY_S
    assert clock.parts["cp_comm"] == pytest.approx(want, rel=1e-12)


def test_fetch_owners_follow_zigzag():
    """The CP fetch asks each key's latent row of the rank and local row ``zigzag_index`` gave it."""
    from bumblebee.primitives.attention.dsa_cp import owners
    from bumblebee.primitives.cp.zigzag import CPShards, zigzag_index

    for cp in (2, 3, 4):
        T, L = 8 * cp, 8
        layout = CPShards(None, cp, 0, T, torch.zeros(B, T, dtype=torch.long), torch.arange(L))
        rank, row = owners(torch.arange(B * T), layout, L)
        for r in range(cp):
            for b in range(B):
                mine = b * T + zigzag_index(T, cp, r)
                assert (rank[mine] == r).all() and row[mine].tolist() == list(
                    range(b * L, (b + 1) * L)
                ), (cp, r, b)


def test_selection_buffer_has_no_head_factor():
    """The selection's live-tensor peak (perf/memory.py) is two fp32 [block, S] buffers whatever
    the indexer head count (heads summed one at a time), and equals ``index_scores``."""
    from bumblebee.perf.memory import MemoryTracker
    from bumblebee.primitives.attention.dsa import index_scores, selection_scores

    g = torch.Generator().manual_seed(0)
    block, S, hi = 8, 2048, 16
    qi, ki = torch.randn(1, block, hi, DI, generator=g), torch.randn(1, S, DI, generator=g)
    w = torch.randn(1, block, hi, generator=g)
    with torch.no_grad(), MemoryTracker() as mem:
        got = selection_scores(qi, ki, w, 0.3)
    assert mem.peak_bytes <= 2 * block * S * 4 + 4096, mem.peak_bytes
    torch.testing.assert_close(got, index_scores(qi, ki, w, 0.3), rtol=1e-5, atol=1e-5)

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
    a, b = (dsa_bytes(big, lay, t, 128) for t in (65536, 131072))
    assert a.kept == b.kept > 0 and b.fwd_block - a.fwd_block == 128 * (131072 - 65536) * 10
    assert a.bwd_block == b.bwd_block  # the selection is gone at the block's backward peak
    assert "selection 160 MiB" in b.why  # 128 x 131072 x 10 B (measured: skills/models/dsa.md)


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
    k8, k1 = dsa_bytes(spec, lay, t, 128).kept, dsa_bytes(spec, Layout(), t, 128).kept
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


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("heads", [16, 64])
def test_block_backward_term_is_measured(cp, heads):
    """The planner's transient of one query block's backward (``dsa_bytes().bwd_block``) is the
    live-tensor peak (perf/memory.py) of that backward, bf16 as on the GPU: the blockwise core's
    block (cp 1, its selection recomputed inside) and the fetched core's (cp 2), at two head
    counts (the peak's moment changes with N); what the term leaves out (int64 indices) is < 3%."""
    from torch.utils.checkpoint import checkpoint

    from bumblebee.perf.memory import MemoryTracker
    from bumblebee.plan.dsa_terms import dsa_bytes
    from bumblebee.plan.layout import Layout
    from bumblebee.primitives.attention import dsa, dsa_cp

    Q, T, K, C_, R_, HI_, DI_ = 32, 256, 64, 64, 16, 8, 32
    spec = dataclasses.replace(
        arch_from_hf_dict(PRESETS["deepseek-v3.2"]).to_spec(),
        n_heads=heads,
        mla_kv_rank=C_,
        mla_rope_dim=R_,
        dsa_heads=HI_,
        dsa_dim=DI_,
        dsa_topk=K,
    )
    want = dsa_bytes(spec, Layout(cp=cp), T // cp, Q).bwd_block
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    q_abs, qi, w = r(1, Q, heads, C_ + R_), r(1, Q, HI_, DI_), r(1, Q, HI_, dtype=torch.float32)
    if cp > 1:  # Q queries against the rows they selected, fetched (dsa_cp.py)
        slot = torch.randint(0, T, (1, Q, K), generator=g, dtype=torch.int32)
        args = (dsa_cp._block, q_abs, r(T, C_ + R_), r(T, DI_), slot, qi, w, 0.1, 0.1, C_)
    else:  # the last Q queries of a row of T (dsa.py's block: select, gather, attend)
        qpos, doc = torch.arange(T - Q, T), torch.zeros(1, T, dtype=torch.long)
        lat, ki = r(1, T, C_ + R_), r(1, T, DI_)
        args = (dsa._block, q_abs, lat, qi, ki, w, qpos, doc[:, qpos], doc, K, 0.1, 0.1, False, C_)
    o, kl = checkpoint(*args, use_reentrant=False)
    grad_o = torch.randn(o.shape, generator=g).to(o.dtype)
    with MemoryTracker() as mem:
        torch.autograd.backward([o, kl], [grad_o, torch.ones_like(kl)])
    assert want <= mem.peak_bytes <= 1.03 * want, (mem.peak_bytes, want)


def _previous_dense_block(q_abs, lat, qi, ki, w, qpos, doc_q, doc_k, scale, index_scale, C):
    """The dense warm-up block before the head loops: [Q, Hi, S] and [Q, N, S] in one go."""
    from bumblebee.primitives.attention.dsa import _attend, _kl, allowed, index_scores

    end = int(qpos[-1]) + 1
    ok = allowed(qpos, doc_q, doc_k, end)
    scores = index_scores(qi, ki[:, :end], w, index_scale)
    o, p = _attend(q_abs, lat[:, :end], ok, scale, C)
    return o, _kl(p, scores, ok)


def test_dense_block_equals_the_previous_code_in_fp32():
    """The dense warm-up block with its heads looped (indexer and main attention) gives the
    previous one-einsum block's output, KL and input gradients in fp32 (packed documents)."""
    from bumblebee.primitives.attention.dsa import _block

    g = torch.Generator().manual_seed(0)
    Q, T = 16, 512
    args = [
        torch.randn(*s, generator=g).requires_grad_()
        for s in ((1, Q, N, C + R), (1, T, C + R), (1, Q, HI, DI), (1, T, DI), (1, Q, HI))
    ]
    qpos, doc = torch.arange(T - Q, T), torch.tensor([[0] * 200 + [1] * 312])
    rest = (qpos, doc[:, qpos], doc)
    o, kl = _block(*args, *rest, 0, 0.3, DI**-0.5, True, C)
    o_ref, kl_ref = _previous_dense_block(*args, *rest, 0.3, DI**-0.5, C)
    torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(kl, kl_ref, rtol=1e-6, atol=0)
    grads = torch.autograd.grad((o**2).sum() + kl, args)
    for x, got, want in zip(
        "q_abs lat qi ki w".split(), grads, torch.autograd.grad((o_ref**2).sum() + kl_ref, args)
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()), msg=x)


@pytest.mark.parametrize("heads, index_heads", [(16, 8), (64, 32)])
def test_dense_block_memory_is_bounded_and_planned(heads, index_heads):
    """A dense warm-up block as the stage runs it (bf16, the main attention frozen, the indexer
    trained, under its checkpoint) holds [block, S] buffers only: its forward and backward
    live-tensor peaks (perf/memory.py) are the planner's ``dsa_bytes(dense=True)`` block terms
    (95-102%) whatever the head counts (4x the heads here: the same bytes per block x S)."""
    from torch.utils.checkpoint import checkpoint

    from bumblebee.perf.memory import MemoryTracker
    from bumblebee.plan.dsa_terms import dsa_bytes
    from bumblebee.plan.layout import Layout
    from bumblebee.primitives.attention.dsa import _block

    Q, T, C_, R_, DI_ = 32, 512, 64, 16, 32
    spec = dataclasses.replace(
        arch_from_hf_dict(PRESETS["deepseek-v3.2"]).to_spec(),
        n_heads=heads,
        mla_kv_rank=C_,
        mla_rope_dim=R_,
        dsa_heads=index_heads,
        dsa_dim=DI_,
    )
    plan = dsa_bytes(spec, Layout(), T, Q, dense=True)
    g = torch.Generator().manual_seed(0)

    def r(*shape, grad=True, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    frozen = (r(1, Q, heads, C_ + R_, grad=False), r(1, T, C_ + R_, grad=False))
    trained = (r(1, Q, index_heads, DI_), r(1, T, DI_), r(1, Q, index_heads, dtype=torch.float32))
    qpos, doc = torch.arange(T - Q, T), torch.zeros(1, T, dtype=torch.long)
    args = (*frozen, trained[0], trained[1], trained[2], qpos, doc[:, qpos], doc)
    with MemoryTracker() as fwd:
        o, kl = checkpoint(_block, *args, 0, 0.2, DI_**-0.5, True, C_, use_reentrant=False)
    with MemoryTracker() as bwd:
        kl.backward()
    for mem, want in ((fwd, plan.fwd_block), (bwd, plan.bwd_block)):
        assert 0.95 * want <= mem.peak_bytes <= 1.02 * want, (mem.peak_bytes, want)


def test_dense_warmup_detaches_the_frozen_main_attention():
    """In the warm-up stage the dense core's main attention runs without a graph (its inputs
    require grad through the residual stream and AddLoss, but no parameter uses that gradient):
    every indexer gradient equals the one with the graph kept."""
    model = tiny(dsa_stage="dense_warmup", recompute="none")
    attn = [m for m in model.modules() if isinstance(m, SparseLatentAttention)]
    assert attn and all(m.main_frozen for m in attn)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    grads = []
    for frozen in (True, False):
        for m in attn:
            m.main_frozen = frozen
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][n], rtol=0, atol=0, msg=n)

"""Chunked EP overlap (moe_comm = chunked) is paired with ``alltoall`` on gloo ranks.

Layer level (one MoE block, the dispatcher called with hand-made routing): the
output, the input gradient, the router-weight gradient and both expert weight
gradients of every rank equal ``alltoall``'s within 1e-6 relative (Frobenius
norm per tensor, fp32) for k = 2, 3, 4, recompute none and full, with random
top-k > ep routing and with skewed routing (experts that get no rows, chunks
that send nothing to a rank, ranks with fewer tokens than chunks). Under full
recompute the number of all-to-alls and fc2 GEMMs shows the recompute forward
skipping the combine and fc2. Since ``alltoall`` shares chunked's permutation helpers,
every case is also checked against ``local`` (all experts on one process, its own
permute / unpermute; expert gradients summed over ranks) within 1e-5.

Model level: the 5-step loss / grad-norm trace of ``Trainer`` (FSDP2, ep = 2 and
4, and ep = 2 folded with edp = 2 so the experts are really sharded) equals
``alltoall``'s within 1e-6 relative, with recompute none and full. Plus
single-process checks: Qwen3.5-MoE under full and selective recompute, the bf16
error budget, and the errors for bad input.

Legend: T tokens, H hidden, K choices per token, E experts.
"""

import io

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from bumblebee import load_config, registry
from bumblebee.config import PrimitivesConfig
from bumblebee.models import build_model, resolve_arch
from bumblebee.models.blocks import MoE
from bumblebee.models.qwen3_moe import Qwen3MoeArch
from bumblebee.primitives.moe.experts import Experts, GroupedGemms
from bumblebee.primitives.parallel import ParallelGroups
from bumblebee.runtime.trainer import Trainer

E, H, FFN = 8, 64, 32
RTOL = 1e-6


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def routing(kind, rank, T, K):
    """idx_TK: 'random' top-K of E; 'skewed': the first half of the tokens choose among
    experts {0, 1, 2} only, the rest among {4, 5, 6}; experts 3 and 7 get nothing."""
    g = torch.Generator().manual_seed(100 + rank)
    scores_TE = torch.rand(T, E, generator=g)
    if kind == "skewed":
        allowed = torch.zeros(T, E, dtype=torch.bool)
        allowed[: T // 2, :3] = True
        allowed[T // 2 :, 4:7] = True
        scores_TE = torch.where(allowed, scores_TE + 1, scores_TE - 2)
    return scores_TE.topk(K, dim=-1).indices


def layer(rank, world, comm, k, policy, kind, K, T):
    """One MoE block on this rank's T tokens; returns y and the gradients. ``local``: all E
    experts on this rank, its expert gradients summed over ranks and sliced as EP holds them."""
    arch = Qwen3MoeArch(
        vocab_size=97,
        hidden_size=H,
        intermediate_size=96,
        moe_intermediate_size=FFN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=E,
        num_experts_per_tok=K,
    )
    group = None if comm == "local" else dist.group.WORLD
    weights = k if isinstance(k, tuple) else ()  # uneven chunks: their token shares
    dispatch = registry.get("moe_comm", comm).factory(
        num_experts=E, ep_group=group, num_chunks=len(k) if weights else k, chunk_weights=weights
    )
    moe = MoE(arch, PrimitivesConfig(), dispatch, ParallelGroups(ep_group=group))
    g = torch.Generator().manual_seed(
        7
    )  # full-size expert weights, identical on every rank, then sliced
    w1, w2 = (
        torch.randn(E, 2 * FFN, H, generator=g) * 0.1,
        torch.randn(E, H, FFN, generator=g) * 0.1,
    )
    lo, n = (0, E) if comm == "local" else (rank * (E // world), E // world)
    with torch.no_grad():
        moe.experts.w_gate_up.copy_(w1[lo : lo + n])
        moe.experts.w_down.copy_(w2[lo : lo + n])
    g = torch.Generator().manual_seed(200 + rank)
    x_TH = torch.randn(T, H, generator=g).requires_grad_()
    weight_TK = torch.rand(T, K, generator=g).requires_grad_()
    probe_TH = torch.randn(T, H, generator=g)
    idx_TK = routing(kind, rank, T, K)
    rc = registry.get("recompute", policy).factory([])
    y_TH = rc.layer(lambda x, w: moe.dispatch(x, idx_TK, w, moe._run_experts), x_TH, weight_TK)
    (y_TH * probe_TH).sum().backward()
    grads = [moe.experts.w_gate_up.grad, moe.experts.w_down.grad]
    if comm == "local":
        n = E // world
        for w in grads:
            dist.all_reduce(w)
        grads = [w[rank * n : (rank + 1) * n] for w in grads]
    return [y_TH.detach(), x_TH.grad, weight_TK.grad, *grads]


def counting(fn):
    """Run fn counting all-to-alls and fc2-or-fc1 forward GEMMs of the chunked layer."""
    calls = {"a2a": 0, "gemm_fwd": 0}
    a2a, fwd = dist.all_to_all_single, GroupedGemms.fwd

    def count_a2a(*args, **kwargs):
        calls["a2a"] += 1
        return a2a(*args, **kwargs)

    def count_fwd(self, *args):
        calls["gemm_fwd"] += 1
        return fwd(self, *args)

    dist.all_to_all_single, GroupedGemms.fwd = count_a2a, count_fwd
    try:
        return fn(), calls
    finally:
        dist.all_to_all_single, GroupedGemms.fwd = a2a, fwd


LAYER_NAMES = ["output", "input grad", "router-weight grad", "w_gate_up grad", "w_down grad"]
STEPS = 5
BASE = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=32",
    "model.arch.num_experts=8",
    "model.arch.num_experts_per_tok=3",
    "model.arch.mlp_only_layers=[1]",
    "model.arch.intermediate_size=96",
    "train.seq_len=96",
    "train.global_batch=4",
    "train.micro_batch=1",
    f"train.steps={STEPS}",
    "data.min_records=2",
    "data.max_records=6",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    "primitives.sharding=fsdp2",
]


def layer_cases(K_random):
    """(k, recompute, routing, K, T): every k x policy x routing, plus fewer tokens than chunks."""
    cases = [
        (k, policy, kind, K, T)
        for k in (2, 3, 4)
        for policy in ("none", "full")
        for kind, K, T in (("random", K_random, 37), ("skewed", 3, 23))
    ]
    # uneven chunks (chunk_plan.py), one of them empty at T = 5
    weighted = [
        ((0.15, 0.6, 0.25), "full", "skewed", 3, 37),
        ((0.2, 0.8), "none", "random", K_random, 37),
        ((0.05, 0.2, 0.6, 0.15), "full", "random", K_random, 5),
    ]
    return cases + [(4, "full", "skewed", 3, 3), (3, "none", "random", K_random, 2)] + weighted


def trace_overrides(ep, rc, k):
    comm = (
        ["primitives.moe_comm=alltoall"]
        if k is None
        else ["primitives.moe_comm=chunked", f"primitives.moe_chunks={k}"]
        if isinstance(k, int)  # else one list of chunk weights per MoE layer
        else ["primitives.moe_comm=chunked", f"primitives.moe_chunk_weights={[list(w) for w in k]}"]
    )
    return [f"parallel.ep={ep}", f"primitives.recompute={rc}"] + comm


def _ranks(rank, world, cases, runs, out_dir):
    """One spawn per world size (process start-up dominates): layer cases, then training runs."""
    layers = []
    for k, policy, kind, K, T in cases:
        ref = layer(rank, world, "alltoall", k, policy, kind, K, T)
        got, calls = counting(lambda: layer(rank, world, "chunked", k, policy, kind, K, T))
        loc = layer(rank, world, "local", k, policy, kind, K, T)
        layers.append(
            ([rel(a, b) for a, b in zip(got, ref)], calls, [rel(a, b) for a, b in zip(got, loc)])
        )
    traces = []
    for i, run in enumerate(runs):
        cfg = load_config(
            None, BASE + trace_overrides(*run) + [f"train.out_dir={out_dir}/{i}/{rank}"]
        )
        trainer = Trainer(cfg, stream=io.StringIO())
        calls = [0]  # Experts.forward calls (FSDP2 gathers the expert weights once per call)
        for m in trainer.model.modules():
            if isinstance(m, Experts):
                m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        traces.append(
            (
                [(r["loss"], r["grad_norm"]) for r in (trainer.train_step() for _ in range(STEPS))],
                calls[0],
            )
        )
    return layers, traces


def check_layers(cases, results):
    for rank, (per_rank, _) in enumerate(results):
        for (k, policy, kind, K, T), (errs, calls, errs_local) in zip(cases, per_rank):
            case = f"rank {rank} k={k} {policy} {kind} K={K} T={T}"
            k = len(k) if isinstance(k, tuple) else k
            for name, err, err_local in zip(LAYER_NAMES, errs, errs_local):
                assert err < RTOL, f"{case}: {name} relative error {err:.2e}"
                assert err_local < 1e-5, (
                    f"{case}: {name} relative error {err_local:.2e} against local"
                )
            # forward: one count exchange for all k chunks + k dispatch + k combine; backward: 2k out +
            # 2k back; the recompute forward repeats the counts and dispatch only (combine skipped)
            assert calls["a2a"] == (7 * k + 2 if policy == "full" else 6 * k + 1), (case, calls)
            # fc1 + fc2 per chunk, plus fc1 only in the recompute forward
            assert calls["gemm_fwd"] == (3 * k if policy == "full" else 2 * k), (case, calls)


def check_traces(runs, traces, world):
    """runs: (ep, recompute, moe_chunks or None for alltoall); every chunked run is paired
    with the alltoall run of the same ep and recompute policy."""
    traces = dict(zip(runs, traces))
    for (ep, rc, k), (trace, calls) in traces.items():
        # one Experts.forward (one FSDP2 gather) per MoE layer forward whatever k: one MoE layer,
        # global_batch 4 / world micro-batches per step, twice under full recompute
        assert calls == STEPS * (4 // world) * (2 if rc == "full" else 1), (ep, rc, k, calls)
        if k is None:
            losses = [loss for loss, _ in trace]
            assert losses[-1] < losses[0], (ep, rc, losses)  # it trains
            continue
        for step, ((loss, gnorm), (ref_loss, ref_gnorm)) in enumerate(
            zip(trace, traces[(ep, rc, None)][0])
        ):
            assert loss == pytest.approx(ref_loss, rel=RTOL), (ep, rc, k, step)
            assert gnorm == pytest.approx(ref_gnorm, rel=RTOL), (ep, rc, k, step)


def test_two_ranks(tmp_path):
    """ep = 2, top-k 3 > ep; traces for every k with recompute none and full."""
    cases = layer_cases(K_random=3)
    runs = [(2, rc, k) for k in (None, 2, 3, 4) for rc in ("none", "full")]
    runs.append((2, "full", ((0.3, 0.7),)))  # per-layer chunk weights (one MoE layer)
    results = run_distributed(_ranks, 2, cases, runs, str(tmp_path))
    check_layers(cases, results)
    check_traces(runs, results[0][1], 2)


def test_four_ranks(tmp_path):
    """ep = 4, top-k 5 > ep; traces at ep = 4 and at ep = 2 folded over 4 ranks (edp = 2: the
    expert weights are FSDP2-sharded, so the per-layer gather / reduce-scatter really runs)."""
    cases = layer_cases(K_random=5)
    runs = [(4, "none", None), (4, "none", 4), (2, "full", None), (2, "full", 3)]
    results = run_distributed(_ranks, 4, cases, runs, str(tmp_path))
    check_layers(cases, results)
    check_traces(runs, results[0][1], 4)


# ------------------------------------------------------------------------------ single process
def _grads(name, prims, dtype=None):
    arch = resolve_arch(
        load_config(None, [f"model.name={name}", "model.arch.num_hidden_layers=1"]).model
    )
    torch.manual_seed(0)
    model = build_model(arch, prims)
    g = torch.Generator().manual_seed(1)
    ids, labels = (
        torch.randint(0, arch.vocab_size, (2, 24), generator=g),
        torch.randint(0, arch.vocab_size, (2, 24)),
    )
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
        loss = model(ids, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_qwen3_5_moe_recompute_single_process():
    """ep = 1 (no communication): the chunked schedule and its recompute skip in the hybrid
    model (whose MoE output enters the shared-expert sum) match alltoall under full and
    selective recompute: the MoE block's gradients within 1e-6, the rest (further from the
    ~1e-7 differences' source, through the linear-attention layer) within 1e-5."""
    ref = _grads("qwen3_5_moe", PrimitivesConfig(moe_comm="alltoall"))
    for policy, modules in (("full", []), ("selective", ["moe", "shared_expert"])):
        got = _grads(
            "qwen3_5_moe",
            PrimitivesConfig(
                moe_comm="chunked", moe_chunks=3, recompute=policy, recompute_modules=modules
            ),
        )
        assert rel(got[0], ref[0]) < RTOL
        for n, g in ref[1].items():
            assert rel(got[1][n], g) < (RTOL if ".mlp." in n else 1e-5), (policy, n)


def test_bf16_error_budget():
    """bf16 autocast: the chunked gradients' error against fp32 stays within 1.5x alltoall's."""
    truth = _grads("qwen3_moe", PrimitivesConfig(moe_comm="alltoall"))[1]
    ref = _grads("qwen3_moe", PrimitivesConfig(moe_comm="alltoall"), torch.bfloat16)[1]
    got = _grads(
        "qwen3_moe", PrimitivesConfig(moe_comm="chunked", recompute="full"), torch.bfloat16
    )[1]
    for n in truth:
        if ".mlp." in n:
            assert rel(got[n], truth[n]) <= 1.5 * rel(ref[n], truth[n]) + 1e-3, n


def test_bad_input():
    factory = registry.get("moe_comm", "chunked").factory
    for bad in (1, 5, "2", True):
        with pytest.raises(ValueError, match="moe_chunks must be 2, 3 or 4"):
            factory(num_experts=8, ep_group=None, num_chunks=bad)
    with pytest.raises(ValueError, match="accepting schedule="):
        factory(num_experts=8, num_chunks=2)(
            torch.zeros(2, 4),
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
            lambda x, counts: x,
        )

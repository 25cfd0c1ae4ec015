"""Shared-prefix (tree) training equals running every sample in full.

- Engine, four families (Qwen3-MoE: GQA attention; Qwen3.5: Gated DeltaNet + attention;
  DeepSeek-V3: MLA; Kimi-Linear: KDA + MLA), fp32: the policy loss (clipped surrogate, KL, entropy, sequence-mean
  aggregation, sequence-level TIS), every parameter's gradient and the per-token log-probs of a
  tree batch equal those of the unshared batch. The trees cover a one-level group whose prefix
  crosses a 64-token chunk, continuations of 1 token (shorter than the conv window), a
  two-level tree and a one-token root (its children become roots).
  The same under emulated CUDA (``emulate_cuda``: the GPU branches, the gathered ``varlen_attn``
  call and FLA's GDN kernels, run on CPU with their reference kernels) for Qwen3.5 and DeepSeek-V3.
- The attention cores on a tree layout: dense mask (``sdpa``), per-document (``varlen`` on CPU)
  and the CUDA glue (one varlen call over gathered keys) through the kernel's CPU reference.
- Layout and batch errors.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from bumblebee import load_config
from bumblebee.primitives.attention.flash import reference_varlen_attn
from bumblebee.primitives.attention.sdpa import sdpa_masked, sdpa_varlen
from bumblebee.primitives.attention.tree import gathered_varlen
from bumblebee.primitives.emulation import emulate_cuda
from bumblebee.primitives.prefix_tree import tree_layout
from bumblebee.rl.batch import pack_sequences
from bumblebee.rl.engine import Engine
from bumblebee.rl.losses import PolicyLoss
from bumblebee.rl.shared_prefix import Segment, pack_shared_prefix, pack_tree, unshared

COMMON = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.router_aux_loss_coef=0.0",  # the balance loss counts a shared token once
    "train.micro_batch=1",  # the tree batch: two rows, two micro-batches
]
FAMILIES = {
    "qwen3_moe": ["model.arch.head_dim=8", "model.arch.moe_intermediate_size=32"],
    "qwen3_5_moe": [
        'model.arch.layer_types=["linear_attention", "full_attention"]',
        "model.arch.head_dim=8",
        "model.arch.linear_key_head_dim=8",
        "model.arch.linear_value_head_dim=8",
        "model.arch.moe_intermediate_size=32",
        "model.arch.shared_expert_intermediate_size=32",
    ],
    "deepseek_v3": ["model.arch.intermediate_size=64", "model.arch.moe_intermediate_size=32"],
    "kimi_linear": [  # KDA (GatedDeltaNet's interface, per-channel decay) + NoPE MLA
        'model.arch.layer_types=["linear_attention", "full_attention"]',
        'model.arch.mlp_layer_types=["dense", "sparse"]',
    ],
}


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def leaf(g, n):
    old = -5.6 + torch.randn(n, generator=g) * 0.1  # near the tiny models' log(1 / vocab)
    return Segment(
        torch.randint(0, 256, (n,), generator=g).tolist(),
        advantages=float(torch.randn((), generator=g)),
        old_logprobs=old.tolist(),
        ref_logprobs=(old + torch.randn(n, generator=g) * 0.1).tolist(),
        rollout_logprobs=(old + torch.randn(n, generator=g) * 0.05).tolist(),
    )


def trees(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    group = Segment(ids(70), [leaf(g, n) for n in (1, 3, 9, 66)])  # the prefix crosses a chunk
    two_level = Segment(ids(5), [Segment(ids(2), [leaf(g, 4), leaf(g, 1)]), leaf(g, 7)])
    one_token_root = Segment(ids(1), [leaf(g, 5), leaf(g, 2)])
    return [group, two_level, one_token_root]


def reference_batch(roots):
    s = unshared(roots)
    width = max(len(x["tokens"]) for x in s)
    return pack_sequences(
        [x["tokens"] for x in s],
        [x["loss_mask"] for x in s],
        width,
        **{
            k: [x[k] for x in s]
            for k in ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")
        },
    )


def step(e, batch, loss):
    e.zero_grad()
    out = e.forward_backward(batch, loss)
    grads = {n: p.grad.clone() for n, p in e.model.named_parameters() if p.grad is not None}
    return out, grads, e.compute_logprobs(batch).logprobs


@pytest.mark.parametrize(
    "family,emulated",
    [(f, False) for f in FAMILIES] + [("qwen3_5_moe", True), ("deepseek_v3", True)],
)
def test_tree_step_equals_unshared(tmp_path, family, emulated):
    cfg = load_config(
        None, [f"model.name={family}", *COMMON, *FAMILIES[family], f"train.out_dir={tmp_path}"]
    )
    e = Engine(cfg)
    roots = trees()
    tree, full = pack_tree(roots, seq_len=160), reference_batch(roots)
    assert tree.rows == 2 and tree.input_ids.numel() < full.input_ids.numel()
    loss = PolicyLoss(
        kl_coef=0.1, entropy_coef=0.01, agg="seq-mean-token-mean", tis=2.0, is_level="sequence"
    )
    # emulated: the CUDA branches on CPU (gathered varlen_attn, FLA's GDN op, fused conv), each
    # kernel replaced by the reference of its contract
    with emulate_cuda(check_comm=False) if emulated else contextlib.nullcontext():
        out_t, grads_t, lp_t = step(e, tree, loss)
        out_f, grads_f, lp_f = step(e, full, loss)
    assert out_t.tokens == out_f.tokens == sum(len(p[-1].tokens) for r in roots for p in r.leaves())
    assert out_t.loss == pytest.approx(out_f.loss, rel=1e-5, abs=1e-7)
    for k in out_f.metrics:
        assert out_t.metrics[k] == pytest.approx(out_f.metrics[k], rel=1e-5, abs=1e-6), k
    assert grads_t.keys() == grads_f.keys()
    for n, gf in grads_f.items():
        scale = gf.abs().max().clamp(min=1e-6)
        assert (grads_t[n] - gf).abs().max() <= 1e-4 * scale, n
    # every sample's trained log-probs: the tree's leaf tokens against the full sequences' tail
    for a, b, f in zip(tree.unpack(lp_t), full.unpack(lp_f), unshared(roots)):
        n = len(a)
        assert torch.allclose(a, b[-n:], atol=2e-5), family
        assert (b[-n:][torch.tensor(f["loss_mask"][-n:])] < 0).all()


def test_attention_cores_on_a_tree():
    g = torch.Generator().manual_seed(1)
    b = pack_tree(trees(1)[:2], seq_len=160)
    layout = tree_layout(b.position_ids, b.attach)
    B, T = b.input_ids.shape
    q, k, v = (torch.randn(B, h, T, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    # reference: each query attends exactly the tokens of its own sample before it
    want = sdpa_masked(q, k, v, layout, 0.3)
    for got in (
        sdpa_varlen(q, k, v, layout, 0.3),
        gathered_varlen(q, k, v, layout, 0.3, reference_varlen_attn),
    ):
        assert torch.allclose(got, want, atol=1e-5)
        dgot = torch.autograd.grad(got.square().sum(), (q, k, v))
        dwant = torch.autograd.grad(want.square().sum(), (q, k, v), retain_graph=True)
        for x, y in zip(dgot, dwant):
            assert torch.allclose(x, y, atol=1e-4)
    for core, kw in (
        (sdpa_varlen, {"window": 4}),
        (sdpa_varlen, {"sinks": torch.zeros(4)}),
        (sdpa_masked, {"window": 4}),
    ):
        with pytest.raises(NotImplementedError, match="tree"):  # positions along the chain: not yet
            core(q, k, v, layout, 0.3, **kw)
    # the dense mask itself against the samples: branch 2's last query sees the prefix and
    # branch 2, nothing of branch 1
    bounds, parents = layout.bounds[0], layout.parents[0]
    assert parents[:5] == (-1, 0, 0, 0, 0)
    s2, e2 = bounds[2], bounds[3]
    o = sdpa_masked(q, k, v, layout, 0.3)[0, :, e2 - 1]
    keys = list(range(bounds[1])) + list(range(s2, e2))
    ref = torch.softmax(
        q[0, :, e2 - 1, None] @ k[0].repeat_interleave(2, 0)[:, keys].transpose(1, 2) * 0.3, -1
    )
    assert torch.allclose(o, (ref @ v[0].repeat_interleave(2, 0)[:, keys])[:, 0], atol=1e-5)


def test_layout_and_batch_errors(tmp_path):
    b = pack_shared_prefix([1, 2, 3, 4], [[5, 6], [7]])
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 4, 7]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 3, 4]]
    assert b.attach.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]
    assert b.loss_mask.tolist() == [[False] * 4 + [True] * 2 + [False, True]]
    lay = tree_layout(b.position_ids, b.attach)
    assert lay.bounds == ((0, 3, 6, 8),) and lay.parents == ((-1, 0, 0),)
    with pytest.raises(ValueError, match="does not start an earlier document"):
        tree_layout(b.position_ids, torch.tensor([[0, 0, 0, 2, 2, 2, 1, 1]]))
    with pytest.raises(ValueError, match="a branch continues it"):
        tree_layout(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), b.attach)
    with pytest.raises(ValueError, match="shared segment"):
        pack_tree([Segment([1, 2], [Segment([3])], loss_mask=[True, True])])
    with pytest.raises(ValueError, match="more than seq_len"):
        pack_tree([Segment([1, 2], [Segment([3])])], seq_len=2)
    cfg = load_config(None, [*COMMON, *FAMILIES["qwen3_moe"], f"train.out_dir={tmp_path}"])
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        Engine(cfg, max_tokens_per_micro_batch=64).compute_logprobs(b)

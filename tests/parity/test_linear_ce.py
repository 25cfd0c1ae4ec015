"""Paired test: ``linear_ce`` (tiled, never materializes logits) against the ``ce`` reference.

fp32: per-token loss (= -log-prob), reduced losses, entropy and the gradients of
hidden and weight -- with gradients flowing through per-token losses *and*
entropy -- agree within 1e-5 relative (norm-wise). bf16: an error budget against
an fp32 ground truth (the reference run on the upcast bf16 inputs): linear_ce's
error may not exceed 1.2x ce's. Tiles are tiny so every case spans several token
and vocab tiles, with ragged last tiles.

Legend: T tokens, H hidden, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from bumblebee import registry
from bumblebee.primitives.loss import cross_entropy, linear_cross_entropy

TILES = dict(token_tile=8, vocab_tile=32)  # V=101 -> tiles of 32, 32, 32, 5


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def make_inputs(T=37, H=24, V=101, dtype=torch.float32, seed=0, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    hidden_TH = (torch.randn(T, H, generator=g) * 2.0).to(dtype)
    weight_VH = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    labels_T = torch.randint(0, V, (T,), generator=g)
    if ignore_every:
        labels_T[::ignore_every] = -100
    return hidden_TH, weight_VH, labels_T


def run(
    fn, hidden_TH, weight_VH, labels_T, reduction="none", temperature=1.0, with_entropy=True, **kw
):
    """Loss, entropy and grads for a backward through a weighted sum of loss and entropy."""
    h = hidden_TH.clone().requires_grad_()
    w = weight_VH.clone().requires_grad_()
    out = fn(
        h,
        w,
        labels_T,
        reduction=reduction,
        temperature=temperature,
        with_entropy=with_entropy,
        **kw,
    )
    loss, entropy_T = out if with_entropy else (out, None)
    T = labels_T.shape[0]
    # token-dependent weights, as an RL advantage or an entropy bonus would give
    total = (loss * torch.linspace(-1.0, 2.0, T)).sum() if reduction == "none" else loss
    if entropy_T is not None:
        total = total + 0.1 * (entropy_T * torch.linspace(0.5, -0.5, T)).sum()
    total.backward()
    return loss.detach(), None if entropy_T is None else entropy_T.detach(), h.grad, w.grad


def test_registered():
    assert registry.get("loss", "linear_ce").factory is linear_cross_entropy
    assert registry.reference("loss") == "ce"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_matches_ce(reduction, temperature):
    inputs = make_inputs()
    ref = run(cross_entropy, *inputs, reduction=reduction, temperature=temperature)
    got = run(linear_cross_entropy, *inputs, reduction=reduction, temperature=temperature, **TILES)
    for name, a, b in zip(("loss", "entropy", "grad_hidden", "grad_weight"), got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_log_probs_and_loss_only_path():
    """Per-token -log p(label) without entropy (the fused logsumexp path), ignored tokens 0."""
    hidden_TH, weight_VH, labels_T = make_inputs(T=29, V=70)
    ref = run(cross_entropy, hidden_TH, weight_VH, labels_T, with_entropy=False)
    got = run(linear_cross_entropy, hidden_TH, weight_VH, labels_T, with_entropy=False, **TILES)
    logp_T = (
        torch.log_softmax(hidden_TH @ weight_VH.T, -1)
        .gather(1, labels_T.clamp(min=0)[:, None])
        .squeeze(1)
    )
    valid_T = labels_T != -100
    assert torch.equal(got[0][~valid_T], torch.zeros(int((~valid_T).sum())))
    assert rel_err(-got[0][valid_T], logp_T[valid_T]) <= 1e-5
    for name, a, b in zip(
        ("loss", "grad_hidden", "grad_weight"), got[:1] + got[2:], ref[:1] + ref[2:]
    ):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))


def test_entropy_of_peaked_distribution():
    """Large logits (near one-hot softmax): entropy stays accurate (no lse - E[z] cancellation)."""
    hidden_TH, weight_VH, labels_T = make_inputs(T=16, V=50)
    ref = run(cross_entropy, hidden_TH * 20, weight_VH, labels_T)
    got = run(linear_cross_entropy, hidden_TH * 20, weight_VH, labels_T, **TILES)
    assert ref[1].min() < 1e-3  # the case is really peaked
    assert rel_err(got[1], ref[1]) <= 1e-5


@pytest.mark.parametrize(
    "case", ["single_token", "all_ignored", "one_tile_exact", "vocab_smaller_than_tile"]
)
def test_odd_sizes(case):
    T, V, tiles = {
        "single_token": (1, 101, TILES),
        "all_ignored": (19, 101, TILES),
        "one_tile_exact": (8, 32, TILES),
        "vocab_smaller_than_tile": (13, 7, TILES),
    }[case]
    hidden_TH, weight_VH, labels_T = make_inputs(T=T, V=V, ignore_every=0)
    if case == "all_ignored":
        labels_T[:] = -100
    for reduction in ("mean", "none"):
        ref = run(cross_entropy, hidden_TH, weight_VH, labels_T, reduction=reduction)
        got = run(
            linear_cross_entropy, hidden_TH, weight_VH, labels_T, reduction=reduction, **tiles
        )
        for name, a, b in zip(("loss", "entropy", "grad_hidden", "grad_weight"), got, ref):
            assert torch.isfinite(a).all(), name
            if b.norm() == 0:
                assert a.norm() == 0, name
            else:
                assert rel_err(a, b) <= 1e-5, (name, case, rel_err(a, b))
    if case == "all_ignored":
        plain = linear_cross_entropy(hidden_TH.requires_grad_(), weight_VH, labels_T, **tiles)
        assert plain.item() == 0.0


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_gradient_for_one_input_only(frozen):
    hidden_TH, weight_VH, labels_T = make_inputs(T=21, V=70)
    grads = []
    for fn, kw in ((cross_entropy, {}), (linear_cross_entropy, TILES)):
        h = hidden_TH.clone().requires_grad_(frozen != "hidden")
        w = weight_VH.clone().requires_grad_(frozen != "weight")
        loss, ent_T = fn(h, w, labels_T, with_entropy=True, **kw)
        (loss + ent_T.mean()).backward()
        assert (h.grad is None) == (frozen == "hidden") and (w.grad is None) == (frozen == "weight")
        grads.append(w.grad if frozen == "hidden" else h.grad)
    assert rel_err(grads[1], grads[0]) <= 1e-5


def test_default_tiles_and_custom_ignore_index():
    hidden_TH, weight_VH, labels_T = make_inputs(T=40, V=90, ignore_every=0)
    labels_T[::3] = 7  # ignore_index=7: a real vocabulary id
    ref = cross_entropy(hidden_TH, weight_VH, labels_T, ignore_index=7, reduction="sum")
    got = linear_cross_entropy(hidden_TH, weight_VH, labels_T, ignore_index=7, reduction="sum")
    assert rel_err(got, ref) <= 1e-5


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(
    "token_tile", [32, None]
)  # several token tiles / one (dW written directly)
def test_bf16_error_budget(with_entropy, reduction, token_tile):
    """bf16 inputs: error vs the fp32 ground truth <= 1.2x the reference's bf16 error."""
    hidden_TH, weight_VH, labels_T = make_inputs(T=96, H=64, V=301, dtype=torch.bfloat16, seed=1)
    kw = dict(temperature=0.9, with_entropy=with_entropy, reduction=reduction)
    truth = run(cross_entropy, hidden_TH.float(), weight_VH.float(), labels_T, **kw)
    ref = run(cross_entropy, hidden_TH, weight_VH, labels_T, **kw)
    got = run(
        linear_cross_entropy,
        hidden_TH,
        weight_VH,
        labels_T,
        token_tile=token_tile,
        vocab_tile=64,
        **kw,
    )
    for name, g, r, t in zip(("loss", "entropy", "grad_hidden", "grad_weight"), got, ref, truth):
        if r is None:
            assert g is None
            continue
        assert g.dtype == r.dtype
        err_got, err_ref = rel_err(g, t), rel_err(r, t)
        assert err_ref > 0, name  # bf16 really perturbs the reference
        assert err_got <= 1.2 * err_ref, (name, err_got, err_ref)


def test_autocast_matches_ce():
    hidden_TH, weight_VH, labels_T = make_inputs(T=24, V=60)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = run(cross_entropy, hidden_TH, weight_VH, labels_T)
        got = run(linear_cross_entropy, hidden_TH, weight_VH, labels_T, **TILES)
    assert (
        got[2].dtype == torch.float32 and got[3].dtype == torch.float32
    )  # grads reach the fp32 leaves
    for name, a, b in zip(("loss", "entropy", "grad_hidden", "grad_weight"), got, ref):
        assert rel_err(a, b) <= 2e-2, (name, rel_err(a, b))


def test_bad_input_raises():
    hidden_TH, weight_VH, labels_T = make_inputs(T=4, V=10, ignore_every=0)
    with pytest.raises(ValueError, match="labels must be in"):
        linear_cross_entropy(hidden_TH, weight_VH, torch.tensor([0, 1, 10, -100]))
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden_TH, weight_VH, labels_T, reduction="avg")
    with pytest.raises(ValueError, match="same dtype"):
        linear_cross_entropy(hidden_TH.bfloat16(), weight_VH, labels_T)
    with pytest.raises(ValueError, match="tile"):
        linear_cross_entropy(hidden_TH, weight_VH, labels_T, vocab_tile=0)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_extra_memory_never_holds_tokens_by_vocab(with_entropy):
    """What the loss slot exists for, measured: the extra live bytes of forward + backward
    (MemoryTracker; inputs allocated before) stay within the outputs, the gradients and a
    few [token_tile, vocab_tile] tiles. A change that materialized [T, V] (one full-vocab
    tile, a logits cache for backward, ...) fails; ``ce`` itself is seen to exceed T*V*4."""
    from bumblebee.perf import MemoryTracker

    T, H, V, tiles = 1024, 32, 4096, dict(token_tile=128, vocab_tile=512)
    hidden_TH, weight_VH, labels_T = make_inputs(T=T, H=H, V=V)
    h, w = hidden_TH.requires_grad_(), weight_VH.requires_grad_()
    logits_bytes, tile_bytes = T * V * 4, 128 * 512 * 4
    needed = (T * H + V * H) * 4 * 2 + T * 4 * 8  # grads (+ fp32 accumulators), per-token stats

    def extra_peak(fn, **kw):
        with MemoryTracker("cpu") as mem:
            out = fn(h, w, labels_T, reduction="sum", with_entropy=with_entropy, **kw)
            (out[0] + out[1].sum() if with_entropy else out).backward()
        h.grad = w.grad = None
        return mem.peak_bytes

    got = extra_peak(linear_cross_entropy, **tiles)
    assert got <= needed + 8 * tile_bytes, (got, needed, tile_bytes)
    assert got < logits_bytes / 4
    assert extra_peak(cross_entropy) > logits_bytes  # the tracker does see a materialization

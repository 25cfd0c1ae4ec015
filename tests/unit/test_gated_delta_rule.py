"""Gated DeltaNet primitives: chunked vs recurrent, packed documents, carried state.

- ``chunked`` equals the token-by-token ``recurrent`` reference within 1e-5
  (outputs, final state, and the gradients of q, k, v, g, beta and the initial
  state), with and without an initial state, at lengths that are not multiples
  of the chunk size, with grouped value heads and with strong decays;
- a packed row equals its documents run one by one (core, conv and the whole
  layer), and the initial state reaches only the row's first document;
- splitting a sequence anywhere and carrying the returned state (recurrent state
  and conv window) into the second call equals one call: the contract context
  parallelism relies on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bumblebee import registry
from bumblebee.primitives.linear_attention.conv import causal_conv1d
from bumblebee.primitives.linear_attention.gated_delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)
from bumblebee.primitives.linear_attention.gdn import GatedDeltaNet
from bumblebee.primitives.packed import DocLayout, doc_layout
from bumblebee.primitives.recompute import NoRecompute

TOL = 1e-5


def single(B, T):
    return DocLayout(bounds=((0, T),) * B, seq_len=T)


def packed(*rows):
    """Layout of rows given as document lengths, via restarting position ids."""
    return doc_layout(torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows]))


def inputs(B, T, G, H, K=16, V=8, decay=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, G, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    g = -decay * F.softplus(torch.randn(B, T, H, generator=gen) + 1)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    S0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, S0


def close(a, b, what):
    scale = max(b.abs().max().item(), 1.0)
    err = (a - b).abs().max().item()
    assert err <= TOL * scale, f"{what}: max-abs diff {err:.3g} (scale {scale:.3g})"


def run(fn, tensors, layout, with_state):
    q, k, v, g, beta, S0 = (t.clone().requires_grad_() for t in tensors)
    o, S = fn(q, k, v, g, beta, layout, S0 if with_state else None)
    gen = torch.Generator().manual_seed(1)
    (
        (o * torch.randn(o.shape, generator=gen)).sum()
        + (S * torch.randn(S.shape, generator=gen)).sum()
    ).backward()
    return o, S, [t.grad for t in (q, k, v, g, beta, S0) if t.grad is not None]


@pytest.mark.parametrize(
    "T,G,H,decay", [(1, 1, 1, 1.0), (63, 2, 2, 1.0), (130, 2, 4, 1.0), (100, 1, 3, 12.0)]
)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(T, G, H, decay, with_state):
    tensors = inputs(2, T, G, H, decay=decay)
    layout = single(2, T)
    o_ref, S_ref, grads_ref = run(gated_delta_rule_recurrent, tensors, layout, with_state)
    o, S, grads = run(gated_delta_rule_chunked, tensors, layout, with_state)
    close(o, o_ref, "output")
    close(S, S_ref, "final state")
    assert len(grads) == len(grads_ref) == (6 if with_state else 5)
    for name, a, b in zip("q k v g beta S0".split(), grads, grads_ref):
        close(a, b, f"grad {name}")


def test_chunked_equals_recurrent_packed():
    tensors = inputs(2, 150, 2, 4)
    layout = packed([1, 64, 20, 65], [150])
    o_ref, S_ref, grads_ref = run(gated_delta_rule_recurrent, tensors, layout, True)
    o, S, grads = run(gated_delta_rule_chunked, tensors, layout, True)
    close(o, o_ref, "output")
    close(S, S_ref, "final state")
    for name, a, b in zip("q k v g beta S0".split(), grads, grads_ref):
        close(a, b, f"grad {name}")


@pytest.mark.parametrize("fn", [gated_delta_rule_recurrent, gated_delta_rule_chunked])
def test_packed_row_equals_documents(fn):
    lengths = [5, 70, 1, 54]
    q, k, v, g, beta, S0 = inputs(1, sum(lengths), 2, 4)
    o, S = fn(q, k, v, g, beta, packed(lengths), S0)
    start = 0
    for i, n in enumerate(lengths):
        sl = slice(start, start + n)
        o_doc, S_doc = fn(
            q[:, sl],
            k[:, sl],
            v[:, sl],
            g[:, sl],
            beta[:, sl],
            single(1, n),
            S0 if i == 0 else None,
        )  # the initial state belongs to the first document only
        close(o[:, sl], o_doc, f"document {i}")
        start += n
    close(S, S_doc, "final state = last document's state")


@pytest.mark.parametrize("fn", [gated_delta_rule_recurrent, gated_delta_rule_chunked])
@pytest.mark.parametrize("split", [1, 40, 50, 64, 97])
def test_carried_state_equals_one_call(fn, split):
    tensors = inputs(2, 130, 2, 4)
    pos = torch.stack([torch.arange(130), torch.cat([torch.arange(50), torch.arange(80)])])
    o_full, S_full = fn(*tensors[:5], doc_layout(pos), tensors[5])
    first = [t[:, :split] for t in tensors[:5]]
    second = [t[:, split:] for t in tensors[:5]]
    o1, S1 = fn(*first, doc_layout(pos[:, :split]), tensors[5])
    S1 = S1 * (pos[:, split] != 0)[:, None, None, None]  # the carry only continues an open document
    o2, S2 = fn(*second, doc_layout(pos[:, split:]), S1)
    close(torch.cat([o1, o2], dim=1), o_full, "output")
    close(S2, S_full, "final state")


def test_conv_matches_conv1d_and_carries_window():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 30, 6, generator=gen)
    w = torch.randn(6, 4, generator=gen)
    y, _ = causal_conv1d(x, w, single(2, 30))
    ref = F.conv1d(x.transpose(1, 2), w[:, None], padding=3, groups=6)[..., :30].transpose(1, 2)
    close(y, ref, "conv")
    pos = torch.stack(
        [torch.arange(30), torch.cat([torch.arange(11), torch.arange(2), torch.arange(17)])]
    )
    y_full, win_full = causal_conv1d(x, w, doc_layout(pos))
    for split in (1, 2, 12, 13, 29):
        y1, win = causal_conv1d(x[:, :split], w, doc_layout(pos[:, :split]))
        win = (
            win * (pos[:, split] != 0)[:, None, None]
        )  # a row whose second part starts a document: no carry
        y2, win2 = causal_conv1d(x[:, split:], w, doc_layout(pos[:, split:]), win)
        close(torch.cat([y1, y2], dim=1), y_full, f"conv split {split}")
        close(win2, win_full, f"conv window split {split}")
    # row 1, document [11, 13) has 2 tokens: its outputs see only themselves
    y_doc, _ = causal_conv1d(x[1:, 11:13], w, single(1, 2))
    close(y_full[1:, 11:13], y_doc, "short document")


def make_layer(core, seed=0):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(
        hidden=24,
        num_k_heads=2,
        num_v_heads=4,
        head_k_dim=8,
        head_v_dim=6,
        conv_kernel=4,
        eps=1e-6,
        core=core,
        recompute=NoRecompute(),
    )
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)  # larger than init so every path carries signal
    return layer


def test_layer_packed_split_and_implementations():
    x = torch.randn(2, 90, 24, generator=torch.Generator().manual_seed(0))
    pos = torch.stack(
        [torch.arange(90), torch.cat([torch.arange(3), torch.arange(60), torch.arange(27)])]
    )
    ref_layer, layer = make_layer(gated_delta_rule_recurrent), make_layer(gated_delta_rule_chunked)
    y_ref, _ = ref_layer(x, doc_layout(pos))
    y, state = layer(x, doc_layout(pos))
    close(y, y_ref, "layer chunked vs recurrent")
    y_doc, _ = layer(x[1:, 3:63], single(1, 60))
    close(y[1:, 3:63], y_doc, "layer packed vs alone")
    for split in (50, 63):  # row 1 starts a document at 63
        y1, s1 = layer(x[:, :split], doc_layout(pos[:, :split]))
        y2, s2 = layer(x[:, split:], doc_layout(pos[:, split:]), s1.continued(pos[:, split] != 0))
        close(torch.cat([y1, y2], dim=1), y, f"layer split {split} + carried state")
        close(s2.conv_BPC, state.conv_BPC, "conv window")
        close(s2.recurrent_BHKV, state.recurrent_BHKV, "recurrent state")


def test_registry_and_errors():
    impls = registry.implementations("linear_attention")
    assert {"recurrent", "chunked"} <= set(impls)
    assert registry.reference("linear_attention") == "recurrent"
    q, k, v, g, beta, S0 = inputs(1, 10, 2, 3)  # 3 value heads do not group over 2 key heads
    with pytest.raises(ValueError, match="multiple of 2 heads"):
        gated_delta_rule_chunked(q, k, v, g, beta, single(1, 10))
    q, k, v, g, beta, S0 = inputs(1, 10, 2, 4)
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule_recurrent(q, k, v, g, beta, single(1, 10), S0[..., :3])
    with pytest.raises(ValueError, match="layout"):
        gated_delta_rule_chunked(q, k, v, g, beta, single(1, 9))
    with pytest.raises(ValueError, match="initial window"):
        causal_conv1d(torch.randn(1, 5, 3), torch.randn(3, 4), single(1, 5), torch.zeros(1, 2, 3))

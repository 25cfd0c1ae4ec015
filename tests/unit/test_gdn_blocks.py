"""The Gated DeltaNet layer's memory blocking changes no result: the gated norm in blocks of
``NORM_BLOCK`` tokens over all rows equals one call (outputs, input and weight gradients, up to
the CPU kernels' vectorized reductions: 3e-8 measured) and the conv in channel blocks (split,
whose backward cats the blocks' gradients once) equals one call (the same tolerance)."""

import torch

from bumblebee.primitives.linear_attention import gdn
from bumblebee.primitives.linear_attention.conv import CausalConv1d
from bumblebee.primitives.packed import doc_layout


def run(module, *xs, fn=None):
    xs = [x.clone().requires_grad_() for x in xs]
    y = (fn or module)(*xs)
    y = y[0] if isinstance(y, tuple) else y
    g = torch.Generator().manual_seed(3)
    (y * torch.randn(y.shape, generator=g)).sum().backward()
    out = (
        y.detach(),
        [x.grad for x in xs],
        {n: p.grad.clone() for n, p in module.named_parameters()},
    )
    module.zero_grad()
    return out


def test_gated_norm_blocks_equal_one_call(monkeypatch):
    torch.manual_seed(0)
    norm = gdn.GatedRMSNorm(8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, z = torch.randn(2, 13, 3, 8), torch.randn(2, 13, 3, 8)
    whole = run(norm, x, z)
    monkeypatch.setattr(
        gdn, "NORM_BLOCK", 5
    )  # 26 tokens > 2 x 5: blocks across the row boundary, a short last one
    blocked = run(norm, x, z)
    for a, b in zip(
        [whole[0], *whole[1], whole[2]["weight"]], [blocked[0], *blocked[1], blocked[2]["weight"]]
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_conv_channel_blocks_equal_one_call():
    torch.manual_seed(0)
    conv = CausalConv1d(12, 4)
    torch.nn.init.normal_(conv.weight)
    x, init = torch.randn(2, 9, 12), torch.randn(2, 3, 12)
    lay = doc_layout(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5], list(range(9))]))
    whole = run(conv, x, init, fn=lambda a, b: conv(a, lay, b, torch.nn.functional.silu, block=12))
    blocked = run(conv, x, init, fn=lambda a, b: conv(a, lay, b, torch.nn.functional.silu, block=5))
    for a, b in zip(
        [whole[0], *whole[1], whole[2]["weight"]], [blocked[0], *blocked[1], blocked[2]["weight"]]
    ):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

"""The GDN CP scan's two-call form on FLA (primitives/linear_attention/cp_probe.py) against the CPU
path's one extended call on ``[v | 0_K]`` from ``[0 | I_K]``, both through the FLA glue in the
emulated-CUDA mode, fp32 to 1e-5:

- the four segment terms (o|0, e, S_out|0, M): rows of one document (p = m, the I_K states as
  given), short first documents (the probe cut one token past the longest; a row whose first
  document ends exactly there still gets M = 0), a cut that would keep more bytes than the whole
  rows (not taken), and FLA forwards counted (the values may take two calls, the probe one);
- the scan end to end: a Gated DeltaNet layer through ``gated_delta_net_cp`` on a one-rank CP group
  (two zigzag segments, so the scan, the correction and the gather run) under emulation, output
  and gradients against the layer on the whole sequence on the CPU path."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from bumblebee.perf.syncs import SyncCounter
from bumblebee.primitives.cp.zigzag import build_cp_shards, shard_sequence
from bumblebee.primitives.emulation import emulate_cuda
from bumblebee.primitives.linear_attention.cp import gated_delta_net_cp
from bumblebee.primitives.linear_attention.cp_probe import split_terms
from bumblebee.primitives.linear_attention.fla import FLA_FWD
from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_chunked
from bumblebee.primitives.linear_attention.gdn import GatedDeltaNet
from bumblebee.primitives.packed import DocLayout, doc_layout
from bumblebee.primitives.recompute import NoRecompute

M, G, H, K, V = 24, 2, 4, 8, 6
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "bounds, p, fla_calls",
    [
        (((0, 24), (0, 24), (0, 24)), 24, 2),  # one document per row: no cut
        (((0, 24), (0, 10, 24), (0, 7, 9, 24)), 24, 3),  # row 0 spans: no cut; values in 2 calls
        (((0, 7, 24), (0, 9, 20, 24), (0, 5, 6, 24)), 10, 3),  # first documents end by 9: cut
        (((0, 22, 24), (0, 3, 24), (0, 5, 24)), 24, 2),  # a cut at 23 keeps more bytes: none
    ],
)
def test_split_terms_equal_the_extended_call(bounds, p, fla_calls):
    g = torch.Generator().manual_seed(3)
    R = len(bounds)
    q, k = (torch.randn(R, M, G, K, generator=g) for _ in "qk")
    v = torch.randn(R, M, H, V, generator=g)
    gate, beta = -torch.rand(R, M, H, generator=g), torch.rand(R, M, H, generator=g)
    rows = DocLayout(bounds, M)
    layer = SimpleNamespace(recompute=NoRecompute(), core=gated_delta_rule_chunked)
    with emulate_cuda(check_comm=False):
        v_ext = torch.cat([v, v.new_zeros(R, M, H, K)], -1)
        init = torch.cat([v.new_zeros(R, H, K, V), torch.eye(K).expand(R, H, K, K)], -1)
        o_ext, final = gated_delta_rule_chunked(q, k, v_ext, gate, beta, rows, init)
        with SyncCounter() as c:
            o0, e, S0, Mt = split_terms(layer, q, k, v, gate, beta, rows)
    assert e.shape == (R, p, H, K)
    torch.testing.assert_close(o0, o_ext[..., :V], **TOL)
    torch.testing.assert_close(e, o_ext[:, :p, :, V:], **TOL)
    assert o_ext[:, p:, :, V:].abs().sum() < 1e-5  # past every first document: no state map
    torch.testing.assert_close(S0, final[..., :V], **TOL)
    torch.testing.assert_close(Mt, final[..., V:], **TOL)
    assert c.by_kernel[FLA_FWD[0]] == fla_calls


# the scan end to end: 64 tokens as two zigzag segments of 32 on one rank. Long: a document across
# the segment edge and one starting exactly at it (the probe over whole rows); short: every
# segment's first document ends by token 10 (the probe cut to 11 tokens), two documents across
# the edge
LONG, SHORT = [[20, 12, 32], [3, 5, 40, 16]], [[10, 10, 16, 8, 20], [3, 5, 30, 12, 14]]


def _layer(docs):
    torch.manual_seed(0)
    # K = 16 != V = 8, 2 key heads for 4 value heads: transposed or mixed-up dims show
    layer = GatedDeltaNet(32, 2, 4, 16, 8, 4, 1e-6, gated_delta_rule_chunked, NoRecompute())
    with torch.no_grad():
        layer.A_log.copy_(torch.tensor([0.0, -1.0, 0.5, -3.0]))  # mild decays: the state carries
    gen = torch.Generator().manual_seed(1)
    x, w = (torch.randn(len(docs), 64, 32, generator=gen) for _ in "xw")
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    return layer, x.requires_grad_(), w, pos


def _run(docs, cp: bool):
    layer, x, w, pos = _layer(docs)
    if cp:
        with emulate_cuda(check_comm=False), SyncCounter() as c:
            layout = build_cp_shards(shard_sequence(pos, 1, 0), dist.group.WORLD)
            y = gated_delta_net_cp(layer, x, layout)
            (y * w).sum().backward()
        assert c.by_kernel[FLA_FWD[0]] >= 2  # the two-call form ran
    else:
        y, _ = layer(x, doc_layout(pos))
        (y * w).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def test_probe_scan_matches_the_whole_sequence(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        got = [_run(docs, cp=True) for docs in (LONG, SHORT)]
    finally:
        dist.destroy_process_group()
    for docs, cp in zip((LONG, SHORT), got):
        for a, b in zip(cp, _run(docs, cp=False)):
            torch.testing.assert_close(a, b, **TOL)

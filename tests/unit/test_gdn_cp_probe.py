"""The GDN CP scan's segment terms on CUDA (primitives/linear_attention/cp_probe.py): o|0, e, S_out|0
and M from two core calls (values of width V from zero; a probe of width K from I_K over the rows'
first documents only) equal the CPU path's one extended call on ``[v | 0_K]`` from ``[0 | I_K]``,
both through the FLA glue in the emulated-CUDA mode, fp32 to 1e-5: with a document spanning a
row (no cut) and with every first document shorter than the segment (the probe cut to the longest
one; a row whose first document ends exactly there gets M = 0). The scan itself, end to end:
``tests/distributed/test_emulated_cuda.py`` (Qwen3.5, cp 2 ring)."""

from types import SimpleNamespace

import pytest
import torch

from bumblebee.perf.syncs import SyncCounter
from bumblebee.primitives.emulation import emulate_cuda
from bumblebee.primitives.linear_attention.cp_probe import split_terms
from bumblebee.primitives.linear_attention.fla import FLA_FWD
from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_chunked
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.recompute import NoRecompute

M, G, H, K, V = 24, 2, 4, 8, 6


@pytest.mark.parametrize(
    "bounds, m1",
    [
        (((0, 24), (0, 10, 24), (0, 7, 9, 24)), 24),  # row 0 is one document: no cut
        (((0, 12, 24), (0, 10, 20, 24), (0, 12, 13, 24)), 12),  # rows 0 and 2 end at the cut
    ],
)
def test_split_terms_equal_the_extended_call(bounds, m1):
    g = torch.Generator().manual_seed(3)
    R = len(bounds)
    q, k = (torch.randn(R, M, G, K, generator=g) for _ in "qk")
    v = torch.randn(R, M, H, V, generator=g)
    gate, beta = -torch.rand(R, M, H, generator=g), torch.rand(R, M, H, generator=g)
    rows = DocLayout(bounds, M)
    layer = SimpleNamespace(recompute=NoRecompute(), core=gated_delta_rule_chunked)
    with emulate_cuda(check_comm=False):
        v_ext = torch.cat([v, v.new_zeros(R, M, H, K)], -1)
        eye = torch.eye(K).expand(R, H, K, K)
        init = torch.cat([v.new_zeros(R, H, K, V), eye], -1)
        o_ext, final = gated_delta_rule_chunked(q, k, v_ext, gate, beta, rows, init)
        with SyncCounter() as c:
            o0, e, S0, Mt = split_terms(layer, q, k, v, gate, beta, rows)
    assert e.shape[1] == m1
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o0, o_ext[..., :V], **tol)
    torch.testing.assert_close(e, o_ext[:, :m1, :, V:], **tol)
    assert o_ext[:, m1:, :, V:].abs().sum() < 1e-5  # past every first document: no state map
    torch.testing.assert_close(S0, final[..., :V], **tol)
    torch.testing.assert_close(Mt, final[..., V:], **tol)
    # the values: edge and middle documents (two calls); the probe: one call, one document per row
    assert c.by_kernel[FLA_FWD[0]] == 3

"""The MoE combine on CUDA (primitives/moe/local.py ``gather_combine`` / ``combine_into``): rows read
back to (token, choice) order by one gather, weighted and summed in one kernel, instead of an
unsorted [N, H] copy and a weighted [N, H] product. In the emulated-CUDA mode the fused function
runs eagerly (counted as one compiled kernel): outputs and every gradient equal the CPU path bit
for bit, for ``local`` (autograd through the fused stand-in) and ``chunked`` at ep 1 (its own
backward, the plain sum over choices through the same gather), recompute none and full. The
dispatch gather's backward on CUDA (``dispatch_rows``) sums the K choices by a gather, in choice
order (autograd's scatter-add sums them in expert order): the input gradient to fp32 rounding."""

import shutil

import pytest
import torch

from bumblebee import registry
from bumblebee.config import PrimitivesConfig
from bumblebee.models.blocks import MoE
from bumblebee.models.qwen3_moe import Qwen3MoeArch
from bumblebee.perf.syncs import SyncCounter
from bumblebee.primitives.emulation import emulate_cuda
from bumblebee.primitives.moe import local
from bumblebee.primitives.parallel import ParallelGroups

E, H, FFN, K, T = 8, 32, 16, 3, 40


def _layer(comm, policy):
    arch = Qwen3MoeArch(
        vocab_size=97,
        hidden_size=H,
        intermediate_size=48,
        moe_intermediate_size=FFN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=E,
        num_experts_per_tok=K,
    )
    torch.manual_seed(0)
    dispatch = registry.get("moe_comm", comm).factory(num_experts=E, ep_group=None, num_chunks=2)
    moe = MoE(arch, PrimitivesConfig(), dispatch, ParallelGroups())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        moe.experts.w_gate_up.copy_(torch.randn(E, 2 * FFN, H, generator=g) * 0.1)
        moe.experts.w_down.copy_(torch.randn(E, H, FFN, generator=g) * 0.1)
    x_TH = torch.randn(T, H, generator=g).requires_grad_()
    weight_TK = torch.rand(T, K, generator=g).requires_grad_()
    idx_TK = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    rc = registry.get("recompute", policy).factory([])
    y_TH = rc.layer(lambda x, w: moe.dispatch(x, idx_TK, w, moe._run_experts), x_TH, weight_TK)
    (y_TH * torch.randn(T, H, generator=g)).sum().backward()
    return [y_TH.detach(), x_TH.grad, weight_TK.grad, moe.experts.w_gate_up.grad]


@pytest.mark.parametrize("comm", ["local", "chunked"])
@pytest.mark.parametrize("policy", ["none", "full"])
def test_fused_combine_equals_the_cpu_path(comm, policy):
    want = _layer(comm, policy)
    with emulate_cuda(check_comm=False), SyncCounter() as c:
        got = _layer(comm, policy)
    for name, a, b in zip(("y", "dx", "dweight", "dw_gate_up"), got, want):
        if name == "dx" and comm == "local":  # the K choices summed in choice order, not sorted
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b), name
    names = {n for n in c.by_kernel if n.startswith("moe_")}
    if comm == "local":
        assert names == {
            f"moe_{n} (compiled)" for n in ("combine fwd", "combine bwd", "gather bwd")
        }
    else:
        assert names == {"moe_combine (compiled)", "moe_uncombine (compiled)"}


@pytest.mark.skipif(
    shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler"
)
def test_compiled_gathers_match_their_eager_form():
    """What CUDA compiles (inductor; here its CPU code): the combine into a slice of the output
    (an ``out=`` view), its backward gathers and the dispatch gather's backward."""
    g = torch.Generator().manual_seed(4)
    y = torch.randn(T * K, H, generator=g)
    order = torch.randperm(T * K, generator=g)
    inv = local.inverse(order).view(T, K)
    w, grad = torch.rand(T, K, generator=g), torch.randn(T, H, generator=g)
    got, want = torch.zeros(2 * T, H), torch.zeros(2 * T, H)
    local._combine_into(want[T:], y, inv, w)
    torch.compile(local._combine_into, fullgraph=True)(got[T:], y, inv, w)
    torch.testing.assert_close(got, want)
    for fn, args in (
        (local._combine_grads, (grad, y, order, inv, w)),
        (local._gather_sum, (y, inv)),
    ):
        for a, b in zip(torch.compile(fn, fullgraph=True)(*args), fn(*args)):
            torch.testing.assert_close(a, b)

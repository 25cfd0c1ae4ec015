"""MemoryTracker on CPU against allocations of known size.

Checks exact byte counts for plain allocations, views and in-place ops (a
storage counts once), frees, the peak window, tensors created and freed by
autograd in backward, storages resized in place (FSDP2's gathered parameters; the
FSDP2 case itself runs on 2 ranks in tests/distributed/test_static_memory.py), and
the per-category breakdown for a model + AdamW step.
"""

from __future__ import annotations

import pytest
import torch

from bumblebee.perf import CATEGORIES, MemoryTracker

MiB = 2**20


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_allocation_raises_peak_and_free_lowers_current():
    with MemoryTracker("cpu") as mem:
        assert (mem.current_bytes, mem.peak_bytes) == (0, 0)
        a = torch.empty(MiB, dtype=torch.uint8)
        assert (mem.current_bytes, mem.peak_bytes) == (MiB, MiB)
        b = torch.ones(MiB // 4, dtype=torch.float32)  # another MiB
        assert (mem.current_bytes, mem.peak_bytes) == (2 * MiB, 2 * MiB)
        del a
        assert (mem.current_bytes, mem.peak_bytes) == (MiB, 2 * MiB)
        mem.reset_peak()
        assert mem.peak_bytes == MiB
        del b
        assert (mem.current_bytes, mem.peak_bytes) == (0, MiB)
    c = torch.empty(4 * MiB, dtype=torch.uint8)  # after exit: figures frozen
    assert (mem.current_bytes, mem.peak_bytes) == (0, MiB)
    del c


def test_views_and_inplace_count_once():
    with MemoryTracker("cpu") as mem:
        a = torch.zeros(1024, 256)  # 1 MiB
        views = [a.view(-1), a[3:], a.T, a.reshape(256, 1024), a.add_(1.0), a.mul_(2.0)]
        assert mem.current_bytes == MiB
        c = a.t().contiguous()  # a real copy
        assert mem.current_bytes == 2 * MiB
        del a
        assert mem.current_bytes == 2 * MiB  # views keep the storage alive
        del views
        assert mem.current_bytes == MiB
        del c
        assert mem.current_bytes == 0


def test_views_of_preexisting_tensors_are_not_allocations():
    w = torch.zeros(1024, 256)  # 1 MiB, allocated before the context
    with MemoryTracker("cpu") as mem:
        parts = [
            w[:512],
            w.T,
            w.view(-1),
            w.add_(1.0),
            torch.split(w, 100)[0],
            w.unbind(0)[3],
            w.detach(),
        ]
        assert mem.current_bytes == 0
        y = w[:512] * 2  # a real allocation: 0.5 MiB
        assert mem.current_bytes == MiB // 2
        del parts, y


def test_storages_resized_in_place_are_counted():
    """``untyped_storage().resize_`` bypasses the dispatcher; FSDP2 frees and regrows its
    gathered parameters with it in every forward and backward."""
    old = torch.empty(MiB, dtype=torch.uint8)  # allocated before the context, then freed in place
    old.untyped_storage().resize_(0)
    with MemoryTracker("cpu") as mem:
        a = torch.empty(MiB, dtype=torch.uint8)
        a.untyped_storage().resize_(0)
        assert (mem.current_bytes, mem.peak_bytes) == (0, MiB)
        a.untyped_storage().resize_(3 * MiB)
        assert (mem.current_bytes, mem.peak_bytes) == (3 * MiB, 3 * MiB)
        old.untyped_storage().resize_(2 * MiB)  # grown inside the context: now counted
        assert (mem.current_bytes, mem.peak_bytes) == (5 * MiB, 5 * MiB)
        old.untyped_storage().resize_(0)
        del a
        assert (mem.current_bytes, mem.peak_bytes) == (0, 5 * MiB)
    old.untyped_storage().resize_(4 * MiB)  # after exit: not watched, figures frozen
    assert (mem.current_bytes, mem.peak_bytes) == (0, 5 * MiB)
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # the wrapper is gone


def test_autograd_saved_activation_and_backward_temporaries():
    x = torch.randn(MiB // 4, requires_grad=True)  # 1 MiB leaf, allocated before: not counted
    with MemoryTracker("cpu") as mem:
        y = x.exp()  # exp saves its output (1 MiB)
        z = y.sum()
        assert mem.current_bytes == MiB + 4
        z.backward()  # grad of sum (expand of a scalar), grad of exp (1 MiB), x.grad
        assert mem.peak_bytes >= 2 * MiB
        assert x.grad is not None
        del y, z
        assert mem.current_bytes == MiB  # only x.grad is left
        x.grad = None
        assert mem.current_bytes == 0


def test_breakdown_for_a_training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(512, 128)
    params = nbytes(model.parameters())
    with MemoryTracker("cpu", model=model, optimizer=opt) as mem:
        start = mem.breakdown()
        assert start == {
            "parameters": params,
            "gradients": 0,
            "optimizer_state": 0,
            "activations": 0,
            "total": params,
        }
        h = model(x)
        after_fwd = mem.breakdown()
        # live: relu output [512, 256] (saved by relu and by the second linear) + h [512, 64];
        # the first linear's output was freed (relu saves its result, not its input)
        assert after_fwd["activations"] == (512 * 256 + 512 * 64) * 4
        h.square().mean().backward()
        del h
        assert mem.breakdown()["gradients"] == params
        assert mem.breakdown()["activations"] == 0
        opt.step()
        after_step = mem.breakdown()
        state = nbytes(v for s in opt.state.values() for v in s.values())
        assert after_step["optimizer_state"] == state >= 2 * params  # exp_avg, exp_avg_sq (+ step)
        peak = mem.breakdown("peak")
        assert peak["total"] == mem.peak_bytes >= after_step["total"]
        assert set(peak) == set(CATEGORIES) | {"total"}
        opt.zero_grad(set_to_none=True)
        assert mem.breakdown()["gradients"] == 0


def test_full_recompute_lowers_tracked_activation_peak():
    """A use of the tracker as the benchmarks use it: checkpointing must show less activation peak."""
    from torch.utils.checkpoint import checkpoint

    # each block saves a [512, 1024] intermediate; checkpointed, only its [512, 256] input
    layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256))
        for _ in range(6)
    )
    x = torch.randn(512, 256, requires_grad=True)

    def run(ckpt):
        with MemoryTracker("cpu", model=layers) as mem:
            h = x
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=False) if ckpt else layer(h)
            h.sum().backward()
        layers.zero_grad(set_to_none=True)
        return mem.breakdown("peak")["activations"]

    assert run(True) < 0.6 * run(False)


def test_bad_breakdown_argument():
    with MemoryTracker("cpu") as mem:
        with pytest.raises(ValueError, match="'current' or 'peak'"):
            mem.breakdown("max")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocation():
    with MemoryTracker("cuda") as mem:
        base = mem.current_bytes
        a = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        assert mem.current_bytes - base == MiB and mem.peak_bytes >= base + MiB
        del a
        assert mem.current_bytes == base

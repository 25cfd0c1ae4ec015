"""Emulated CUDA: the training step's CUDA branches executed on CPU tensors (``train.emulate_cuda``).

CPU runs never take the branches a GPU run takes (flash varlen attention, the ring of flash
block calls, FLA's custom op, the chunked-EP side stream, the record_stream of the in-place
reduce-scatter), so a defect in them stays invisible until the first GPU run. Inside
``emulate_cuda()`` the kernel choice answers as it would on CUDA in half precision (any
dtype: fp32 runs compare with the plain CPU path to fp32 rounding), and each CUDA kernel is
replaced by the reference of its contract: ``reference_varlen_attn`` for ``varlen_attn``,
``reference_block_kernel`` for the ring's flash ops, ``reference_chunk_gated_delta_rule`` inside
the ``bumblebee::fla_gdn`` op (a real backward through autograd, not zeros). Streams and
events become no-op stand-ins with the same calls. Every collective and point-to-point call
goes through ``CheckedComm`` (comm_check.py): NCCL moves bytes in memory order without
checking layout, shape or dtype, so the emulation does.

With ``real_kernels`` (``train.emulate_cuda = "real_kernels"``) FLA's own Triton kernels run in
place of their references (``chunk_gated_delta_rule`` in the op, ``chunk_kda``, ``causal_conv1d``),
on the CPU tensors, through Triton's interpreter (``triton_interpreter.py``: needs ``triton`` and
``fla-core``; seconds per kernel call at tiny shapes). The flash kernels keep their references:
they are CUDA code, not Triton.

The switch is a context (a ``ContextVar``), entered once per rank process by the runtime; the
primitives ask ``active()`` / ``real_kernels()`` / ``kind(tensor)`` at call time. Nothing changes
outside it.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_ACTIVE = contextvars.ContextVar("bumblebee_emulate_cuda", default=False)
_REAL = contextvars.ContextVar("bumblebee_emulate_real_kernels", default=False)

# the ``train.emulate_cuda`` value that runs FLA's Triton kernels instead of their references
REAL_KERNELS = "real_kernels"


def active() -> bool:
    """True inside ``emulate_cuda()``."""
    return _ACTIVE.get()


def real_kernels() -> bool:
    """True inside ``emulate_cuda(real_kernels=True)``: FLA's kernels run, not their references."""
    return _ACTIVE.get() and _REAL.get()


def kind(x: torch.Tensor) -> str:
    """The device kind the kernel choice decides on: "cuda" for CUDA tensors and under emulation."""
    return "cuda" if x.is_cuda or active() else x.device.type


@contextlib.contextmanager
def emulate_cuda(check_comm: bool = True, real_kernels: bool = False):
    """Run the CUDA branches on CPU with reference kernels (``real_kernels``: FLA's Triton kernels
    through Triton's interpreter) and checked communication."""
    from bumblebee.primitives.comm_check import CheckedComm

    kernels = contextlib.nullcontext()
    if real_kernels:
        from bumblebee.primitives import triton_interpreter

        kernels = triton_interpreter.interpreted()
    token, real = _ACTIVE.set(True), _REAL.set(real_kernels)
    try:
        with CheckedComm() if check_comm else contextlib.nullcontext(), kernels:
            yield
    finally:
        _REAL.reset(real)
        _ACTIVE.reset(token)


def nccl_branch(group) -> bool:
    """Take the NCCL form of a collective (reduce-scatter, all-gather into one tensor) rather than
    the gloo workaround: on every backend but gloo, and on gloo under emulation (gloo runs
    those forms too, only with more memory)."""
    import torch.distributed as dist

    return active() or dist.get_backend(group) != "gloo"


def maybe(enabled: bool | str):
    """``emulate_cuda()`` when ``enabled`` (``train.emulate_cuda``: true, or ``REAL_KERNELS``) and
    not on already; otherwise nothing."""
    if not enabled or active():
        return contextlib.nullcontext()
    return emulate_cuda(real_kernels=enabled == REAL_KERNELS)


class _Event:
    def record(self, stream=None) -> None:
        pass


class _Stream:
    """A CUDA stream's calls as no-ops (CPU work is ordered already)."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


def side_stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else _Stream()


def current_stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else _Stream()


def use_stream(stream):
    return (
        torch.cuda.stream(stream)
        if isinstance(stream, torch.cuda.Stream)
        else contextlib.nullcontext()
    )


def new_event(device: torch.device):
    return torch.cuda.Event() if device.type == "cuda" else _Event()


def record_stream(t: torch.Tensor) -> None:
    """``t.record_stream(current stream)`` on CUDA (the caching allocator keeps ``t``'s memory
    until that stream's queued work ran); nothing to keep on CPU."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))

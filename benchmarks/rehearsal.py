"""Fake-tensor rehearsal: one token mixer's forward + backward at a real run's per-rank shapes,
through the kernels the CUDA dispatch would pick, on a machine without a GPU.

Under ``FakeTensorMode`` tensors carry shape, dtype and device but no data, so a layer at
2 x 16K tokens x 2048 hidden costs milliseconds. On a CPU-only torch build autograd on fake
``cuda`` tensors aborts (the device guard needs CUDA), so the rehearsal runs on fake ``meta``
tensors and is *told* which kernels CUDA would run (``primitives/dispatch.py`` with
device "cuda"): the attention core is ``varlen_attn`` (its flash ops have fake kernels) and
the Gated DeltaNet core FLA's chunk kernel through the ``bumblebee::fla_gdn`` custom op
(``register_fake`` / ``register_autograd``); the chunked PyTorch core can be rehearsed too.

Two figures per layer, in bytes:
- saved: what autograd keeps between forward and backward (storages packed by
  ``saved_tensors_hooks``, each counted once, parameters excluded);
- peak: the most bytes of live tensors allocated inside the rehearsal (input and
  parameters excluded) at any point of forward + backward (``perf.memory.MemoryTracker``
  sees the fake storages like real ones).
Kernel-internal workspaces are not seen (a fake kernel allocates only its outputs).

Legend: R rows (sequences or CP segments), T tokens per row, D hidden.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from bumblebee.perf.memory import MemoryTracker
from bumblebee.primitives.attention.flash import flash_varlen
from bumblebee.primitives.dispatch import select
from bumblebee.primitives.linear_attention.fla import fla_gated_delta_rule
from bumblebee.primitives.linear_attention.gated_delta_rule import gated_delta_rule_chunked
from bumblebee.primitives.linear_attention.gdn import GatedDeltaNet
from bumblebee.primitives.packed import DocLayout
from bumblebee.primitives.recompute import NoRecompute
from bumblebee.primitives.rope import rope_cos_sin


@dataclass(frozen=True)
class Rehearsal:
    mixer: str  # "gdn" | "attention"
    kernel: str  # the dispatch's kernel label
    rows: int
    tokens: int
    saved_bytes: int
    peak_bytes: int

    def line(self) -> str:
        gib = 2**30
        return (
            f"{self.mixer:<10} {self.kernel:<34} {self.rows} x {self.tokens:>6} tokens: saved "
            f"{self.saved_bytes / gib:6.2f} GiB ({self.saved_bytes / (self.rows * self.tokens):8.0f} B/token), "
            f"peak {self.peak_bytes / gib:6.2f} GiB"
        )


def _gdn_core(kernel_name: str):
    return {"fla_chunk": fla_gated_delta_rule, "torch_chunked": gated_delta_rule_chunked}[
        kernel_name
    ]


def _attention_core(kernel_name: str):
    if kernel_name == "varlen_attn":
        return flash_varlen
    from bumblebee.primitives.attention.sdpa import sdpa_varlen

    return sdpa_varlen


def _build(arch, mixer: str, core, dtype):
    """The layer with fake parameters made directly in ``dtype`` on meta (``Module.to`` cannot swap
    fake parameters), as FSDP's all-gathered compute copy would be."""
    from bumblebee.models.qwen3_5_moe.model import gated_attention

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            if mixer == "gdn":
                return GatedDeltaNet(
                    arch.hidden_size,
                    arch.linear_num_key_heads,
                    arch.linear_num_value_heads,
                    arch.linear_key_head_dim,
                    arch.linear_value_head_dim,
                    arch.linear_conv_kernel_dim,
                    arch.rms_norm_eps,
                    core,
                    NoRecompute(),
                )
            return gated_attention(arch, core, NoRecompute())
    finally:
        torch.set_default_dtype(previous)


def rehearse(
    arch,
    mixer: str,
    *,
    rows: int,
    tokens: int,
    dtype=torch.bfloat16,
    fla: bool = True,
    kernel: str | None = None,
    counter=None,
) -> Rehearsal:
    """Forward + backward of one ``mixer`` layer of ``arch`` (a Qwen3.5 arch) on fake tensors.
    ``kernel``: force a kernel name; default: what the dispatch picks on CUDA for ``dtype``.
    ``counter``: a ``perf.syncs.SyncCounter`` entered around forward + backward (inside the fake
    mode, which answers ops without passing them on)."""
    slot, impl = ("linear_attention", "chunked") if mixer == "gdn" else ("attention", "varlen")
    chosen = select(slot, impl, "cuda", dtype, fla=fla)
    name = kernel or chosen.name
    core = _gdn_core(name) if mixer == "gdn" else _attention_core(name)
    layout = DocLayout(bounds=((0, tokens),) * rows, seq_len=tokens)
    saved: dict[int, int] = {}
    with FakeTensorMode():
        layer = _build(arch, mixer, core, dtype)
        params = {p.untyped_storage()._cdata for p in layer.parameters()}
        x = torch.empty(
            rows, tokens, arch.hidden_size, device="meta", dtype=dtype, requires_grad=True
        )
        if mixer == "attention":
            pos = torch.arange(tokens, device="meta").expand(rows, tokens)
            rot = int(arch.head_dim * arch.partial_rotary_factor)
            cos, sin = rope_cos_sin(pos, rot, arch.rope_theta, dtype)

        def pack(t):
            st = t.untyped_storage()
            if st._cdata not in params:
                saved[st._cdata] = st.nbytes()
            return t

        with MemoryTracker("meta") as mem, counter or contextlib.nullcontext():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(x, layout)[0] if mixer == "gdn" else layer(x, cos, sin, layout)
            y.backward(torch.empty_like(y))
    label = chosen.label if kernel is None else name
    return Rehearsal(mixer, label, rows, tokens, sum(saved.values()), mem.peak_bytes)

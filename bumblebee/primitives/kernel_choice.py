"""Kernel choice: which kernel an implementation runs, from (device, dtype, package present).

A slot implementation chosen in config (``attention = "varlen"``) names an algorithm; the
kernel that executes it depends on where it runs. Each implementation declares that choice
beside its factory (``register(kernel=, kernel_axes=)``: a function of a ``KernelQuery``); this
module only asks it, and holds the two choices beside the slots (the GDN conv, the glue). The
table they make says which, so the same
answer is printed at the start of a run, listed by ``bumblebee primitives``, used by the
implementations at call time (``select`` on the tensors' device and dtype) and read by the
planner (``plan_kernels``), whose efficiencies and activation memory follow it.

| slot / impl | CUDA, bf16/fp16 | CUDA, fp32 | CPU |
| --- | --- | --- | --- |
| attention / varlen | ``varlen_attn`` (flash: FA3 when present, else FA2) | SDPA per document | SDPA per document |
| cp_attention / ring | ring of ``varlen_attn`` steps (same flash) | fp32 tiles | fp32 tiles |
| linear_attention / chunked | FLA ``chunk_gated_delta_rule`` or ``chunk_kda`` (fla), else chunked | same | chunked |
| conv / causal (GDN conv) | FLA ``causal_conv1d`` (``fla`` imports), else channel blocks | same | blocks |
| glue / fused (norms, SwiGLU, RoPE) | ``torch.compile`` per function | same | eager ops |
| loss / linear_ce (LM head + CE tiles) | ``torch.compile`` per 4096 x 16384 tile | same | eager tiles |

``chunk_kda`` serves the per-channel gates of Kimi Delta Attention (g [B, T, H, K],
``linear_attention/fla_kda.py``); the scalar-gate rule takes ``chunk_gated_delta_rule``.

Attention options (``attention/options.py``): a sliding window runs in ``varlen_attn`` (its
``window_size``), SDPA per document (a band mask) and the ring's fp32 tiles (masked; the blocks
and steps it excludes skipped, their exchanges too); the ring of flash steps takes no window, so
with one the ring runs its tiles.
Per-head sinks: no kernel PyTorch ships takes them, but a sink only rescales each row of plain
attention through its LSE (``attention/flash_sinks.py``): ``attention / varlen`` on CUDA in half
precision runs ``torch.ops.torch_attn._varlen_attn`` with the LSE, merges the sinks, and calls
the flash backward op itself with the merged (output, LSE) (``varlen_attn``'s public wrapper
drops the LSE gradient); elsewhere each document's scores are written out in fp32. The flash
ring takes no sinks: ``cp_attention / ring`` with sinks runs its fp32 tiles on CUDA too and merges the
sinks into the final LSE.

FA3: torch's flash ops (``varlen_attn``, the ring's ``_varlen_attn``) run FlashAttention 3 once
``torch.nn.attention.activate_flash_attention_impl("FA3")`` is called, which needs PyTorch's
flash-impl registry (2.13), the flash-attn 3 package (``flash_attn_interface``) and a Hopper GPU
(compute capability 9.0); ``use_flash_impl`` does it once, at the first flash call.

References (``sdpa``, ``allgather``, ``recurrent``) and every other implementation run their
own PyTorch code everywhere. Under the emulated-CUDA mode (``emulation.py``, ``train.emulate_cuda``)
the implementations pass ``emulation.kind(tensor)`` ("cuda" for CPU tensors too) and the table
answers its CUDA, bf16, fla-present column for any dtype. The flash kernels take only half
precision (flash-attention's constraint); FLA's Triton kernels need a GPU (``pip install -e
".[gpu]"`` adds ``fla-core``), or Triton's interpreter on CPU under the real-kernel emulation
(``train.emulate_cuda = "real_kernels"``, ``triton_interpreter.py``).

Inside ``assume("cuda", fla=True)`` (the planner's dry run on fake CPU tensors) the table answers
for that device whatever the tensors' device and nothing else changes: the chosen kernels run as
they are (on fake tensors, their fake kernels); the conv and the glue stay unfused there, as the
planner's activation-memory model has them (the fused paths keep less: it is conservative).
The emulation also swaps kernels for references.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
from dataclasses import dataclass

import torch

from bumblebee import registry
from bumblebee.primitives import emulation
from bumblebee.primitives.external_calls import ACTIVATE_FLASH_IMPL, LIST_FLASH_IMPLS

HALF = (torch.bfloat16, torch.float16)

# (device, fla) the kernel choice answers for inside ``assume``; None: the caller's device
_ASSUMED = contextvars.ContextVar("bumblebee_assumed_device", default=None)


@contextlib.contextmanager
def assume(device: str, *, fla: bool | None = None):
    """Select kernels as if the tensors lived on ``device`` (with ``fla`` present or not; None: the
    package check): ``select``, ``grouped_mm_supported`` and the linear CE's default tiles."""
    token = _ASSUMED.set((device, fla))
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def assumed_device() -> str | None:
    """The device ``assume`` names, or None outside it."""
    a = _ASSUMED.get()
    return None if a is None else a[0]


@dataclass(frozen=True)
class Kernel:
    name: str  # short id, e.g. "varlen_attn"
    label: str  # what a run prints, e.g. "varlen_attn (flash)"
    fused: bool  # a fused GPU kernel (planner: FlashAttention / FLA-class efficiency and memory)
    note: str = ""  # why this kernel and not the fused one, when it matters


@functools.cache
def package_present(name: str) -> bool:
    """True when ``name`` can be imported (``fla`` also needs ``triton``)."""
    if importlib.util.find_spec(name) is None:
        return False
    if name == "fla":
        return importlib.util.find_spec("triton") is not None
    return True


@functools.cache
def fa3_present() -> bool:
    """FA3 can serve torch's flash ops here: the registry lists it, its package imports, the GPU
    is Hopper (FA3's kernels are sm90 only)."""
    try:
        impls = LIST_FLASH_IMPLS.call(LIST_FLASH_IMPLS.load())
    except (ImportError, AttributeError):
        return False
    if "FA3" not in impls or not package_present("flash_attn_interface"):
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def flash_impl(fa3: bool | None = None) -> str:
    """ "FA3" or "FA2": what torch's flash ops run (``fa3`` overrides the check, as ``fla`` does)."""
    return "FA3" if (fa3_present() if fa3 is None else fa3) else "FA2"


@functools.cache
def use_flash_impl() -> str:
    """Activate FA3 in torch's dispatcher when present (once per process); the impl in use."""
    impl = flash_impl()
    if impl == "FA3":
        ACTIVATE_FLASH_IMPL.call(ACTIVATE_FLASH_IMPL.load(), "FA3")
    return impl


_UNFUSED = contextvars.ContextVar("bumblebee_unfused", default=False)


@contextlib.contextmanager
def unfused():
    """Inside: the glue runs eagerly, the GDN conv in channel blocks and the linear CE in eager
    tiles on CUDA too (the paths before they were fused): for before/after counts
    (``benchmarks/launches.py``). Users switch it with ``primitives.fused = "off"`` (``configured``)."""
    token = _UNFUSED.set(True)
    try:
        yield
    finally:
        _UNFUSED.reset(token)


def configured(prims):
    """The dispatch a run's ``primitives.fused`` asks for, entered by the runtime around building
    and running the model: "off" is ``unfused()`` (rules the fused paths out when a GPU run
    misbehaves), "auto" changes nothing."""
    return unfused() if getattr(prims, "fused", "auto") == "off" else contextlib.nullcontext()


def _dtype(dtype) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


@dataclass(frozen=True)
class KernelQuery:
    """Where an implementation runs, as its declared kernel function (``register(kernel=)``)
    reads it: a CUDA device, half precision, FLA present, the attention options, the fused
    paths switched off (``unfused``; the planner's dry run too)."""

    cuda: bool
    half: bool
    fla: bool
    sinks: bool = False
    window: bool = False
    unfused: bool = False
    fa3: bool | None = None  # overrides the FA3 check (the planner asks "what if")

    def flash(self) -> str:
        """ "FA3" or "FA2": what torch's flash ops run here."""
        return flash_impl(self.fa3)


def select(
    slot: str,
    impl: str,
    device: str,
    dtype,
    *,
    fla: bool | None = None,
    fa3: bool | None = None,
    sinks: bool = False,
    window: bool = False,
) -> Kernel:
    """The kernel ``slot``/``impl`` runs on ``device`` ("cuda", "cpu", ...) for ``dtype``: what
    the implementation declares (``register(kernel=)``), else its own PyTorch code.
    ``fla`` / ``fa3`` override the package checks (the planner asks "what if it were installed");
    ``sinks``: the attention has per-head sink logits (merged through the LSE on CUDA);
    ``window``: a sliding window (the flash ring takes none)."""
    if (a := _ASSUMED.get()) is not None:
        device, fla = a[0], fla if a[1] is None else a[1]
    dtype, cuda = _dtype(dtype), device == "cuda"
    fla = package_present("fla") if fla is None else fla
    if cuda and emulation.active():  # every CUDA branch, its kernels replaced by their references
        dtype, fla = torch.bfloat16, True
    # the planner's dry run (``assume``) keeps the unfused glue: its activation-memory model does
    unfused = _UNFUSED.get() or _ASSUMED.get() is not None
    query = KernelQuery(cuda, dtype in HALF, fla, sinks, window, unfused, fa3)
    declared = EXTRA_KERNEL_FNS.get((slot, impl)) or _declared(slot, impl)
    if declared is not None:
        return declared(query)
    return Kernel(impl, f"{impl} (PyTorch)", False)


def _declared(slot: str, impl: str):
    if slot not in registry.SLOTS:
        return None
    found = registry.implementations(slot).get(impl)
    return None if found is None else found.kernel


def conv_kernel(q: KernelQuery) -> Kernel:
    """Gated DeltaNet's short conv (linear_attention/conv.py)."""
    if q.cuda and q.fla and not q.unfused:
        return Kernel("fla_causal_conv1d", "fla causal_conv1d (fused, varlen)", True)
    why = "fused paths off" if q.fla else "fla not installed (pip install -e '.[gpu]')"
    return Kernel(
        "conv_blocks", "fp32 channel blocks x taps (PyTorch)", False, why if q.cuda else ""
    )


def glue_kernel(q: KernelQuery) -> Kernel:
    """Norms, gated norm, SwiGLU product, RoPE (fused.py)."""
    if q.cuda and not q.unfused:
        return Kernel("compiled", "torch.compile per function (inductor)", True)
    return Kernel("eager", "eager PyTorch ops", False)


# kernels chosen beside the registry's slots: (pseudo-slot, name) -> kernel function
EXTRA_KERNEL_FNS = {("conv", "causal"): conv_kernel, ("glue", "fused"): glue_kernel}


KERNEL_SLOTS = ("attention", "cp_attention", "linear_attention")


def kernel_table(
    prims,
    device: str,
    dtype,
    *,
    cp: int = 1,
    fla: bool | None = None,
    fa3: bool | None = None,
    sinks: bool = False,
    window: bool = False,
) -> dict[str, Kernel]:
    """slot -> Kernel for the configured implementations (``prims``: a PrimitivesConfig).
    ``cp`` omitted or 1: no CP slot (full attention runs the ``attention`` slot); ``sinks`` /
    ``window``: the model's attention has sink logits / sliding-window layers."""
    out = {
        "attention": select(
            "attention", prims.attention, device, dtype, fla=fla, fa3=fa3, sinks=sinks
        )
    }
    if cp > 1:
        out["cp_attention"] = select(
            "cp_attention",
            prims.cp_attention,
            device,
            dtype,
            fla=fla,
            fa3=fa3,
            sinks=sinks,
            window=window,
        )
    out["linear_attention"] = select(
        "linear_attention", prims.linear_attention, device, dtype, fla=fla
    )
    out["conv"] = select("conv", "causal", device, dtype, fla=fla)  # GDN layers only
    out["glue"] = select("glue", "fused", device, dtype)
    if _declared("loss", prims.loss) is not None:  # a loss that chooses a kernel of its own
        out["loss"] = select("loss", prims.loss, device, dtype)
    return out


def describe(table: dict[str, Kernel]) -> str:
    """One line: ``attention: varlen_attn (flash); linear_attention: fla chunk_gated_delta_rule``."""
    parts = []
    for slot, k in table.items():
        parts.append(f"{slot}: {k.label}" + (f" [{k.note}]" if k.note else ""))
    return "; ".join(parts)


def rows(slot: str, impl: str) -> list[tuple[str, str, str]]:
    """(device, dtype, kernel label) rows for ``bumblebee primitives``; none when the
    implementation declares no kernel (it runs its own PyTorch code everywhere). The rows split
    by what the implementation declares its kernel depends on (``kernel_axes``: "fla", "fa3",
    "sinks")."""
    if (slot, impl) in EXTRA_KERNEL_FNS:
        axes = EXTRA_KERNEL_AXES[(slot, impl)]
    elif _declared(slot, impl) is not None:
        axes = registry.implementations(slot)[impl].kernel_axes
    else:
        return []
    out = []
    for device, dtype in (("cuda", "bfloat16"), ("cuda", "float32"), ("cpu", "any")):
        dt = torch.float32 if dtype == "any" else dtype
        if "fla" in axes and device == "cuda":
            for present in (True, False):
                k = select(slot, impl, device, dt, fla=present)
                out.append((device, f"{dtype}, fla {'present' if present else 'absent'}", k.label))
        elif "fa3" in axes and (device, dtype) == ("cuda", "bfloat16"):
            for present in (True, False):
                k = select(slot, impl, device, dt, fa3=present)
                out.append((device, f"{dtype}, FA3 {'present' if present else 'absent'}", k.label))
        else:
            out.append((device, dtype, select(slot, impl, device, dt).label))
    if "sinks" in axes:  # the attention options (sinks; the ring: also a window)
        for device, dtype in (("cuda", "bfloat16"), ("cpu", "any")):
            dt = torch.float32 if dtype == "any" else dtype
            k = select(slot, impl, device, dt, sinks=True)
            out.append((device, f"{dtype}, sinks", k.label))
    return out


EXTRA_KERNEL_AXES = {("conv", "causal"): ("fla",), ("glue", "fused"): ()}

# kernels chosen beside the registry's slots, listed by ``bumblebee primitives``
EXTRA_KERNELS = {
    ("conv", "causal"): "Gated DeltaNet's short causal conv (linear_attention/conv.py)",
    ("glue", "fused"): "RMSNorm, gated RMSNorm, SwiGLU product, RoPE (fused.py)",
}

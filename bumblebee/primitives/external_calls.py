"""The functions of optional packages (fla-core) and of torch's newer or private APIs that
bumblebee's CUDA path calls, each declared once with the arguments bumblebee passes.

These calls run only on a GPU (or on CPU through a stand-in of the same contract), so a function
that moved or lost a keyword in another release would first fail there. Declared here, each call
is checked on CPU by ``tests/unit/test_external_calls.py`` against the installed package's
signature (``inspect.signature``) or operator schema (``torch.ops``): the positional arguments by
name and order, every keyword a named parameter of the callee (not swallowed by ``**kwargs``).
The call sites load the callee through its declaration and call it through ``ExternalCall.call``,
which checks the arguments against the declaration on every call, stand-ins included: the
emulated-CUDA tests thereby keep the declaration what the code passes.

``optional`` keywords are passed only where the installed callee takes them (``take``): torch
2.11's ``varlen_attn`` has no ``enable_gqa`` (its flash kernel takes grouped K/V as they are),
torch 2.13's checks the head counts against it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ExternalCall:
    module: str  # imported for the callee; "torch.ops.<namespace>" for an operator
    name: str
    positional: tuple[str, ...]  # what bumblebee passes by position, by the callee's names
    keywords: tuple[str, ...] = ()  # passed by keyword on every call
    optional: tuple[str, ...] = ()  # passed by keyword where the callee takes them
    package: str = "torch"  # the distribution that provides it (what a missing import means)
    registers: str | None = None  # for an operator: the module whose import defines it

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def is_op(self) -> bool:
        return self.module.startswith("torch.ops.")

    def load(self) -> Any:
        """The callee (an ``OpOverloadPacket`` for an operator); ``TypeError`` when what is there
        is not callable (a subpackage of that name, say). Looked up in its module on every call
        (an attribute read once the module is imported), as an import at the call site would be:
        what the module holds now runs (a test's spy patched in after an earlier call, say)."""
        return _load(self)

    def parameters(self) -> dict[str, bool]:
        """The callee's named parameters in order -> whether each has a default (an operator's
        from its schema)."""
        return _parameters(self)

    def take(self, **kwargs) -> dict[str, Any]:
        """Of ``kwargs`` (declared ``optional``), those the installed callee takes."""
        unknown = set(kwargs) - set(self.optional)
        if unknown:
            raise TypeError(f"{self.qualname}: {sorted(unknown)} are not declared optional")
        return {k: v for k, v in kwargs.items() if k in self.parameters()}

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` (``fn``: the callee or a stand-in of its contract) after checking
        that these are the declared arguments."""
        keys = set(kwargs)
        if (
            len(args) != len(self.positional)
            or not set(self.keywords) <= keys
            or not keys <= set(self.keywords) | set(self.optional)
        ):
            raise TypeError(
                f"{self.qualname} called with {len(args)} positional arguments and keywords "
                f"{sorted(keys)}; declared in external_calls.py: {list(self.positional)}, "
                f"keywords {list(self.keywords)}, optional {list(self.optional)}"
            )
        return fn(*args, **kwargs)


def _load(call: ExternalCall) -> Any:
    if call.is_op:
        import torch

        if call.registers:
            importlib.import_module(call.registers)
        fn = getattr(getattr(torch.ops, call.module.split(".")[2]), call.name)
    else:
        fn = getattr(importlib.import_module(call.module), call.name)
    if not callable(fn):
        raise TypeError(
            f"{call.qualname} is a {type(fn).__name__}, not a function ({call.package})"
        )
    return fn


@functools.cache
def _parameters(call: ExternalCall) -> dict[str, bool]:
    fn = call.load()
    if call.is_op:
        return {a.name: a.has_default_value() for a in fn.default._schema.arguments}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {
        p.name: p.default is not inspect.Parameter.empty
        for p in inspect.signature(fn).parameters.values()
        if p.kind in named
    }


# fla-core (``pip install -e ".[gpu]"``): linear attention's kernels
CHUNK_GATED_DELTA_RULE = ExternalCall(
    "fla.ops.gated_delta_rule",
    "chunk_gated_delta_rule",
    ("q", "k", "v", "g", "beta"),
    ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens",
     "chunk_indices"),
    package="fla-core",
)  # fmt: skip
CHUNK_KDA = ExternalCall(
    "fla.ops.kda",
    "chunk_kda",
    ("q", "k", "v", "g", "beta"),
    ("scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel", "cu_seqlens",
     "cu_seqlens_cpu"),
    package="fla-core",
)  # fmt: skip
# (``from fla.modules import causal_conv1d`` is the subpackage in fla-core 0.6)
CAUSAL_CONV1D = ExternalCall(
    "fla.modules.causal_conv1d",
    "causal_conv1d",
    ("x", "weight"),
    ("bias", "initial_state", "output_final_state", "activation", "cu_seqlens", "cu_seqlens_cpu",
     "chunk_indices"),
    package="fla-core",
)  # fmt: skip

# torch's flash attention over packed sequences (torch >= 2.10)
VARLEN_ATTN = ExternalCall(
    "torch.nn.attention.varlen",
    "varlen_attn",
    ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"),
    ("scale", "window_size"),
    ("enable_gqa",),
)
# the operators behind it (its wrapper drops the LSE gradient: the ring and the sinks call these)
VARLEN_ATTN_OP = ExternalCall(
    "torch.ops.torch_attn",
    "_varlen_attn",
    ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "scale",
     "window_size"),
    optional=("enable_gqa",),
    registers="torch.nn.attention.varlen",
)  # fmt: skip
VARLEN_ATTN_BACKWARD_OP = ExternalCall(
    "torch.ops.torch_attn",
    "_varlen_attn_backward",
    ("grad_out", "query", "key", "value", "out", "lse", "cu_seq_q", "cu_seq_k", "max_q", "max_k",
     "is_causal", "rng_state", "scale", "window_size"),
    registers="torch.nn.attention.varlen",
)  # fmt: skip
# FA3 behind torch's flash ops, where its package is installed
LIST_FLASH_IMPLS = ExternalCall("torch.nn.attention", "list_flash_attention_impls", ())
ACTIVATE_FLASH_IMPL = ExternalCall("torch.nn.attention", "activate_flash_attention_impl", ("impl",))

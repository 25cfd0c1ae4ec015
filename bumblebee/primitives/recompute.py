"""Activation recomputation policies (slot ``recompute``).

A policy is asked at two granularities by the model:

- ``layer(fn, *args)`` wraps a whole decoder layer;
- ``module(name, fn, *args)`` wraps a named sub-computation inside a layer
  (``norm``, ``attn_core``, ``moe``, ``mlp``, ... see ``MODULE_NAMES``).

``none`` (reference) stores every activation. ``full`` stores only each layer's
input and recomputes the layer in backward (``torch.utils.checkpoint``,
non-reentrant): about one extra forward (~30% more compute, as commonly measured for full recompute) for
activation memory independent of depth. ``selective`` checkpoints only the
named sub-computations (``recompute_modules``): each stores its inputs and
recomputes its internals in backward, so the cheap-to-recompute,
memory-hungry pieces (norm outputs, the attention core, the whole MoE block)
are traded for compute while the rest of the layer keeps its activations.
Gradients of every policy equal ``none`` exactly: the recomputed forward runs
the same ops on the same inputs (RNG state is restored by ``checkpoint``).

``in_recompute()`` tells a primitive that it is running inside such a recompute
forward (set through ``checkpoint``'s ``context_fn``, per thread, only for the
duration of the re-run). That run exists only to re-create the tensors autograd
saved; its return value is discarded. A primitive may therefore skip work whose
result feeds nothing but its own return value, provided the model does not feed
that value into an op inside the checkpointed region that saves it for backward
(in both model families the MoE output only enters additions). ``moe_comm =
chunked`` uses this to skip its second expert GEMM and its combine all-to-all.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable

import torch
from torch.utils.checkpoint import checkpoint

from bumblebee.primitives import replay_check
from bumblebee.primitives.moe import replay as routing_replay
from bumblebee.primitives.offload import LayerInputStore
from bumblebee.primitives.recompute_scope import _RECOMPUTING, HostReads, host_reads
from bumblebee.registry import register

# Sub-computations a model exposes to ``module``; selective recompute may name these.
# Every family calls norm / attn_core / moe / mlp; a hybrid adds linear_attn_core, a shared expert
# adds shared_expert; moe_act is for an experts primitive that recomputes its activation.
MODULE_NAMES = ("norm", "attn_core", "moe", "moe_act", "mlp", "shared_expert", "linear_attn_core")

# Dynamic scope too: True inside ``eager()`` (``lean`` runs its function without a checkpoint).
_EAGER = contextvars.ContextVar("bumblebee_eager", default=False)
# A context-manager factory entered around every policy checkpoint's recompute forward, or None
_OBSERVER = contextvars.ContextVar("bumblebee_recompute_observer", default=None)


@contextlib.contextmanager
def observe(scope: Callable[[], contextlib.AbstractContextManager]):
    """Inside, each recompute forward of a policy's checkpoint runs within ``scope()`` (the
    planner's dry run labels what it allocates); ``lean``'s checkpoints are not observed."""
    token = _OBSERVER.set(scope)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


@contextlib.contextmanager
def _recomputing(routing_scope, reads: HostReads):
    observer = _OBSERVER.get()
    with observer() if observer is not None else contextlib.nullcontext():
        token = _RECOMPUTING.set(True)
        try:
            with routing_replay.entered(routing_scope), host_reads("replay", reads):
                yield
        finally:
            _RECOMPUTING.reset(token)


@contextlib.contextmanager
def eager():
    """Inside: ``lean`` keeps intermediates (runs its function directly). For a backward that
    recomputes a piece and differentiates it at once (``linear_attention/cp_relay.py``), where a
    checkpoint would only add a third forward."""
    token = _EAGER.set(True)
    try:
        yield
    finally:
        _EAGER.reset(token)


def _checkpoint(fn: Callable, *args):
    """Non-reentrant ``checkpoint`` whose recompute forward sees ``in_recompute() == True`` and the
    routing scope the original forward ran under (primitives/moe/replay.py: it routes alike)."""
    scope = routing_replay.current()

    def contexts():  # one HostReads per checkpointed call, filled by its forward
        reads = HostReads(replay_check.current())
        return host_reads("record", reads), _recomputing(scope, reads)

    return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)


def lean(fn: Callable, *args):
    """``fn(*args)`` with autograd keeping only its inputs (a non-reentrant checkpoint): for
    pieces whose fp32 intermediates dominate saved memory but are cheap to recompute (the
    Gated DeltaNet conv, gated norm and chunked core). Same ops, same values; backward
    reruns ``fn``. Independent of the ``recompute`` policy (nested inside it when both apply).
    Inside ``eager()`` it runs ``fn`` directly."""
    if (
        not _EAGER.get()
        and torch.is_grad_enabled()
        and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    ):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


def check_module_names(modules: Iterable[str]) -> tuple[str, ...]:
    """The validated ``recompute_modules``. Errors are ``ConfigError`` (a ``ValueError``,
    printed as one line by the CLI) naming the valid modules."""
    from bumblebee.config import ConfigError  # lazily, as registry.get does

    if isinstance(modules, str):
        raise ConfigError(f"recompute_modules must be a list of names, got the string {modules!r}")
    names = tuple(modules)
    unknown = [n for n in names if n not in MODULE_NAMES]
    if unknown:
        raise ConfigError(f"unknown recompute_modules {unknown}; valid: {', '.join(MODULE_NAMES)}")
    return names


@register("recompute", "none", reference=True, summary="keep all activations")
class NoRecompute:
    def __init__(self, modules=()):
        # none/full need no module list; the names are still checked so that a typo
        # is caught even before switching to selective.
        self.modules = check_module_names(modules)

    def layer(self, fn: Callable, *args):
        return fn(*args)

    def module(self, name: str, fn: Callable, *args):
        return fn(*args)

    def decoder_layer(self, fn: Callable, x: torch.Tensor, *args):
        """A decoder layer of the main stack (``x``: its input hidden state, read by nothing
        after the layer but the layer's own backward). Policies that move that input elsewhere
        between forward and backward override this; ``layer`` is for everything else."""
        return self.layer(fn, x, *args)


@register("recompute", "full", summary="checkpoint every decoder layer; recompute it in backward")
class FullRecompute(NoRecompute):
    def layer(self, fn: Callable, *args):
        return _checkpoint(fn, *args)


@register(
    "recompute", "selective", summary="checkpoint the named sub-modules (recompute_modules) only"
)
class SelectiveRecompute(NoRecompute):
    def __init__(self, modules=()):
        super().__init__(modules)
        if not self.modules:
            from bumblebee.config import ConfigError

            raise ConfigError(
                "recompute = 'selective' needs recompute_modules, e.g. ['norm', 'attn_core']; "
                f"valid: {', '.join(MODULE_NAMES)}"
            )
        self.selected = frozenset(self.modules)

    def module(self, name: str, fn: Callable, *args):
        assert name in MODULE_NAMES, f"model asked for unknown recompute module {name!r}"
        if name in self.selected:
            return _checkpoint(fn, *args)
        return fn(*args)


@register(
    "recompute",
    "offload",
    summary="full recompute; each layer's input waits in host memory until its backward",
)
class OffloadRecompute(FullRecompute):
    """``full``, plus each decoder layer's input moved to host memory right after the layer's
    forward and brought back, one layer ahead, for its recompute (primitives/offload.py)."""

    def __init__(self, modules=()):
        super().__init__(modules)
        self.store = LayerInputStore()

    def decoder_layer(self, fn: Callable, x: torch.Tensor, *args):
        if _EAGER.get() or not (torch.is_grad_enabled() and x.requires_grad):
            return self.layer(fn, x, *args)
        entry = []

        def run(x, *args):
            if entry:  # the recompute: the input's storage is released until restored
                self.store.restore(entry[0])
            return fn(x, *args)

        out = _checkpoint(run, x, *args)
        entry.append(self.store.offload(x))
        return out

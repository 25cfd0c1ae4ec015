"""Activation recomputation policies (slot ``recompute``).

A policy is asked at two granularities by the model:

- ``layer(fn, *args)`` wraps a whole decoder layer;
- ``module(name, fn, *args)`` wraps a named sub-computation inside a layer
  (``norm``, ``attn_core``, ``moe``, ``mlp``, ... see ``MODULE_NAMES``).

``none`` (reference) stores every activation. ``full`` stores only each layer's
input and recomputes the layer in backward (``torch.utils.checkpoint``,
non-reentrant): about one extra forward (~30% more compute, REFERENCE.md) for
activation memory independent of depth. Gradients equal ``none`` exactly: the
recomputed forward runs the same ops on the same inputs.
"""

from __future__ import annotations

from typing import Callable

from torch.utils.checkpoint import checkpoint

from bumblebee.registry import register

# Sub-computations a model exposes to ``module``; selective recompute may name these.
MODULE_NAMES = ("norm", "attn_core", "moe", "moe_act", "mlp", "shared_expert", "linear_attn_core")


@register("recompute", "none", reference=True, summary="keep all activations")
class NoRecompute:
    def __init__(self, modules=()):
        pass

    def layer(self, fn: Callable, *args):
        return fn(*args)

    def module(self, name: str, fn: Callable, *args):
        return fn(*args)


@register("recompute", "full", summary="checkpoint every decoder layer; recompute it in backward")
class FullRecompute(NoRecompute):
    def layer(self, fn: Callable, *args):
        return checkpoint(fn, *args, use_reentrant=False)

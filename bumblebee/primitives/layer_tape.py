"""Backward one decoder layer at a time: the forward cut at every layer boundary, replayed in reverse.

Autograd runs a CUDA backward on its own device thread, so a hand-over *inside* a backward
(``overlap_mb.switch``) cannot happen there: one micro-batch's ``backward()`` would run to its end
before its partner could issue anything. Inside ``recording(tape)`` the model's layer loop calls
``cut`` at every boundary: the embedding output and each layer's output become leaves of what
follows, and each MoE layer's router stats a leaf of the balance loss. ``tape.backward(loss,
part)`` runs the loss's backward (head and balance loss: it stops at the leaves), then each
layer's backward from the gradients its leaves received, last layer first, each inside
``part(key)`` so that the caller can hand the rank over between them and order its streams.

The gradients are those of one ``backward()``: every node receives the same incoming gradients and
runs in the same order within a layer (the engine orders ready nodes by creation), so the sums
are the same sums. Keys: ``("layer", i)`` for the i-th cut layer's part; ``"ends"`` for the
loss's part and the embedding's, which may share parameters (tied or MTP embeddings).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import torch

# Dynamic scope, not configuration: the tape the current forward records into.
_TAPE = contextvars.ContextVar("bumblebee_layer_tape", default=None)


class LayerTape:
    """The cut points of one micro-batch's forward: (graph outputs, leaves standing for them)."""

    def __init__(self):
        self.cuts: list[tuple[tuple, tuple]] = []

    def cut(self, *tensors):
        """Each tensor (or None) detached into a leaf that requires grad; the originals kept."""
        leaves = tuple(
            None if t is None else t.detach().requires_grad_(t.requires_grad) for t in tensors
        )
        self.cuts.append((tensors, leaves))
        return leaves

    def backward(self, loss: torch.Tensor, part: Callable = lambda key: contextlib.nullcontext()):
        """The loss's backward, then every cut part's, last first; each inside ``part(key)``."""
        with part("ends"):
            loss.backward()
        cuts, self.cuts = self.cuts, []
        for i in range(len(cuts) - 1, -1, -1):
            outs, leaves = cuts.pop()
            roots = [
                (o, leaf.grad)
                for o, leaf in zip(outs, leaves)
                if leaf is not None and leaf.grad is not None
            ]
            if not roots:
                continue
            with part("ends" if i == 0 else ("layer", i)):
                torch.autograd.backward(*zip(*roots))


@contextlib.contextmanager
def recording(tape: LayerTape | None):
    """Record the forward's cuts into ``tape`` (None: no cuts, as outside the context)."""
    token = _TAPE.set(tape)
    try:
        yield tape
    finally:
        _TAPE.reset(token)


def cut(*tensors):
    """At a layer boundary of the forward: the tensors themselves, or under ``recording`` and
    with grad enabled, leaves standing for them (``LayerTape.cut``)."""
    tape = _TAPE.get()
    if tape is None or not torch.is_grad_enabled():
        return tensors
    return tape.cut(*tensors)

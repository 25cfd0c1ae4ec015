"""The check behind a recompute's replayed host reads (``recompute_scope.host_read``).

A checkpoint's recompute takes its forward's MoE split sizes instead of reading them again, on
the premise that it routes exactly as the forward did. When it does not (a computation between
the layer's input and its router that differs between the two runs), the replayed sizes no
longer describe the rows: a shape error at best, on a GPU wrong rows or a hang in NCCL. Each
replayed read therefore compares, on the device, the counts the recompute computed with the
ones the forward read, and keeps the result as a flag tensor: no host read. The runtime reads
the flags in the step's existing read of the loss and gradient norm (``runtime/nonfinite.py``)
and ``verify`` raises ``ReplayMismatchError`` naming the layers, before the update.

Dynamic scope, as the rest of the recompute's: the runtime enters one ``ReplayCheck`` around a
step's forwards (``checking``); a policy's checkpoint takes the one current at its forward (the
recompute runs in backward, on autograd's thread on CUDA). A MoE block names itself for the
comparisons its dispatch makes (``labelled``).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

# Dynamic scope, not configuration: the step's check and the MoE block being run.
_CHECK = contextvars.ContextVar("bumblebee_replay_check", default=None)
_LABEL = contextvars.ContextVar("bumblebee_replay_label", default="a MoE layer")


class ReplayMismatchError(RuntimeError):
    """A recompute routed differently from its forward. One line, naming the layers."""


class ReplayCheck:
    """The flags of one step's replayed host reads: per comparison, the block's label and a 0-d
    bool tensor on the device (True: the recompute's counts differ from the forward's)."""

    def __init__(self):
        self.labels: list[str] = []
        self.flags: list[torch.Tensor] = []
        self.streams: list = []  # the CUDA stream each flag was computed on (None off CUDA)

    def compare(self, recomputed: torch.Tensor, recorded: torch.Tensor) -> None:
        """Queue ``recomputed != recorded`` (the same read, recompute and forward) on the device."""
        label = _LABEL.get()
        if recomputed.shape != recorded.shape:  # host-known: no device work needed to tell
            raise ReplayMismatchError(
                f"the recompute of {label} read {list(recomputed.shape)} counts where its forward "
                f"read {list(recorded.shape)}"
            )
        self.labels.append(label)
        self.flags.append(torch.ne(recomputed, recorded).any())
        cuda = recomputed.is_cuda
        self.streams.append(torch.cuda.current_stream(recomputed.device) if cuda else None)

    def pending(self) -> torch.Tensor | None:
        """The flags as one device tensor (None: nothing compared), ordered after the streams that
        computed them (a device-side wait, not a host one)."""
        if not self.flags:
            return None
        streams = {s for s in self.streams if s is not None}
        if streams:
            here = torch.cuda.current_stream(self.flags[0].device)
            for s in streams - {here}:
                here.wait_stream(s)
            for f in self.flags:  # read on this stream: keep their memory until it has run
                f.record_stream(here)
        return torch.stack(self.flags)

    def verify(self, values) -> None:
        """Raise for the flags ``values`` (host booleans, in ``pending``'s order) that are set;
        start over either way."""
        bad = list(dict.fromkeys(label for label, v in zip(self.labels, values) if v))
        self.labels, self.flags, self.streams = [], [], []
        if bad:
            raise ReplayMismatchError(
                f"the recompute of {', '.join(bad)} routed differently from its forward: the "
                "replayed MoE split sizes do not match the recomputed routing (a computation "
                "before the router differs between the forward and the recompute)"
            )

    def check_now(self) -> None:
        """``verify`` with a host read of its own: for an error path only (a recompute that
        already failed), where a host sync costs nothing that matters."""
        flags = self.pending()
        if flags is not None:
            self.verify(flags.tolist())


def current() -> ReplayCheck | None:
    return _CHECK.get()


@contextlib.contextmanager
def checking(check: ReplayCheck):
    """The forwards inside keep their replayed reads' comparisons in ``check``. Should the
    enclosed forwards and backwards fail (a shape error in a dispatch given replayed sizes, a
    checkpoint's count of saved tensors), a mismatch found then is raised instead, from it."""
    token = _CHECK.set(check)
    try:
        yield
    except RuntimeError as error:
        try:
            check.check_now()  # a host read, on a failing step only
        except ReplayMismatchError as mismatch:
            raise mismatch from error
        raise
    finally:
        _CHECK.reset(token)


@contextlib.contextmanager
def labelled(label: str):
    """The comparisons made inside name ``label`` (a MoE block: "layer 3")."""
    token = _LABEL.set(label)
    try:
        yield
    finally:
        _LABEL.reset(token)

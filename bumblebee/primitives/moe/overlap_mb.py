"""Expert-parallel all-to-all hidden under another micro-batch (slot ``moe_comm``, ``overlap_mb``).

``chunked`` hides one micro-batch's exchanges under its own expert GEMMs. ``overlap_mb`` keeps
the maths of ``alltoall`` (same ops, same order: gradients and losses are bit-identical) and
hides each exchange under the compute of a *second* micro-batch in flight on the same rank.

Two micro-batches A and B in flight run on two threads of one rank, exactly one of them running at any
time (``Pair``: a baton passed at fixed points, so the order of every collective is the same on
every rank). Every dispatch / combine all-to-all of this primitive, forward and backward, is
issued asynchronously, then the baton goes to the partner, then the issuer waits
(``_Exchange``). One MoE layer j, forward, in the steady state (A ahead of B by one exchange):

    A: ... attn j, router | counts issue -> B
    B: (A's counts in flight) attn j, router | counts issue -> A
    A: counts wait | dispatch issue -> B
    B: counts wait | dispatch issue -> A
    A: dispatch wait, expert GEMMs | combine issue -> B
    B: (A's combine in flight) dispatch wait, expert GEMMs | combine issue -> A
    A: combine wait, weighted sum, residual, attn j+1 ... -> B
    B: (B's combine was in flight under A's tail) combine wait ...

The step (runtime/step.py ``run_micro_batches``) runs pairs (forwards side by side, then
backwards: the global-batch balance loss needs every forward first) or a 1F1B chain (micro-batch
k's forward beside k - 1's backward) for the per-micro-batch balance losses.

Backward is the mirror: combine-backward issued, partner runs (its layer tail backward or its
expert backward), wait, expert backward, dispatch-backward issued, partner runs, wait, router and
attention backward. Under full recompute the checkpoint re-runs layer j inside its backward; that
re-run's exchanges switch too, so they hide under the partner's backward. The count exchange (E
integers) switches as well: blocking, it would absorb the peer rank's drift.

The step cuts each micro-batch's forward at every decoder layer (``layer_tape``) and runs its
backward one layer at a time, handing over between the layers (``backward_part``): autograd runs
a CUDA backward on its own device thread, where a switch inside the backward cannot happen (it
is a no-op there). On CUDA the two micro-batches also run on two compute streams
(``SlotStreams``): a layer's backward call queues its kernels, exchange waits included, on its
own stream, so the partner's kernels queued beside it run while an exchange stalls it; each
backward part first waits for the partner's last part writing the same gradients. The exchanges
run on a side stream (``chunked._Comm``). Outside a ``Pair`` (one micro-batch, eval, the RL
engine) a switch does nothing: the primitive is ``alltoall`` with asynchronous waits.

Legend: T tokens, H hidden, K choices per token, N = T*K rows, E experts, R ep ranks.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from bumblebee.primitives import emulation
from bumblebee.primitives.moe.alltoall import AllToAllDispatch, plain_routed
from bumblebee.primitives.moe.chunked import _Comm
from bumblebee.primitives.moe.costs import MoeCommCosts
from bumblebee.registry import Need, register

# Dynamic scope, not configuration: (pair, slot, thread id) on a thread a ``Pair`` runs.
_SLOT = contextvars.ContextVar("bumblebee_mb_pair_slot", default=None)


class Pair:
    """Runs functions on threads, at most two in flight, exactly one running at any time;
    ``switch()`` hands over to the other one in flight.

    Only the holder of the baton runs Python (and issues collectives); it passes the baton at a
    switch point, and for good when its function returns. ``run(a, b)``: both in flight from the
    start. ``run(*fns, chain=True)`` (1F1B): function k starts once k - 1 has called
    ``forward_done()`` and k - 2 has returned, so micro-batch k's forward runs beside k - 1's
    backward. Every function sees the caller's context variables, grad mode and Python dispatch
    modes (the CPU memory tracker is one: without them it would not see the threads' tensors).
    ``switches`` counts the hand-overs."""

    def __init__(self, streams: SlotStreams | None = None):
        self._cv = threading.Condition()
        self._turn, self._n, self.switches = 0, 0, 0
        self._started, self._marked, self._done = set(), set(), set()
        self.streams = streams
        self._last = {}  # gradient key -> (stream, event) of the last backward part writing it

    def run(self, *fns, chain: bool = False) -> list:
        n = self._n = len(fns)
        results, errors = [None] * n, [None] * n
        self._started = {0} if chain else set(range(n))
        grad, modes = torch.is_grad_enabled(), _get_current_dispatch_mode_stack()

        def body(slot, fn):
            _SLOT.set((self, slot, threading.get_ident()))
            with self._cv:
                self._cv.wait_for(lambda: self._turn == slot)
            try:
                with torch.set_grad_enabled(grad), contextlib.ExitStack() as stack:
                    for mode in modes:
                        stack.enter_context(mode)
                    if self.streams is not None:
                        stack.enter_context(self.streams.entered(slot))
                    results[slot] = fn()
            except BaseException as e:  # re-raised on the caller's thread
                errors[slot] = e
            finally:
                with self._cv:
                    self._done.add(slot)
                    self._admit()
                    self._turn = self._other(slot)
                    self._cv.notify_all()

        threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(body, s, f))
            for s, f in enumerate(fns)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.streams is not None:
            self.streams.join()
        for e in errors:
            if e is not None:
                raise e
        return results

    def _admit(self) -> None:
        k = max(self._started) + 1
        if k < self._n and (k - 1 in self._marked | self._done) and (k < 2 or k - 2 in self._done):
            self._started.add(k)

    def _other(self, slot: int):
        """The other function in flight (started, not returned), or None."""
        live = sorted(self._started - self._done - {slot})
        return live[0] if live else None

    def _switch(self, slot: int) -> None:
        with self._cv:
            other = self._other(slot)
            if other is None:
                return
            self._turn, self.switches = other, self.switches + 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._turn == slot)

    def _forward_done(self, slot: int) -> None:
        with self._cv:
            self._marked.add(slot)
            self._admit()

    @contextlib.contextmanager
    def _part(self, slot: int, key):
        """One backward part of micro-batch ``slot`` writing the gradients of ``key``: handed over
        before it; on CUDA its stream first waits for the last part that wrote ``key`` on
        another stream (two micro-batches' accumulations into one ``.grad`` are ordered)."""
        self._switch(slot)
        stream = None if self.streams is None else self.streams.of(slot)
        last = self._last.get(key)
        if stream is not None and last is not None and last[0] is not stream:
            stream.wait_event(last[1])
        yield
        if stream is not None:
            self._last[key] = (stream, self.streams.record(stream))


class SlotStreams:
    """The compute streams of a ``Pair`` on CUDA: even slots on the caller's current stream, odd
    ones on a second stream, so that one micro-batch's kernels queue beside the other's while an
    exchange stalls it. A slot's stream first waits for the caller's work (its inputs);
    ``join()`` makes the caller's stream wait for both. Under emulation the stand-ins of
    ``emulation`` take the same calls. Keep one for a step: a micro-batch's backward runs on the
    stream of its forward."""

    def __init__(self, device: torch.device):
        self.device = device
        self.streams = (emulation.current_stream(device), emulation.side_stream(device))

    def of(self, slot: int):
        return self.streams[slot % 2]

    @contextlib.contextmanager
    def entered(self, slot: int):
        stream = self.of(slot)
        if stream is not self.streams[0]:
            stream.wait_stream(self.streams[0])
        with emulation.use_stream(stream):
            yield

    def record(self, stream):
        event = emulation.new_event(self.device)
        event.record(stream)
        return event

    def join(self) -> None:
        self.streams[0].wait_stream(self.streams[1])

    @staticmethod
    def for_device(device: torch.device) -> SlotStreams | None:
        """Streams on CUDA and under emulation; None on CPU (nothing to order)."""
        return SlotStreams(device) if device.type == "cuda" or emulation.active() else None


def switch() -> None:
    """Hand the rank to the partner micro-batch until it reaches its own switch (no-op outside a
    ``Pair``, and on threads a ``Pair`` did not start, e.g. autograd's CUDA device thread)."""
    slot = _SLOT.get()
    if slot is not None and slot[2] == threading.get_ident():
        slot[0]._switch(slot[1])


def backward_part(key):
    """Context of one backward part of a layer-cut forward (``layer_tape``): a hand-over to the
    partner, then stream order for the gradients of ``key``; nothing outside a ``Pair``."""
    slot = _SLOT.get()
    if slot is not None and slot[2] == threading.get_ident():
        return slot[0]._part(slot[1], key)
    return contextlib.nullcontext()


def forward_done() -> None:
    """Tell a chained ``Pair`` that this micro-batch's forward is over (the next may start)."""
    slot = _SLOT.get()
    if slot is not None and slot[2] == threading.get_ident():
        slot[0]._forward_done(slot[1])


def exchange(comm: _Comm, x: torch.Tensor, send, recv) -> torch.Tensor:
    """Issue the all-to-all, let the partner run, then wait for it."""
    pending = comm.a2a(x, send, recv)
    switch()
    return pending.wait()


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; forward and backward both switch while in flight."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], comm: _Comm):
        ctx.args = (send, recv, comm)
        return exchange(comm, x, send, recv)

    @staticmethod
    def backward(ctx, grad_out):
        send, recv, comm = ctx.args
        return exchange(comm, grad_out.contiguous(), recv, send), None, None, None


@register(
    "moe_comm",
    "overlap_mb",
    summary="alltoall with each exchange hidden under a second micro-batch (pairs, pp = 1)",
    needs=(
        Need(
            "pp = 1 only (with pp > 1 the pipeline schedule already keeps micro-batches in flight)",
            lambda f: f.pp == 1,
        ),
        Need(
            "parallel.ep > 1 (with ep = 1 there is no all-to-all to hide; use 'local')",
            lambda f: f.ep > 1,
        ),
        Need(
            "at least two micro-batches per rank and step (got {micro_batches}: "
            "train.global_batch / (dp_shard x train.micro_batch))",
            lambda f: f.micro_batches is None or f.micro_batches >= 2,
        ),
        Need(
            "sharding = 'zero1' (FSDP2 reshards a layer when one micro-batch leaves it, under the "
            "other one still inside it)",
            lambda f: f.prims.sharding != "fsdp2",
        ),
    ),
    paired=True,
    # the same ops as alltoall's, for each of the two micro-batches inside a layer at once
    costs=MoeCommCosts(routed=lambda c, last: plain_routed(last), overlap="partner", searched=()),
)
class OverlapMBDispatch(AllToAllDispatch):
    """``alltoall``'s ops in its order (its ``__call__``); only the two exchanges differ: issued
    asynchronously, the partner runs, then the wait."""

    def __init__(self, num_experts: int, ep_group=None, ep_size: int | None = None, **_unused):
        super().__init__(num_experts, ep_group, ep_size)
        self._streams = {}  # device -> CUDA communication stream

    def _comm(self, x: torch.Tensor) -> _Comm:
        stream = None
        if emulation.kind(x) == "cuda":
            if x.device not in self._streams:
                self._streams[x.device] = emulation.side_stream(x.device)
            stream = self._streams[x.device]
        return _Comm(self.group, self.ep, stream)

    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        # the counts too: a blocking exchange would wait out the peer rank's drift, exposed
        return exchange(self._comm(counts_E), counts_E, None, None).view(self.ep, -1)

    def exchange_rows(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return _Exchange.apply(x, send, recv, self._comm(x))

"""The baton of ``moe_comm = overlap_mb`` (``overlap_mb.Pair``): which micro-batch runs when.

Threads only, no process group. Each function logs phases and hands over at ``switch()`` (where
an exchange would be in flight). Pairs alternate from the start; a chain (1F1B) starts
micro-batch k only after k - 1's forward is done and k - 2 has returned, so k's forward runs
beside k - 1's backward and never three are in flight. The exact order is the contract: every
rank must issue its collectives in it.
"""

import threading

import pytest
import torch

from bumblebee.primitives.moe.overlap_mb import (
    Pair,
    SlotStreams,
    backward_part,
    forward_done,
    switch,
)


def micro_batch(k, log, chained, backward="abc"):
    def fn():
        log.append(f"F{k}a")
        switch()
        log.append(f"F{k}b")
        if chained:
            forward_done()
        for i, part in enumerate(backward):
            log.append(f"B{k}{part}")
            if i < len(backward) - 1:
                switch()
        return k

    return fn


def test_pair_alternates():
    log = []
    assert Pair().run(micro_batch(0, log, False), micro_batch(1, log, False)) == [0, 1]
    assert log == "F0a F1a F0b B0a F1b B1a B0b B1b B0c B1c".split()


def test_chain_is_1f1b():
    log = []
    fns = [micro_batch(k, log, True) for k in range(3)]
    assert Pair().run(*fns, chain=True) == [0, 1, 2]
    expected = (
        "F0a F0b B0a "  # micro-batch 0 alone until its forward is done
        "F1a B0b F1b B1a B0c "  # 1's forward beside 0's backward; 1 starts its backward
        "B1b F2a B1c F2b B2a B2b B2c"  # 0 returned: 2 starts beside 1's backward; 2 alone
    )
    assert log == expected.split()


def test_chain_keeps_two_in_flight():
    """Micro-batch 1 returns while 0 is still in its backward: 2 must wait for 0 to return."""
    log = []
    fns = [micro_batch(0, log, True, "abcde"), micro_batch(1, log, True, "a")]
    fns.append(micro_batch(2, log, True, "ab"))
    Pair().run(*fns, chain=True)
    expected = "F0a F0b B0a F1a B0b F1b B1a B0c B0d B0e F2a F2b B2a B2b"
    assert log == expected.split()


def test_switch_outside_is_a_no_op_and_errors_reach_the_caller():
    switch()  # not on a Pair thread

    def bad():
        switch()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        Pair().run(bad, lambda: threading.get_ident())


def test_grad_mode_follows_the_caller():
    with torch.no_grad():
        assert Pair().run(torch.is_grad_enabled, torch.is_grad_enabled) == [False, False]
    assert Pair().run(torch.is_grad_enabled, torch.is_grad_enabled) == [True, True]


class _Stream:
    """A CUDA stream stand-in logging what it is asked to wait for."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")

    def wait_event(self, event):
        self.log.append(f"{self.name} waits {event}")


def test_backward_parts_order_gradient_writes_across_streams():
    """Two micro-batches on two streams write the same ``.grad`` tensors: every backward part of
    a key waits for the last part of that key on the other stream (the loss's and the
    embedding's parts share one key, "ends")."""
    log = []
    streams = SlotStreams(torch.device("cpu"))
    streams.streams = (_Stream("s0", log), _Stream("s1", log))
    events = iter(range(100))

    def record(stream):
        name = f"e{next(events)}@{stream.name}"
        log.append(f"{stream.name} records {name}")
        return name

    streams.record = record

    def micro_batch(k):
        def fn():
            for key in ("ends", ("layer", 2), ("layer", 1), "ends"):
                with backward_part(key):
                    log.append(f"B{k} {key}")

        return fn

    Pair(streams).run(micro_batch(0), micro_batch(1))
    expected = [
        "s1 waits s0",  # slot 1's stream: after the caller's work (its inputs)
        "B0 ends", "s0 records e0@s0",
        "s1 waits e0@s0", "B1 ends", "s1 records e1@s1",
        "B0 ('layer', 2)", "s0 records e2@s0",
        "s1 waits e2@s0", "B1 ('layer', 2)", "s1 records e3@s1",
        "B0 ('layer', 1)", "s0 records e4@s0",
        "s1 waits e4@s0", "B1 ('layer', 1)", "s1 records e5@s1",
        "s0 waits e1@s1", "B0 ends", "s0 records e6@s0",  # the embedding after B's loss part
        "s1 waits e6@s0", "B1 ends", "s1 records e7@s1",
        "s0 waits s1",  # join: the caller's stream after both
    ]  # fmt: skip
    assert log == expected


def test_backward_part_outside_a_pair_does_nothing():
    with backward_part("ends"):
        pass

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

from bumblebee.primitives.moe.overlap_mb import Pair, forward_done, switch


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

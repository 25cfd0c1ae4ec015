"""Progress of long silent operations (``console.Progress``): nothing for a short operation,
then a line every few seconds to stderr with count, share, ETA and elapsed time as h:mm:ss,
and a closing line; wired into ``plan`` (layouts evaluated, candidates checked), ``plan
--dry-run`` (layer passes; its result a table) and ``convert`` (tensors written).
A fake clock stands in for time: no test waits or asserts on wall-clock time."""

import contextlib
import io
import itertools

import pytest

from bumblebee import console
from bumblebee.console import Progress, hms
from bumblebee.plan.cli import main as plan_main


def test_hms():
    assert [hms(0), hms(59.6), hms(3725), hms(90000)] == [
        "0:00:00",
        "0:01:00",
        "1:02:05",
        "25:00:00",
    ]


def test_short_operations_stay_silent_long_ones_report():
    ticks = iter([0.0, 0.5, 1.0])
    out = io.StringIO()
    with Progress("quick", total=2, stream=out, clock=lambda: next(ticks)) as p:
        p.update()
        p.update()
    assert out.getvalue() == ""  # done within the delay: no line at all

    clock = itertools.count(0.0, 3.0)  # every reading 3 s later
    out = io.StringIO()
    with Progress("layouts", total=10, stream=out, clock=lambda: next(clock)) as p:
        for _ in range(10):
            p.update()
    lines = out.getvalue().splitlines()
    assert lines[0] == "bumblebee: layouts 1/10 (10%), eta 0:00:27, 0:00:03 elapsed"
    assert lines[-1] == "bumblebee: layouts: done (10/10) in 0:00:33"
    assert 3 <= len(lines) <= 8  # one line per ~5 s, not one per update


@pytest.fixture
def slow_clock(monkeypatch):
    """time.monotonic as seen by Progress advances 1 s per reading: every operation is 'long'."""
    clock = itertools.count(0.0, 1.0)
    monkeypatch.setattr(console.time, "monotonic", lambda: next(clock))


def test_plan_reports_progress_on_stderr(slow_clock):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert (
            plan_main(["--model", "qwen3-30b-a3b", "--gpus", "16", "--seq", "65536", "--top", "2"])
            == 0
        )
    lines = err.getvalue().splitlines()
    assert any(
        line.startswith("bumblebee: plan qwen3-30b-a3b on 16 GPUs: layouts evaluated ")
        for line in lines
    )
    assert any("candidates checked against the runtime: done" in line for line in lines)
    assert "layouts evaluated" not in out.getvalue()  # stdout stays the result


def test_dry_run_progress_and_table(slow_clock):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert (
            plan_main(["--model", "qwen3_moe/tiny", "--gpus", "2", "--seq", "512", "--dry-run"])
            == 0
        )
    assert "layer passes" in err.getvalue() and "done" in err.getvalue()
    text = out.getvalue()
    table = text[text.index("dry run: stage") :].splitlines()
    assert table[1].split()[:3] == ["GB", "measured/analytic", "saved_inputs"]
    assert any(line.split()[0] == "forward" for line in table) and any(
        line.split()[0] == "optimizer" for line in table
    )
    assert max(len(line) for line in table) < 200  # a table, not one long line

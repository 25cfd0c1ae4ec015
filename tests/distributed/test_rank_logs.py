"""Rank failure logs: each rank of a multi-rank run writes its full traceback (or, for a fatal
signal, faulthandler's stacks) to ``out_dir/logs/rank<N>.log``, and the launcher's one-line
summary names that file; without an out_dir the summary is preceded by the traceback's end."""

import faulthandler
import os
from types import SimpleNamespace

import torch.distributed as dist

from bumblebee.runtime.launch.launcher import init_distributed, launch_local


def _deep_failure(depth: int):
    if depth == 0:
        raise ValueError("bad routing in layer 3")
    _deep_failure(depth - 1)


def _rank1_raises_deep(cfg):
    init_distributed(timeout_s=60)
    if dist.get_rank() == 1:
        _deep_failure(3)
    dist.barrier()


def _rank1_segfaults(cfg):
    init_distributed(timeout_s=60)
    if dist.get_rank() == 1:
        faulthandler._sigsegv()
    dist.barrier()


def _summary(err: str) -> str:
    return [x for x in err.splitlines() if x.startswith("bumblebee: ")][-1]


def test_failing_rank_writes_its_traceback_and_the_summary_names_it(tmp_path, capfd):
    cfg = SimpleNamespace(train=SimpleNamespace(out_dir=str(tmp_path)))
    assert launch_local(cfg, 2, worker=_rank1_raises_deep) == 1
    log = tmp_path / "logs" / "rank1.log"
    line = _summary(capfd.readouterr().err)
    assert line.startswith("bumblebee: rank 1 failed first (exit 1): ValueError: bad routing")
    assert line.endswith(f"; full traceback in {log}"), line
    text = log.read_text()
    assert "Traceback (most recent call last)" in text
    assert text.count("_deep_failure") >= 4  # every frame, not the last line only
    assert "ValueError: bad routing in layer 3" in text
    # the other rank records its own end (the peer loss it saw), not rank 1's error
    assert "ValueError" not in (tmp_path / "logs" / "rank0.log").read_text()


def test_fatal_signal_leaves_the_stacks_in_the_log(tmp_path, capfd):
    cfg = SimpleNamespace(train=SimpleNamespace(out_dir=str(tmp_path)))
    assert launch_local(cfg, 2, worker=_rank1_segfaults) == 1
    log = tmp_path / "logs" / "rank1.log"
    line = _summary(capfd.readouterr().err)
    assert line.startswith("bumblebee: rank 1 failed first"), line
    assert line.endswith(f"; full traceback in {log}"), line
    text = log.read_text()
    assert "Segmentation fault" in text and "_rank1_segfaults" in text


def test_without_an_out_dir_the_summary_keeps_the_traceback_end(capfd):
    assert launch_local(None, 2, worker=_rank1_raises_deep) == 1
    err = capfd.readouterr().err
    lines = err.splitlines()
    at = lines.index(_summary(err))
    assert any("_deep_failure" in x for x in lines[max(0, at - 12) : at]), err[-2000:]
    assert lines[at - 1].strip() == "ValueError: bad routing in layer 3"
    assert not os.path.exists("logs/rank1.log")

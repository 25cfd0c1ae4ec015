"""Ctrl-C in ``bumblebee data prepare --workers 2`` ends as it ends ``train``: one line
(``bumblebee: interrupted``), exit 130, no worker traceback, no hang, and no partial output
directory, wherever it lands (while modules import, while workers encode, near the end, while
the output is being closed)."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from bumblebee.data.encode import Encoder
from bumblebee.data.prepare import prepare


@pytest.fixture(scope="module")
def big_input(tmp_path_factory):
    path = tmp_path_factory.mktemp("in") / "docs.jsonl"
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(12000):
            n = rng.randrange(20, 200)
            f.write(json.dumps({"input_ids": [rng.randrange(256) for _ in range(n)]}) + "\n")
    return str(path)


def _interrupt(src: str, out: str, when) -> tuple[int, str]:
    """Start a prepare in its own process group; send SIGINT to the group (the terminal's Ctrl-C
    reaches the workers too) at ``when``: a delay in seconds (float), or the first progress line
    at or past that percentage (int). Returns (exit code, stderr)."""
    argv = [sys.executable, "-m", "bumblebee.cli", "data", "prepare", src, out]
    p = subprocess.Popen(
        argv + ["--source", "tokens", "--workers", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines, reached = [], threading.Event()

    def read():  # stderr, whole (the workers share it: it ends when the last process exits)
        for line in p.stderr:
            lines.append(line)
            done = re.search(r"(\d+)%", line)
            if not isinstance(when, float) and done and int(done.group(1)) >= when:
                reached.set()
        reached.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if isinstance(when, float):
        time.sleep(when)
    else:
        reached.wait(60)
    os.killpg(p.pid, signal.SIGINT)
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        pytest.fail(f"data prepare did not stop within 30 s of Ctrl-C ({when}): {''.join(lines)}")
    reader.join(10)
    return p.returncode, "".join(lines)


# 0.4 s: while modules import; 0: at the first progress line (the workers have started; a fixed
# delay there raced the whole prepare on a fast machine); 10 / 90: percentages of the work
@pytest.mark.parametrize("when", [0.4, 0, 10, 90])
def test_ctrl_c_in_data_prepare_with_workers(big_input, tmp_path, when):
    out = str(tmp_path / "out")
    code, err = _interrupt(big_input, out, when)
    said = [ln for ln in err.splitlines() if not ln.startswith("prepare [")]  # progress lines
    assert code == 130 and said == ["bumblebee: interrupted"], (code, err[-3000:])
    assert not os.path.exists(out), os.listdir(out)


def test_an_interrupt_while_the_output_is_closed_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [1, 2, 3]}) + "\n" for _ in range(5)))

    from bumblebee import safe_write

    write_file = safe_write.write_file

    def interrupted(path, *args, **kwargs):  # Ctrl-C after the offsets, while meta.json is written
        if path.endswith("meta.json"):
            raise KeyboardInterrupt
        write_file(path, *args, **kwargs)

    monkeypatch.setattr(safe_write, "write_file", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(str(src), str(out), Encoder("tokens", ""), progress=False)
    assert not out.exists(), os.listdir(out)


def test_tokenizing_at_start_shows_progress_on_a_large_input(tmp_path):
    """Issue 35: text / chat data a run tokenizes at start gets the bar ``data prepare`` has
    (label ``tokenize``) when the input is large or stderr a terminal; a small one stays quiet."""
    import io

    from bumblebee.data.prepare import encode_in_memory

    src = tmp_path / "a.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [1, 2, 3]}) + "\n" for _ in range(50)))
    quiet, shown = io.StringIO(), io.StringIO()
    encode_in_memory(str(src), Encoder("tokens", ""), stream=quiet)
    store = encode_in_memory(str(src), Encoder("tokens", ""), progress=True, stream=shown)
    assert quiet.getvalue() == "" and store.num_docs == 50
    assert shown.getvalue().startswith("tokenize [") and "100%" in shown.getvalue()

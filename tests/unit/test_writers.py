"""Writers that meet a full disk or a second writer:

- a full disk (a file-size limit in the child, SIGXFSZ ignored, so a write fails with EFBIG as
  on a full disk) during a checkpoint save, a ``data prepare`` or a ``convert``: one line
  ``bumblebee: error: ... no room ...`` naming the filesystem; the previous checkpoint stays
  intact and resumable; no partial directory or file is left;
- two ``data prepare`` into one OUT: the second is refused while the first holds OUT's lock
  (they used to both succeed and leave a corpus equal to neither).
"""

import json
import os
import resource
import signal
import subprocess
import sys

import pytest
from data_helpers import make_tokenizer

from bumblebee.runtime.checkpoint.directory import find_checkpoint, read_marker
from bumblebee.runtime.launch.outdir import LOCK_NAME

TINY = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=2",
    "model.arch.num_experts_per_tok=1",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "primitives.attention=sdpa",
    "train.seq_len=32",
    "train.global_batch=1",
    "data.min_records=1",
    "data.max_records=2",
    "train.warmup_steps=0",
]
LIMIT = (
    64 * 1024
)  # bytes per file: metrics, configs and markers fit, a checkpoint's data file does not


def bumblebee(*args, limit=None):
    def small_files():
        signal.signal(
            signal.SIGXFSZ, signal.SIG_IGN
        )  # a write past the limit fails (EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "bumblebee.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        preexec_fn=small_files if limit else None,
    )


def sets(*items):
    return [a for s in TINY + list(items) for a in ("--set", s)]


def one_line(r, *fragments):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[-1].startswith("bumblebee: error: ") and all(f in lines[-1] for f in fragments), (
        r.stderr
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    r = bumblebee("train", *sets("train.steps=1", "train.save_every=1", f"train.out_dir={out}"))
    assert r.returncode == 0, r.stderr
    return out


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(run):
    r = bumblebee(
        "train",
        *sets("train.steps=2", "train.save_every=1", f"train.out_dir={run}"),
        "--resume",
        "auto",
        limit=LIMIT,
    )
    one_line(r, "no room", "file-size limit", "filesystem of")
    ckpts = run / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["step_00000001"]  # no partial .tmp-step_00000002
    assert read_marker(str(ckpts / "step_00000001"))["step"] == 1
    assert find_checkpoint("auto", str(run)) == str(ckpts / "step_00000001")
    assert not (run / LOCK_NAME).exists()
    r = bumblebee(
        "train",
        *sets("train.steps=2", "train.save_every=1", f"train.out_dir={run}"),
        "--resume",
        "auto",
    )
    assert r.returncode == 0 and "resumed from" in r.stdout, (
        r.stderr
    )  # and it resumes once there is room


def test_a_full_disk_during_convert_leaves_nothing(run, tmp_path):
    r = bumblebee("convert", "--to", "hf", str(run), str(tmp_path / "hf"), limit=LIMIT)
    one_line(r, "no room", "hf")
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    tok = make_tokenizer(d / "tok")
    with open(d / "in.jsonl", "w") as f:
        for i in range(3000):
            f.write(json.dumps({"text": f"document {i} " + "words and more words " * 8}) + "\n")
    return tok, d / "in.jsonl"


def test_a_full_disk_during_data_prepare_leaves_nothing(corpus, tmp_path):
    tok, path = corpus
    r = bumblebee(
        "data",
        "prepare",
        "--source",
        "text",
        "--tokenizer",
        tok,
        str(path),
        str(tmp_path / "out"),
        "--no-progress",
        limit=LIMIT,
    )
    one_line(r, "no room", "out")
    assert os.listdir(tmp_path) == []


def test_two_data_prepares_into_one_out(corpus, tmp_path):
    tok, path = corpus
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom bumblebee.runtime.launch.outdir import "
            f"OutDirLock\nwith OutDirLock({str(out)!r}):\n print('held', flush=True)\n"
            " time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        os.makedirs(out)
        assert holder.stdout.readline() == "held\n"  # another prepare is writing OUT
        r = bumblebee(
            "data",
            "prepare",
            "--source",
            "text",
            "--tokenizer",
            tok,
            str(path),
            str(out),
            "--no-progress",
        )
        one_line(r, "data prepare OUT", "in use by another run")
        assert os.listdir(out) == [LOCK_NAME]  # nothing of the second one written
    finally:
        holder.kill()
        holder.wait()

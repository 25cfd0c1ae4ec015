"""Every writer of bumblebee under the probe's two families (issue 51), generated per writer and
per name it writes, as test_bad_formats.py generates file variants:

- **symlinked targets**: a link planted at each file or directory name a writer writes (its
  temporaries included), pointing outside: the outside file or directory is unchanged, and the
  writer refuses with one line naming the link (a temporary's namesake is just left alone);
- **full disk**: the writer run again over its previous output under a file-size limit
  (RLIMIT_FSIZE with SIGXFSZ ignored: a write past it fails with EFBIG, as on a full disk, the
  way test_writers.py does it in a child) at every step of ``CUTS`` of the largest file it
  writes: one line ``no room``, and the directory exactly as before (the previous output
  intact, no temporary, nothing partial); an append-only record keeps whole lines only.

The writers run in this process (the CLI's ``main`` for the commands), so the families cost
milliseconds per variant; ``WRITERS`` says how many each tries."""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import signal
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from data_helpers import make_tokenizer

import bumblebee
from bumblebee import load_config
from bumblebee.cli import main
from bumblebee.errors import ConfigError

CUTS = (0, 2, 5, 8)  # tenths of the largest file written: where the disk fills up


# ------------------------------------------------------------------------------ the harness
@contextmanager
def file_size_limit(nbytes: int):
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)


def snapshot(path) -> dict[str, bytes | None]:
    """Every entry under ``path``: a file's bytes, a link's target, None for a directory."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, path)
            if os.path.islink(p):
                out[rel] = ("link:" + os.readlink(p)).encode()
                if name in dirs:
                    dirs.remove(name)
            elif os.path.isdir(p):
                out[rel] = None
            else:
                with open(p, "rb") as f:
                    out[rel] = f.read()
    return out


def attempt(fn, capsys) -> str | None:
    """Run a writer: None when it succeeds, else its one-line error (a ``ConfigError`` from the
    API, or exit 2 with one ``bumblebee: error:`` line from the CLI). Anything else fails."""
    capsys.readouterr()
    try:
        code = fn()
    except ConfigError as e:
        assert "\n" not in str(e), str(e)
        return str(e)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if code in (None, 0):
        return None
    lines = err.strip().splitlines()
    assert code == 2 and lines and lines[-1].startswith("bumblebee: error: "), (code, err)
    return lines[-1]


@dataclass
class Writer:
    """``run(d, version)`` writes version 0 or 1 of its output under directory ``d`` (returns a
    CLI exit code or None); ``setup(d)`` makes what it needs there first. ``files`` / ``dirs``:
    the names it writes (relative to ``d``), each refused when a link; ``temps``: names of
    temporaries an older bumblebee wrote by a predictable name (a link there is left alone).
    A temporary named with a trailing ``/`` was a directory. ``record``: its file is an
    append-only log (a full disk keeps whole lines of it). ``full_disk``: True, False (not
    tried here) or "quiet" (it must go on without error: a failure report)."""

    run: object
    files: tuple = ()
    dirs: tuple = ()
    temps: tuple = ()
    setup: object = None
    previous: bool = True  # a second run replaces a first one's output (else: it must be new)
    record: str = ""
    full_disk: bool | str = True
    cuts: tuple = CUTS  # a writer of one file drawn in memory first: every cut is the same


# ------------------------------------------------------------------------------ the writers
TINY = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.num_experts=4",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts_per_tok=1",
    "primitives.attention=sdpa",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "train.seq_len=32",
    "train.global_batch=1",
    "train.micro_batch=1",
    "train.warmup_steps=0",
    "data.min_records=1",
    "data.max_records=2",
]


def sets(items):
    return [a for s in items for a in ("--set", s)]


class Shared:
    """What several writers read, built once per module."""

    def __init__(self, root):
        self.root = root
        self._engine = self._tok = None

    @property
    def engine(self):
        if self._engine is None:
            from bumblebee.rl.engine import Engine

            self._engine = Engine(load_config(None, TINY + [f"train.out_dir={self.root}/e"]))
        return self._engine

    @property
    def checkpoint(self) -> str:
        path = os.path.join(self.root, "ckpt")
        if not os.path.isdir(path):
            self.engine.save(path, step=1)
        return path

    def tokenizer(self, version: int) -> str:
        path = os.path.join(self.root, f"tok{version}")
        if not os.path.isdir(path):
            make_tokenizer(path, vocab_size=280 + 20 * version)
        return path


def small_model(version: int):
    from bumblebee.models import build_model
    from bumblebee.models.qwen3_moe import Qwen3MoeArch

    torch.manual_seed(version)
    arch = Qwen3MoeArch(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=2,
        num_experts_per_tok=1,
        max_position_embeddings=32,
    )
    from bumblebee.config import LoraConfig

    model = build_model(arch, lora=LoraConfig(rank=2) if version >= 10 else None)
    model.reset_parameters(std=0.1)
    return model


RECORD = {"aux_loss": 0.0, "grad_norm": 1.0, "lr": 1e-3, "tokens": 64, "step_time_s": 0.1}
RECORD.update(tokens_per_s=640.0, peak_mem_bytes=2**20)


def metrics(d, v):
    from bumblebee.runtime.metrics import MetricsWriter

    w = MetricsWriter(str(d), total_steps=40, log_every=1000, stream=io.StringIO())
    for step in range(1, 40):  # the last step would print the progress line
        w.log({**RECORD, "step": step, "loss": 1.0 / step + v})
    w.close()


def rl_log(d, v):
    from bumblebee.rl.run import _Log

    log = _Log(str(d), True, io.StringIO())
    for step in range(1, 41):
        log({"step": step, "reward": 0.5 + v, "phase": "grpo"})
    log.close()


def aside_setup(d):
    (d / "checkpoints" / "step_00000001").mkdir(parents=True)
    (d / "checkpoints" / "step_00000001" / "complete.json").write_text("{}")
    lines = [json.dumps({"step": s, "loss": 2.0 - s / 100}) for s in range(1, 200)]
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (d / "config.toml").write_text("[train]\nsteps = 3\n" * 40)


def set_aside(d, v):
    from bumblebee.runtime.checkpoint.record import set_aside

    # a continuation from step 1: the lines past it and the changed config are copied aside
    set_aside(str(d), continues_from=1, config_text=f"other {v}")


def prepare_setup(d):
    src = d.parent / f"{d.name}-in.jsonl"
    src.write_text(
        "".join(json.dumps({"input_ids": list(range(3, 4 + n % 50))}) + "\n" for n in range(400))
    )
    (d / "prep").mkdir()


def prepare(d, v):
    src = d.parent / f"{d.name}-in.jsonl"
    argv = ["data", "prepare", str(src), str(d / "prep"), "--source", "tokens", "--no-progress"]
    return main(argv)


def to_hf(shard: int):
    def run(d, v):
        bumblebee.to_hf(small_model(v), str(d / "hf"), max_shard_bytes=shard)

    return run


def engine_export(shared):
    def run(d, v):
        shared.engine.export_hf(str(d / "hf"), dtype=(torch.bfloat16, torch.float32)[v])

    return run


def convert(shared):
    def run(d, v):
        dtype = ("bfloat16", "float32")[v]
        argv = ["convert", "--to", "hf", shared.checkpoint, str(d / "hf"), "--dtype", dtype]
        return main(argv + ["--overwrite"] * v)

    return run


def engine_save(shared):
    def run(d, v):
        shared.engine.save(str(d / "out"), step=1 + v, keep=0)

    return run


def peft(d, v):
    from bumblebee.models.lora import is_lora_name, write_peft_adapter

    model = small_model(10 + v)
    factors = [(n, p * (1 + v)) for n, p in model.named_parameters() if is_lora_name(n)]
    write_peft_adapter(str(d / "ad"), model.lora_info, factors)


def tokenizer(shared):
    def run(d, v):
        from bumblebee.models.hf_tokenizer import add_tokenizer

        add_tokenizer(str(d / "hf"), shared.tokenizer(v), chat=False)

    return run


def tokenizer_setup(d):
    (d / "hf").mkdir()
    (d / "hf" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))


def report_setup(d):
    for v in (0, 1):
        (d / f"run{v}").mkdir()
        lines = [json.dumps({"step": s, "loss": 3.0 / s + v, "lr": 1e-3}) for s in range(1, 30)]
        (d / f"run{v}" / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def report(d, v):
    return main(["report", str(d / f"run{v}"), "-o", str(d / "report.png")])


def plan_plot(d, v):
    argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--layout", "ep=8"]
    return main(argv + ["--seq", str(4096 * (1 + v)), "--plot", str(d / "plan.png")])


def rank_report(d, v):
    from bumblebee.runtime.launch.failures import write_report

    write_report(str(d), 0, 0, RuntimeError(f"failure {v}"))


def out_dir_check(d, v):
    from bumblebee.runtime.launch.outdir import check_out_dir

    check_out_dir(str(d / "run"), checkpoints=True)


def writer_guard(d, v):
    from bumblebee.outputs import check_target

    check_target(str(d / "out"), "data prepare OUT")


def train_setup(d):
    run = d / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    (run / "config.toml").write_text("[train]\n")


def train(d, v):
    argv = ["train"] + sets(TINY + ["train.steps=1", "train.save_every=1"])
    return main(argv + sets(["train.export_hf=true", f"train.out_dir={d / 'run'}"]))


RL_TINY = [
    "model.arch.hidden_size=32",
    "rl.steps=1",
    "rl.warmup_steps=1",
    "rl.eval_problems=2",
    "rl.prompts_per_step=2",
    "rl.group_size=2",
]


def rl_run(d, v):
    return main(["rl", *sets(RL_TINY + [f"train.out_dir={d / 'rl'}", f"train.seed={v}"])])


def pair_json(d, v):
    """``pair --json``: the command's own writer, with the paired runs replaced by a result (the
    runs' out_dir lies outside ``d``; their writers are the other entries here)."""
    from bumblebee.runtime.pair import run as pair_run

    rows = [{"step": s, "quantity": "loss", "a": 1.0 / s + v, "b": 1.0 / s} for s in range(1, 200)]
    real, pair_run.execute = pair_run.execute, lambda job, out: {"passed": True, "rows": rows}
    try:
        argv = ["pair", "--slot", "loss", "--a", "ce", "--b", "linear_ce", "--steps", "1"]
        argv += sets(TINY + [f"train.out_dir={d.parent / 'pair-runs'}"])
        return main(argv + ["--json", str(d / "pair.json")])
    finally:
        pair_run.execute = real


def rl_plot_setup(d):
    for v in (0, 1):
        lines = [{"phase": "grpo", "step": s, "reward": v / 4 + s / 100} for s in range(1, 30)]
        lines += [
            {"phase": "eval", "step": 0, "reward": 0.4},
            {"phase": "eval", "step": 29, "reward": 0.6},
        ]
        (d / f"m{v}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def rl_plot(d, v):
    from bumblebee.report import plot_rewards

    plot_rewards(str(d / f"m{v}.jsonl"), str(d / "rewards.png"))


def rank_log(d, v):
    from bumblebee.runtime.launch.rank_logs import rank_log

    with rank_log(str(d / "logs"), 0, v):
        pass


def out_dir_lock(d, v):
    from bumblebee.runtime.launch.outdir import OutDirLock

    with OutDirLock(str(d / "run"), stream=io.StringIO()):
        pass


PID = os.getpid()
ST, IDX = "model.safetensors", "model.safetensors.index.json"


def writers(shared) -> dict[str, Writer]:
    hf_files = (f"hf/{ST}", "hf/config.json")
    return {
        "metrics.jsonl": Writer(metrics, files=("metrics.jsonl",), record="metrics.jsonl"),
        "rl metrics.jsonl": Writer(rl_log, files=("metrics.jsonl",), record="metrics.jsonl"),
        "set aside": Writer(
            set_aside, dirs=("previous", "checkpoints"), setup=aside_setup, previous=False
        ),
        "data prepare": Writer(
            prepare,
            files=tuple(f"prep/{n}" for n in ("tokens.u32", "loss_mask.u8", "offsets.i64"))
            + ("prep/doc_loss.i64", "prep/meta.json"),
            temps=("prep/meta.json.tmp",),
            setup=prepare_setup,
            previous=False,
        ),
        "to_hf": Writer(to_hf(2**30), files=hf_files),
        "to_hf sharded": Writer(
            to_hf(3000), files=("hf/model-00001-of-00005.safetensors", f"hf/{IDX}")
        ),
        "Engine.export_hf": Writer(engine_export(shared), files=hf_files),
        "convert": Writer(convert(shared), files=hf_files, temps=(f".hf.tmp-{PID}/",)),
        "Engine.save": Writer(
            engine_save(shared),
            dirs=("out/checkpoints", "out/checkpoints/step_00000002"),
            temps=(),
            setup=lambda d: (d / "out").mkdir(),
        ),
        "export_peft": Writer(
            peft, files=("ad/adapter_model.safetensors", "ad/adapter_config.json")
        ),
        "tokenizer files": Writer(
            tokenizer(shared),
            files=("hf/tokenizer.json", "hf/config.json", "hf/generation_config.json"),
            setup=tokenizer_setup,
        ),
        "report -o": Writer(report, files=("report.png",), setup=report_setup, cuts=(5,)),
        "plan --plot": Writer(plan_plot, files=("plan.png",), cuts=(5,)),
        # a full disk is no error of its own: the rank's failure it records stays raised
        "rank report": Writer(
            rank_report, files=("a0_r0.json",), temps=(".a0_r0.json",), full_disk="quiet"
        ),
        # refused up front; a full disk: its files' writers above, its checkpoint test_writers.py
        "train": Writer(
            train,
            files=("run/metrics.jsonl", "run/config.toml"),
            dirs=("run/checkpoints", "run/previous", "run/hf"),
            setup=train_setup,
            previous=False,
            full_disk=False,
        ),
        "train.out_dir check": Writer(
            out_dir_check,
            temps=(f"run/.write-test-{PID}", f"run/checkpoints/.write-test-{PID}"),
            setup=lambda d: (d / "run" / "checkpoints").mkdir(parents=True),
            previous=False,
            full_disk=False,
        ),
        # refused up front (links); a full disk: its files' writers above (as for train)
        "rl": Writer(
            rl_run,
            files=("rl/metrics.jsonl", "rl/config.toml"),
            dirs=("rl/reference",),
            previous=False,
            full_disk=False,
        ),
        "pair --json": Writer(pair_json, files=("pair.json",), cuts=(5,)),
        "rl --plot": Writer(rl_plot, files=("rewards.png",), setup=rl_plot_setup, cuts=(5,)),
        # a rank's log never hides the failure it records: a link or a full disk, no log
        "rank log": Writer(
            rank_log, files=("logs/rank0.log",), dirs=("logs",), full_disk="quiet", cuts=(0, 5)
        ),
        # a link at the lock itself (or its temporary) is a stale lock: replaced, not followed
        "out_dir lock": Writer(
            out_dir_lock,
            files=("run/.bumblebee.lock.guard",),
            temps=("run/bumblebee.lock", f"run/.bumblebee.lock.{PID}.tmp"),
            setup=lambda d: (d / "run").mkdir(),
            previous=False,
            full_disk=False,
        ),
        "writer guard": Writer(
            writer_guard,
            temps=(f".bumblebee-write-test-{PID}",),
            previous=False,
            full_disk=False,
        ),
    }


NAMES = [
    "metrics.jsonl",
    "rl metrics.jsonl",
    "set aside",
    "data prepare",
    "to_hf",
    "to_hf sharded",
    "Engine.export_hf",
    "convert",
    "Engine.save",
    "export_peft",
    "tokenizer files",
    "report -o",
    "plan --plot",
    "rank report",
    "train",
    "train.out_dir check",
    "rl",
    "pair --json",
    "rl --plot",
    "rank log",
    "out_dir lock",
    "writer guard",
]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return writers(Shared(tmp_path_factory.mktemp("shared")))


def _targets():
    out = []
    for name in NAMES:
        w = writers(None)[name]
        out += [(name, t, "file") for t in w.files] + [(name, t, "dir") for t in w.dirs]
        out += [(name, t, "temp") for t in w.temps]
    return out


def _fresh(d, w: Writer):
    d.mkdir(parents=True)
    if w.setup:
        w.setup(d)
    return d


# ------------------------------------------------------------------------------ symlinked targets
def _id(value) -> str:
    """A test id without this process's pid (pytest-xdist's workers must collect equal ids)."""
    return str(value).replace(str(PID), "PID")


@pytest.mark.parametrize("writer, target, kind", _targets(), ids=_id)
def test_a_planted_link_is_never_written_through(table, tmp_path, capsys, writer, target, kind):
    w = table[writer]
    d = _fresh(tmp_path / "target", w)
    if w.previous:
        assert attempt(lambda: w.run(d, 0), capsys) is None
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"not bumblebee's")
    (outside / "vdir").mkdir()
    (outside / "vdir" / "keep").write_bytes(b"kept")
    before = snapshot(outside)
    link = d / target.rstrip("/")
    link.parent.mkdir(parents=True, exist_ok=True)
    if os.path.isdir(link) and not os.path.islink(link):
        shutil.rmtree(link)
    elif os.path.lexists(link):
        os.remove(link)
    os.symlink(outside / ("vdir" if kind == "dir" or target.endswith("/") else "victim"), link)
    error = attempt(lambda: w.run(d, 1), capsys)
    assert snapshot(outside) == before, f"{writer} wrote through {target}"
    if kind == "temp" or w.full_disk == "quiet":  # a temporary of its own / a report let go
        assert error is None, error
    else:
        assert error is not None and "symbolic link" in error, error


# ------------------------------------------------------------------------------ full disk
def _full_disk_cases():
    return [(n, c) for n in NAMES if (w := writers(None)[n]).full_disk for c in w.cuts]


@pytest.mark.parametrize("writer, cut", _full_disk_cases(), ids=str)
def test_a_full_disk_leaves_the_previous_output(table, tmp_path, capsys, writer, cut):
    w = table[writer]
    d = _fresh(tmp_path / "target", w)
    written = d if w.previous else _fresh(tmp_path / "scratch", w)
    assert attempt(lambda: w.run(written, 0), capsys) is None  # how large its files get
    largest = max(len(b) for b in snapshot(written).values() if b is not None)
    before = snapshot(d)
    with file_size_limit(largest * cut // 10):
        error = attempt(lambda: w.run(d, 1), capsys)
    after = snapshot(d)
    if w.full_disk == "quiet":
        assert error is None, error
    else:
        assert error is not None and "no room" in error, error
    if w.record:  # the log holds whole lines only (those written before the disk filled)
        text = after.pop(w.record).decode()
        assert text == "" or text.endswith("\n")
        assert all(isinstance(json.loads(line), dict) for line in text.splitlines())
        before.pop(w.record, None)
    assert after == before, sorted(set(after) ^ set(before)) or "a file changed"


# ------------------------------------------------------------------------------ single cases
def test_a_prepared_output_deleted_during_data_prepare_is_one_line(tmp_path, capsys, monkeypatch):
    """The probe's case: OUT removed while the corpus is written (a FileNotFoundError traceback
    at the end, before)."""
    from bumblebee.data import store

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"input_ids": [3, 4, 5, 6]}) + "\n" for _ in range(50)))
    out = tmp_path / "out"
    append = store.StoreWriter.append

    def append_then_delete(self, *args):
        append(self, *args)
        shutil.rmtree(self.out_dir)

    monkeypatch.setattr(store.StoreWriter, "append", append_then_delete)
    error = attempt(lambda: prepare_argv(src, out), capsys)
    assert error is not None and "removed" in error and str(out) in error, error
    assert not out.exists()


def prepare_argv(src, out):
    return main(["data", "prepare", str(src), str(out), "--source", "tokens", "--no-progress"])


def test_a_full_disk_mid_append_cuts_the_record_back(tmp_path, monkeypatch):
    """ENOSPC after part of a line was written (what RLIMIT_FSIZE never does: it fails whole
    writes at a boundary): the record keeps its whole lines, the next append lands whole."""
    from bumblebee import safe_write
    from bumblebee.errors import DiskFullError

    log = safe_write.RecordFile(str(tmp_path / "m.jsonl"), initial='{"step": 0}\n')
    real = safe_write._write_all

    def half_then_full(fd, data):
        real(fd, bytes(data)[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safe_write, "_write_all", half_then_full)
    with pytest.raises(DiskFullError, match="no room"):
        log.append('{"step": 1, "loss": 1.5}\n')
    monkeypatch.setattr(safe_write, "_write_all", real)
    log.append('{"step": 1, "loss": 1.25}\n')
    log.close()
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 0}\n{"step": 1, "loss": 1.25}\n'


def test_a_link_swapped_in_while_writing_is_not_followed(tmp_path):
    """The checks and the write use one directory descriptor: a link planted after the file was
    opened (the race a predictable temporary lost) is refused at the rename, never written
    through, and the temporary goes; a directory in the file's place is one line too."""
    from bumblebee import safe_write

    victim = tmp_path / "victim"
    victim.write_text("outside")
    target = tmp_path / "d" / "config.toml"
    target.parent.mkdir()
    with pytest.raises(ConfigError, match="symbolic link"):
        with safe_write.AtomicFile(str(target)) as f:
            f.write("new")
            os.symlink(victim, target)
    assert victim.read_text() == "outside"
    assert os.listdir(target.parent) == ["config.toml"] and target.is_symlink()
    os.remove(target)
    target.mkdir()
    with pytest.raises(ConfigError, match="is a directory; give a file name"):
        safe_write.write_file(str(target), "x")
    assert os.listdir(target.parent) == ["config.toml"]


def test_links_above_the_root_are_the_users(tmp_path):
    """A run directory on a linked scratch disk is written as before; a link below it is not."""
    from bumblebee import safe_write

    real = tmp_path / "scratch"
    real.mkdir()
    os.symlink(real, tmp_path / "runs")
    safe_write.make_dirs(str(tmp_path / "runs" / "a" / "checkpoints"), root=str(tmp_path / "runs"))
    safe_write.write_file(str(tmp_path / "runs" / "a" / "config.toml"), "x")
    assert (real / "a" / "config.toml").read_text() == "x"
    os.symlink(tmp_path, real / "b")
    with pytest.raises(ConfigError, match="symbolic link"):
        safe_write.make_dirs(str(tmp_path / "runs" / "b" / "x"), root=str(tmp_path / "runs"))
    assert not (tmp_path / "x").exists()


def test_a_file_where_a_directory_goes_is_one_line(tmp_path, capsys):
    """``plan --plot f.txt/x.png`` (a traceback before); ``pair --json DIR`` and an image
    format matplotlib cannot write go through the same helper."""
    (tmp_path / "f.txt").write_text("x")
    argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--seq", "4096", "--layout", "ep=8"]
    error = attempt(lambda: main(argv + ["--plot", str(tmp_path / "f.txt" / "x.png")]), capsys)
    assert error is not None and "is a file, not a directory" in error, error
    error = attempt(lambda: main(argv + ["--plot", str(tmp_path / "plan.txt")]), capsys)
    assert error is not None and "not an image format" in error, error
    from bumblebee import safe_write

    with pytest.raises(ConfigError, match="is a directory"):
        safe_write.write_file(str(tmp_path), "{}")
    assert sorted(os.listdir(tmp_path)) == ["f.txt"]

"""What a run logs about its own speed and health, beside loss (metrics.jsonl and the progress line):

- ``tflops_per_gpu`` every step: the model's FLOPs per token (its ``ModelSpec``, as the planner
  counts them) x tokens / step time / ranks; ``mfu`` where the device's peak is known (a table
  of GPUs by name; none on the CPU);
- the ETA leaves the first step (start-up) out and reads h:mm:ss;
- a line for every checkpoint saved;
- a warning once routing has sat at the E/K ceiling of max/mean expert load for many steps;
- W&B logging (``train.wandb``) through a fake ``wandb`` module; without the package, one line
  naming ``pip install wandb`` before the run starts.
"""

import io
import json
import sys
import types

import pytest

from bumblebee.cli import main
from bumblebee.perf.flops import peak_tflops
from bumblebee.runtime import metrics as metrics_module
from bumblebee.runtime.metrics import MetricsWriter
from bumblebee.runtime.resolve import load_config
from bumblebee.runtime.trainer import Trainer

TINY = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=4",
    "model.arch.num_experts_per_tok=2",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "primitives.attention=sdpa",
    "train.seq_len=32",
    "train.global_batch=1",
    "data.min_records=1",
    "data.max_records=2",
    "train.warmup_steps=0",
    "train.eval_every=0",
]


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0  # the more specific row wins
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "float32") == 19.5
    assert peak_tflops("Some Future GPU", "bfloat16") is None


@pytest.fixture(scope="module")
def fake_peak_run(tmp_path_factory):
    """A tiny run on CPU, told its device peaks at 0.001 TFLOP/s, saving every step."""
    out = tmp_path_factory.mktemp("run")
    cfg = load_config(None, TINY + ["train.steps=3", "train.save_every=2", f"train.out_dir={out}"])
    stream = io.StringIO()
    mp = pytest.MonkeyPatch()
    mp.setattr("bumblebee.runtime.trainer.device_peak", lambda device, dtype: ("fake", 1e-3))
    try:
        trainer = Trainer(cfg, stream=stream)
        summary = trainer.run()
    finally:
        mp.undo()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return trainer, rows, stream.getvalue(), summary, out


def test_model_tflops_and_mfu_per_step(fake_peak_run):
    trainer, rows, text, summary, _ = fake_peak_run
    spec = trainer.model.arch.to_spec()
    per_token = spec.model_flops_per_token(32)
    for r in rows:
        assert r["tflops_per_gpu"] == pytest.approx(
            per_token * r["tokens"] / r["step_time_s"] / 1e12, rel=1e-9
        )
        assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 1e-3, rel=1e-9)
    progress = [line for line in text.splitlines() if line.startswith("[")]
    assert len(progress) == 3 and all("TFLOP/s/GPU" in line and "MFU " in line for line in progress)
    assert summary["mfu"] == pytest.approx(sum(r["mfu"] for r in rows[1:]) / 2)


def test_a_line_for_every_checkpoint_saved(fake_peak_run):
    _, _, text, _, out = fake_peak_run
    saved = [line for line in text.splitlines() if line.startswith("bumblebee: saved checkpoint")]
    assert saved == [
        f"bumblebee: saved checkpoint {out / 'checkpoints' / 'step_00000002'} (step 2)",
        f"bumblebee: saved checkpoint {out / 'checkpoints' / 'step_00000003'} (step 3)",
    ]


def test_cpu_reports_tflops_without_mfu(tmp_path):
    cfg = load_config(None, TINY + ["train.steps=1", f"train.out_dir={tmp_path}"])
    stream = io.StringIO()
    Trainer(cfg, stream=stream).run()
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["tflops_per_gpu"] > 0 and "mfu" not in row
    assert "TFLOP/s/GPU" in stream.getvalue() and "MFU" not in stream.getvalue()


def record(step: int, **extra) -> dict:
    return {
        "step": step,
        "loss": 1.0,
        "aux_loss": 0.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens": 32,
        "tokens_per_s": 1.0,
        "step_time_s": 1.0,
        "peak_mem_bytes": 0,
        **extra,
    }


def test_eta_leaves_start_up_out_and_reads_h_mm_ss(tmp_path, monkeypatch):
    clock = iter(
        [0.0, 100.0, 102.0, 104.0]
    )  # writer built at 0; step 1 ends after 100 s of start-up
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    w = MetricsWriter(str(tmp_path), total_steps=1803, stream=stream)
    for step in (1, 2, 3):
        w.log(record(step))
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("eta -")  # nothing measured after start-up yet
    assert lines[1].endswith("eta 1:00:02")  # 2 s/step x 1801 steps
    assert lines[2].endswith("eta 1:00:00")  # 2 s/step x 1800


def test_saturated_routing_warns_once(tmp_path):
    stream = io.StringIO()
    w = MetricsWriter(
        str(tmp_path), total_steps=100, stream=stream, expert_ceiling=4.0, log_every=1000
    )
    for step in range(1, 19):
        w.log(
            record(step, expert_load_max_over_mean=3.0, expert_load_worst_layer=0)
        )  # skewed, not saturated
    for step in range(19, 60):
        w.log(record(step, expert_load_max_over_mean=4.0, expert_load_worst_layer=1))
    warnings = [line for line in stream.getvalue().splitlines() if "warning" in line]
    assert len(warnings) == 1 and "routing has saturated: layer 1" in warnings[0]
    assert "router_aux_loss_coef" in warnings[0] and "sigmoid_bias" in warnings[0]
    quiet = io.StringIO()
    w = MetricsWriter(
        str(tmp_path / "b"), total_steps=100, stream=quiet, expert_ceiling=4.0, log_every=1000
    )
    for step in range(1, 60):
        w.log(record(step, expert_load_max_over_mean=3.5, expert_load_worst_layer=0))
    assert "warning" not in quiet.getvalue()


class FakeWandb(types.ModuleType):
    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        fake = self

        class Run:
            def log(self, data, step):
                fake.calls.append(("log", step, data))

            def finish(self):
                fake.calls.append(("finish",))

        return Run()


def test_wandb_logs_every_step(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "my-run"
    cfg = load_config(
        None,
        TINY
        + ["train.steps=2", "train.wandb=true", "train.wandb_project=proj", f"train.out_dir={out}"],
    )
    Trainer(cfg, stream=io.StringIO()).run()
    init, *logs, finish = fake.calls
    assert init[0] == "init" and init[1]["project"] == "proj" and init[1]["name"] == "my-run"
    assert init[1]["config"]["train"]["steps"] == 2
    assert [c[1] for c in logs] == [1, 2] and all(
        "loss" in c[2] and "tflops_per_gpu" in c[2] for c in logs
    )
    assert finish == ("finish",)


def test_wandb_missing_is_one_line_before_launch(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    assert (
        main(["train", "--set", "train.wandb=true", "--set", f"train.out_dir={tmp_path / 'r'}"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("bumblebee: error: train.wandb = true") and "pip install wandb" in err
    assert "\n" not in err and not (tmp_path / "r" / "metrics.jsonl").exists()


def test_convert_reports_tensors_written(fake_peak_run, tmp_path, monkeypatch, capsys):
    import itertools

    from bumblebee import console
    from bumblebee.runtime.checkpoint.export import export_checkpoint

    clock = itertools.count(0.0, 1.0)  # a slow clock: the progress line shows from the first tensor
    monkeypatch.setattr(console.time, "monotonic", lambda: next(clock))
    _, _, _, _, out = fake_peak_run
    export_checkpoint(str(out), str(tmp_path / "hf"))
    lines = capsys.readouterr().err.splitlines()
    done = [line for line in lines if "tensors written: done" in line]
    assert len(done) == 1 and "step_00000003" in done[0]
    n = done[0].split("(")[1].split("/")[0]
    assert done[0].endswith(f"({n}/{n}) in 0:00:{int(n) + 1:02d}") or f"({n}/{n})" in done[0]


def test_expert_ceiling_is_written_for_the_report(tmp_path):
    """E / K goes into metrics.jsonl beside the load figures (bumblebee report draws it)."""
    w = MetricsWriter(str(tmp_path), total_steps=2, stream=io.StringIO(), expert_ceiling=4.0)
    w.log(record(1, expert_load_max_over_mean=1.5, expert_load_worst_layer=0))
    dense = MetricsWriter(str(tmp_path / "dense"), total_steps=2, stream=io.StringIO())
    dense.log(record(1))
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["expert_ceiling"] == 4.0
    assert "expert_ceiling" not in json.loads((tmp_path / "dense" / "metrics.jsonl").read_text())

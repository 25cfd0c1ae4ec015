"""Per-step metrics (``metrics.jsonl``), the live progress line, and the run summary.

Only the writer on rank 0 is active; other ranks get a writer that drops
everything. ``metrics.jsonl`` is a ``safe_write.RecordFile``: each line lands whole and
fsynced as it is written (a crash loses at most the step in flight, a full disk is one line
and leaves no torn line), and no link planted in out_dir is written through.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import IO

from bumblebee import safe_write
from bumblebee.console import hms


class MetricsWriter:
    """``wandb``: ``wandb.init`` keyword arguments to also log every step's scalars to Weights &
    Biases (``train.wandb``), or None. ``expert_ceiling``: E / K, the highest max/mean expert load
    a layer can reach (every token on the same K experts); 0 when the model has no experts."""

    def __init__(
        self,
        out_dir: str | None,
        *,
        total_steps: int,
        log_every: int = 1,
        stream: IO = sys.stdout,
        first_step: int = 0,
        tensorboard: bool = False,
        wandb: dict | None = None,
        expert_ceiling: float = 0.0,
    ):
        self.active = out_dir is not None
        self.total_steps, self.log_every, self.stream = total_steps, max(log_every, 1), stream
        self.routing = RoutingWatch(expert_ceiling)
        self.tty = getattr(stream, "isatty", lambda: False)()
        self.history: list[dict] = []
        self.resumed: dict = {}
        self._file = None
        if self.active:
            safe_write.make_dirs(out_dir)
            self.path = os.path.join(out_dir, "metrics.jsonl")
            # a resumed run keeps the lines of the steps it continues from, and drops any
            # lines past the checkpoint (steps that will be recomputed)
            kept = _lines_up_to(self.path, first_step, stream) if first_step > 0 else []
            self.resumed = (
                json.loads(kept[-1]) if kept else {}
            )  # the record of the step resumed from
            self._file = safe_write.RecordFile(
                self.path, doing="write the metrics", initial="".join(kept)
            )
        # the same scalars as TensorBoard events (train.tensorboard; the [data] extra)
        self._tb = (
            tensorboard_writer(os.path.join(out_dir, "tensorboard"))
            if self.active and tensorboard
            else None
        )
        self._wandb = wandb_run(wandb) if self.active and wandb is not None else None
        self._start = time.perf_counter()
        self._steady = (
            None  # (time, step) when the run's first step was logged: the ETA leaves start-up out
        )

    def log(self, record: dict) -> None:
        if not self.active:
            return
        if self.routing.ceiling > 1 and "expert_load_max_over_mean" in record:
            record["expert_ceiling"] = (
                self.routing.ceiling
            )  # E / K: the report draws it as a reference line
        self.history.append(record)
        self._file.append(json_line(record) + "\n")
        scalars = {
            k: v
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(strict(scalars), step=record["step"])
        step = record["step"]
        if self._steady is None:
            self._steady = (time.perf_counter(), step)
        warning = self.routing.check(record)
        if warning:
            self.stream.write(f"bumblebee: warning: {warning}\n")
        if step % self.log_every == 0 or step == self.total_steps:
            self._progress(record)

    def _progress(self, r: dict) -> None:
        done = r["step"] / self.total_steps
        bar = "#" * int(20 * done) + "-" * (20 - int(20 * done))
        line = (
            f"[{bar}] step {r['step']}/{self.total_steps}  loss {r['loss']:.4f}  aux {r['aux_loss']:.3f}  "
            f"gnorm {r['grad_norm']:.3f}  lr {r['lr']:.2e}  {r['tokens_per_s']:.0f} tok/s  "
        )
        if "tflops_per_gpu" in r:
            line += f"{r['tflops_per_gpu']:.3g} TFLOP/s/GPU  "
        if "mfu" in r:
            line += f"MFU {r['mfu']:.1%}  "
        line += f"peak {r['peak_mem_bytes'] / 2**20:.0f} MiB  eta {self.eta(r['step'])}"
        if (
            r.get("expert_load_max_over_mean", 0.0) > 2.0
        ):  # a layer's busiest expert gets > 2x the mean
            line += f"  load max/mean {r['expert_load_max_over_mean']:.1f} (layer {r['expert_load_worst_layer']})"
        if "eval_loss" in r:
            line += f"  eval_loss {r['eval_loss']:.4f}"
        if "eval_accuracy" in r:
            line += f"  eval_accuracy {r['eval_accuracy']:.2f}"
        if self.tty:
            end = "\n" if r["step"] == self.total_steps else ""
            self.stream.write("\r\033[K" + line + end)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def eta(self, step: int, now: float | None = None) -> str:
        """Time to ``total_steps`` as h:mm:ss, from the steps after the first one this writer logged
        (which carries start-up: compilation, allocator warm-up, the first data reads); '-' before
        there is such a step."""
        if self._steady is None or step <= self._steady[1]:
            return "-" if step < self.total_steps else hms(0)
        t0, s0 = self._steady
        per_step = ((time.perf_counter() if now is None else now) - t0) / (step - s0)
        return hms(per_step * (self.total_steps - step))

    def summary(self) -> dict:
        """Aggregate figures of the run (also printed by ``close``)."""
        skipped = sum(bool(r.get("skipped")) for r in self.history)
        h = [
            r for r in self.history if not r.get("skipped")
        ]  # steps without a loss token trained nothing
        if not h:
            return {"steps": 0, "skipped_steps": skipped} if skipped else {}
        k = max(1, len(h) // 10)
        first = sum(r["loss"] for r in h[:k]) / k
        last = sum(r["loss"] for r in h[-k:]) / k
        steady = h[1:] if len(h) > 1 else h  # the first step includes warm-up
        evals = [r for r in h if "eval_accuracy" in r]
        last_eval = {k: v for k, v in evals[-1].items() if k.startswith("eval_")} if evals else {}
        rates = {
            k: sum(r[k] for r in steady) / len(steady)
            for k in ("tflops_per_gpu", "mfu")
            if all(k in r for r in steady)
        }  # mean over the steps after the first
        return {
            **last_eval,
            **rates,
            "steps": len(h),
            "loss_first": first,
            "loss_last": last,
            "tokens_per_s": sum(r["tokens"] for r in steady)
            / sum(r["step_time_s"] for r in steady),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for r in h),
            "wall_time_s": time.perf_counter() - self._start,
            "skipped_steps": skipped,
        }

    def close(self) -> dict:
        s = self.summary()
        if self.active and s.get("skipped_steps"):
            self.stream.write(
                f"bumblebee: note: {s['skipped_steps']} step(s) skipped: their global batch had no "
                "loss token (all loss_mask false or one-token documents)\n"
            )
        if self.active and s.get("steps"):
            self.stream.write(
                f"done: {s['steps']} steps in {s['wall_time_s']:.1f}s; loss {s['loss_first']:.4f} -> "
                f"{s['loss_last']:.4f} (mean of first/last 10%); {s['tokens_per_s']:.0f} tok/s; "
                + (f"{s['tflops_per_gpu']:.3g} TFLOP/s/GPU; " if "tflops_per_gpu" in s else "")
                + (f"MFU {s['mfu']:.1%}; " if "mfu" in s else "")
                + f"peak {s['peak_mem_bytes'] / 2**20:.0f} MiB; metrics in {self.path}\n"
            )
            if "eval_accuracy" in s:
                self.stream.write(
                    f"held-out retrieval accuracy {s['eval_accuracy']:.2f} (exact match of the answers; "
                    f"eval loss {s['eval_loss']:.3f}) at distance {_tokens(s['eval_distance_min'])}-"
                    f"{_tokens(s['eval_distance_max'])} tokens\n"
                )
            self.stream.flush()
        if self._file:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        return s


class RoutingWatch:
    """Warns once when routing has saturated: a layer's busiest expert at the E/K ceiling of
    max/mean load (every token of the step sent to the same K experts) for ``patience`` steps in
    a row. The balance loss cannot pull such a router back once its scores have collapsed, and
    the loss curve alone does not show it (the model trains as a dense one of K experts)."""

    def __init__(self, ceiling: float, patience: int = 20, near: float = 0.95):
        self.ceiling, self.patience, self.near = ceiling, patience, near
        self.run, self.warned = 0, False

    def check(self, record: dict) -> str:
        load = record.get("expert_load_max_over_mean")
        if self.ceiling <= 1 or load is None or self.warned:
            return ""
        self.run = self.run + 1 if load >= self.near * self.ceiling else 0
        if self.run < self.patience:
            return ""
        self.warned = True
        return (
            f"routing has saturated: layer {record.get('expert_load_worst_layer')}'s busiest expert has had "
            f"max/mean load {load:.1f} (the E/K ceiling, {self.ceiling:g}: every token on the same experts) "
            f"for {self.run} steps; what helps: a larger model.arch.router_aux_loss_coef (balance loss), "
            f"a lower train.lr or a longer train.warmup_steps, moe.capacity_factor > 0 (drops the overflow), "
            f"or primitives.router = 'sigmoid_bias' (bias balancing, moe.bias_update_rate)"
        )


def wandb_init(cfg) -> dict:
    """``wandb.init`` arguments of a run: its project, named after its out_dir, its resolved config."""
    t = cfg.train
    return {
        "project": t.wandb_project,
        "name": os.path.basename(os.path.normpath(t.out_dir)),
        "dir": t.out_dir,
        "config": cfg.to_dict(),
    }


def tensorboard_writer(log_dir: str):
    """A ``torch.utils.tensorboard.SummaryWriter``, or one line naming the extra when missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from bumblebee.config import ConfigError

        raise ConfigError(
            "train.tensorboard = true needs the optional package 'tensorboard': "
            "pip install 'bumblebee[data]'"
        ) from None
    return SummaryWriter(log_dir=log_dir)


def wandb_run(init: dict):
    """``wandb.init(**init)`` (W&B is an optional extra, imported here, not at start)."""
    return import_wandb().init(**init)


def import_wandb():
    """The ``wandb`` module, or one line naming the package when it is not installed (the
    launch checks call this too, so a missing package stops the run before any rank starts)."""
    try:
        import wandb
    except ImportError:
        from bumblebee.config import ConfigError

        raise ConfigError(
            "train.wandb = true needs the optional package 'wandb': pip install wandb "
            "(or pip install 'bumblebee[wandb]')"
        ) from None
    return wandb


def strict(value):
    """``value`` with every non-finite float (a diverged loss, an infinite grad norm), at any
    depth of dicts, lists and tuples, replaced by None: strict JSON has no NaN / Infinity."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def json_line(record: dict) -> str:
    """One record as strict JSON (non-finite numbers written as null)."""
    return json.dumps(strict(record), allow_nan=False)


def _lines_up_to(path: str, step: int, stream: IO) -> list[str]:
    """The lines of an earlier ``metrics.jsonl`` for steps <= ``step`` (a resumed run keeps
    them). A line that is not a JSON object with an integer step (a torn last line from a
    crash) is dropped with a notice instead of blocking the resume."""
    if not os.path.exists(path):
        return []
    kept, dropped = [], 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                rec = json.loads(raw)
                ok = isinstance(rec, dict) and isinstance(rec.get("step"), int)
            except (UnicodeDecodeError, json.JSONDecodeError):
                ok = False
            if not ok:
                dropped += bool(raw.strip())
            elif rec["step"] <= step:
                kept.append(raw.decode().rstrip("\n") + "\n")
    if dropped:
        stream.write(
            f"bumblebee: note: dropped {dropped} unreadable line(s) of {path} (a torn write)\n"
        )
    return kept


def _tokens(n: int) -> str:
    return f"{n / 1024:.1f}K" if n >= 1024 else str(n)


def finite(x: float) -> float:
    return x if math.isfinite(x) else float("nan")

"""Running a pair (``bumblebee pair``): two Trainers side by side, compared step by step.

Every rank runs ``execute``: it builds side a's and side b's ``Trainer`` (same
seed; the initial weights are compared by hash and must agree), then for each
step runs

  1. a no-grad probe forward of each model on the step's first micro-batch, with
     its current weights: the per-token log-probs of the labels through that
     side's loss primitive, and the outputs of the hooked modules;
  2. ``Trainer.train_step()`` of side a, then of side b (the trainer measures the
     step's time and its peak live memory with ``MemoryTracker``; the probe is
     outside both).

With pp > 1 a rank holds only its pipeline stages, so there is no probe: loss,
grad norm, memory, time and the weights (gathered over the pipeline) are compared.

Differences are computed on each rank and reduced over ranks (max of the
absolute differences and magnitudes, bits identical only if identical on every
rank), so every rank holds the same rows; rank 0 prints them. Multi-process
pairs start through ``launch.launch_local`` with ``_worker``; rank 0 writes the
result to a file the parent process reads.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import IO

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from bumblebee import safe_write
from bumblebee.config import Config, ConfigError
from bumblebee.data import Batch
from bumblebee.models import build_model, resolve_arch
from bumblebee.primitives.sharding.common import full_named_parameters
from bumblebee.runtime.launch.launcher import init_distributed, launch_local
from bumblebee.runtime.pair.verdict import check, format_rows, summarize
from bumblebee.runtime.step import micro_batches
from bumblebee.runtime.trainer import Trainer

MiB = 2**20
IGNORE = -100


@dataclass
class PairJob:
    slot: str
    a: str
    b: str
    cfg_a: Config
    cfg_b: Config
    rtol: float
    hooks: list = field(default_factory=list)  # module names (resolved by ``hook_names``)
    probe: bool = True  # False with pp > 1: the model is split into stages
    diff: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    nproc: int = 1
    result_path: str | None = None


def hook_names(cfg: Config, requested: list[str]) -> list[str]:
    """Validate ``--hook`` names on a meta-device model, or pick the default ones: the first,
    middle and last decoder layer and the final norm."""
    with torch.device("meta"):
        modules = dict(build_model(resolve_arch(cfg.model), cfg.primitives).named_modules())
    layers = [n for n in modules if re.fullmatch(r"model\.layers\.\d+", n)]
    for name in requested:
        if name not in modules:
            raise ConfigError(
                f"--hook {name!r}: no such module; e.g. {', '.join(layers[:2] + ['model.norm'])}"
            )
    if requested:
        return list(requested)
    picks = sorted({0, len(layers) // 2, len(layers) - 1}) if layers else []
    return [layers[i] for i in picks] + (["model.norm"] if "model.norm" in modules else [])


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (bit-for-bit identity)."""
    return hashlib.sha256(
        t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    ).hexdigest()


# ------------------------------------------------------------------------------ probe and step
def first_micro_batch(trainer: Trainer) -> Batch:
    """The first micro-batch this rank trains on in the trainer's next step."""
    return micro_batches(trainer.rank_batch(), trainer.cfg.train.micro_batch)[0]


@torch.no_grad()
def probe(trainer: Trainer, names: list[str]) -> dict[str, torch.Tensor]:
    """Per-token log-probs ("logprobs") and hooked module outputs (fp32 copies) of a no-grad
    forward through ``loss_terms``, the entry point the training step uses."""
    model = trainer.model
    captured: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())

    def hook(name):
        def fn(_module, _inputs, out):
            if name not in captured:  # the first call (a recomputing policy may call again)
                t = out[0] if isinstance(out, (tuple, list)) else out
                captured[name] = t.detach().float().clone()

        return fn

    inner = model.head_loss

    def per_token(hidden_TH, weight_VH, labels_T, **kwargs):
        loss_T = inner(hidden_TH, weight_VH, labels_T, **{**kwargs, "reduction": "none"})
        captured["logprobs"] = -loss_T.detach().float()[labels_T != IGNORE]
        return loss_T.sum()

    handles = [modules[n].register_forward_hook(hook(n)) for n in names]
    model.head_loss = per_token
    try:
        mb = first_micro_batch(trainer)
        with trainer.autocast:
            model.loss_terms(mb.input_ids, mb.labels, mb.position_ids)
    finally:
        model.head_loss = inner
        for h in handles:
            h.remove()
    return captured


def measured_step(trainer: Trainer) -> dict:
    """One ``train_step``: its metrics record, with the peak live memory of the most loaded rank
    (``peak_mem_bytes``, the trainer's MemoryTracker) and the step time. Logged to metrics.jsonl."""
    rec = trainer.train_step()
    trainer.metrics.log(rec)
    return rec


# ------------------------------------------------------------------------------ comparison
class Reducer:
    """Reductions of per-rank figures over all ranks (no-ops on one process)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.on = dist.is_initialized() and dist.get_world_size() > 1

    def __call__(self, values: list[float], op) -> list[float]:
        if not self.on:
            return values
        t = torch.tensor(
            [math.inf if math.isnan(v) else v for v in values],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(t, op=op)
        return t.tolist()

    def tensors(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float, float, bool]:
        """(max|x-y|, max|x|, max|y|, ||x-y|| / max(||x||, ||y||), bit-identical) over all ranks
        (each rank holds different tokens: squares are summed, maxima taken)."""
        if x.shape != y.shape:
            maxes, squares, same = [math.inf] * 3, [math.inf, 1.0, 1.0], 0.0
        else:
            same = float(digest(x) == digest(y))
            x, y = x.double(), y.double()
            maxes = [float(t.abs().max()) if t.numel() else 0.0 for t in (x - y, x, y)]
            squares = [float(t.pow(2).sum()) for t in (x - y, x, y)]
        d, mx, my = self(maxes, dist.ReduceOp.MAX)
        sq_d, sq_x, sq_y = self(squares, dist.ReduceOp.SUM)
        return (
            d,
            mx,
            my,
            _rel(math.sqrt(sq_d), math.sqrt(max(sq_x, sq_y))),
            bool(self([same], dist.ReduceOp.MIN)[0]),
        )


def _rel(diff: float, scale: float) -> float:
    if diff == 0:
        return 0.0
    if math.isnan(diff) or math.isnan(scale):
        return math.inf
    return diff / scale if scale > 0 and math.isfinite(scale) else math.inf


def tensor_row(step, name: str, stats) -> dict:
    d, mx, my, rel, same = stats
    return {
        "step": step,
        "quantity": name,
        "kind": "tensor",
        "a": mx,
        "b": my,
        "ratio": None,
        "max_abs": d,
        "rel": rel,
        "identical": same,
        "checked": True,
    }


def scalar_row(step, name: str, a: float, b: float) -> dict:
    d = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
    return {
        "step": step,
        "quantity": name,
        "kind": "scalar",
        "a": a,
        "b": b,
        "ratio": b / a if a else None,
        "max_abs": d,
        "rel": _rel(d, max(abs(a), abs(b))),
        "identical": a == b,
        "checked": True,
    }


def measure_row(step, name: str, kind: str, a: float, b: float) -> dict:
    return {
        "step": step,
        "quantity": name,
        "kind": kind,
        "a": a,
        "b": b,
        "ratio": b / a if a else None,
        "max_abs": None,
        "rel": None,
        "identical": None,
        "checked": False,
    }


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter of the model, unsharded, on every rank (collective). With pp > 1 each
    rank holds its stages' layers only: the pipeline ranks' parameters are gathered (on the host)."""
    weights = dict(
        full_named_parameters(trainer.model, trainer.ctx.ep_group, trainer.ctx.layout.ep)
    )
    if getattr(trainer, "pipeline", None) is not None:
        parts: list = [None] * trainer.ctx.layout.pp
        dist.all_gather_object(
            parts, {n: t.cpu() for n, t in weights.items()}, group=trainer.ctx.pp_group
        )
        weights = {n: t for part in parts for n, t in part.items()}
    return weights


def compare_weights(
    ta: Trainer, tb: Trainer
) -> tuple[tuple[float, float, float, float, bool], str, str]:
    """Full (unsharded) parameters of both sides: (max|a-b|, max|a|, max|b|, ||a-b|| / max(||a||, ||b||)
    over all parameters, identical) and the two digests. Collective."""
    wa, wb = full_weights(ta), full_weights(tb)
    if {n: tuple(t.shape) for n, t in wa.items()} != {n: tuple(t.shape) for n, t in wb.items()}:
        raise ConfigError(
            "the two implementations hold different parameters (names or shapes); "
            "a pair needs the same weights on both sides"
        )
    ha, hb = hashlib.sha256(), hashlib.sha256()
    d = mx = my = sq_d = sq_x = sq_y = 0.0
    for name in sorted(wa):
        ha.update(digest(wa[name]).encode())
        hb.update(digest(wb[name]).encode())
        x, y = wa[name].double(), wb[name].double()
        if x.numel():
            d, mx, my = (
                max(d, float((x - y).abs().max())),
                max(mx, float(x.abs().max())),
                max(my, float(y.abs().max())),
            )
            sq_d, sq_x, sq_y = (
                sq_d + float((x - y).pow(2).sum()),
                sq_x + float(x.pow(2).sum()),
                sq_y + float(y.pow(2).sum()),
            )
    d = math.inf if math.isnan(d) else d
    rel = _rel(math.sqrt(sq_d), math.sqrt(max(sq_x, sq_y)))
    return (d, mx, my, rel, ha.hexdigest() == hb.hexdigest()), ha.hexdigest(), hb.hexdigest()


# ------------------------------------------------------------------------------ the pair
def execute(job: PairJob, stream: IO) -> dict:
    """Run both sides for ``train.steps`` steps; print the table on rank 0; return the result."""
    ta = Trainer(job.cfg_a, stream=io.StringIO())
    tb = Trainer(job.cfg_b, stream=io.StringIO())
    out = stream if ta.rank == 0 else io.StringIO()
    reduce = Reducer(ta.device)
    (*_, same), ha, _ = compare_weights(ta, tb)
    if not same:
        raise ConfigError(
            f"initial weights differ between {job.a} and {job.b} (same seed): the implementations "
            "initialize differently; a pair needs the same weights"
        )
    t = job.cfg_a.train
    out.write(
        f"pair {job.slot}: a = {job.a}, b = {job.b}; {t.steps} step(s); {ta.ctx.layout.describe()}; "
        f"{ta.device.type}; {t.dtype}; deterministic {'on' if t.deterministic else 'off'}; "
        f"tolerance rel <= {job.rtol:g}\ninitial weights: identical (sha256 {ha[:12]}); metrics.jsonl in "
        f"{job.cfg_a.train.out_dir} and {job.cfg_b.train.out_dir}\n\n"
    )
    rows: list[dict] = []
    for step in range(1, t.steps + 1):
        pa, pb = (probe(ta, job.hooks), probe(tb, job.hooks)) if job.probe else ({}, {})
        ra, rb = measured_step(ta), measured_step(tb)
        step_rows = [
            scalar_row(step, "loss", ra["loss"], rb["loss"]),
            scalar_row(step, "grad_norm", ra["grad_norm"], rb["grad_norm"]),
        ]
        step_rows += [
            tensor_row(step, name, reduce.tensors(pa[name], pb[name]))
            for name in ["logprobs", *job.hooks]
            if name in pa
        ]
        times = reduce(
            [ra["step_time_s"], rb["step_time_s"]], dist.ReduceOp.MAX
        )  # the slowest rank's
        step_rows += [
            measure_row(
                step,
                "peak_mem_MiB",
                "memory",
                ra["peak_mem_bytes"] / MiB,
                rb["peak_mem_bytes"] / MiB,
            ),
            measure_row(step, "step_time_s", "time", times[0], times[1]),
        ]
        check(step_rows, job.rtol)
        out.write(format_rows(step_rows, job.a, job.b, header=step == 1) + "\n\n")
        out.flush()
        rows += step_rows
    stats, ha, hb = compare_weights(ta, tb)
    end = tensor_row(None, "weights", stats)
    rows.append(end)
    failures = check(rows, job.rtol)
    out.write(format_rows([end], job.a, job.b, header=False) + "\n")
    result = {
        "slot": job.slot,
        "a": job.a,
        "b": job.b,
        "steps": t.steps,
        "nproc": ta.ctx.layout.world,
        "layout": ta.ctx.layout.describe(),
        "device": ta.device.type,
        "dtype": t.dtype,
        "deterministic": t.deterministic,
        "tolerance": job.rtol,
        "config_diff": [list(d) for d in job.diff],
        "notes": job.notes,
        "hooks": job.hooks,
        "weights_sha256": {"a": ha, "b": hb},
        "rows": rows,
        "failures": failures,
        "passed": not failures,
    }
    if all(r["identical"] for r in rows if r["checked"]) and job.a != job.b:
        out.write(
            "note: the two runs are bit-identical: the implementations agree exactly here, "
            "or this configuration does not exercise the slot\n"
        )
    out.write(summarize(result) + "\n")
    out.flush()
    ta.metrics.close()
    tb.metrics.close()
    if ta.rank == 0 and job.result_path:
        safe_write.write_file(job.result_path, json.dumps(result), durable=False)
    return result


@record  # the elastic agent reports a worker's exception with its rank
def _worker(job: PairJob) -> None:
    init_distributed()
    try:
        execute(job, sys.stdout)
    finally:
        dist.destroy_process_group()


def launch(job: PairJob) -> dict | None:
    """Run the pair on ``job.nproc`` local ranks; the result, or None if a rank failed."""
    with tempfile.TemporaryDirectory() as tmp:
        job.result_path = os.path.join(tmp, "result.json")
        if launch_local(job, job.nproc, worker=_worker) != 0 or not os.path.exists(job.result_path):
            return None
        with open(job.result_path) as f:
            return json.load(f)

"""Dry run: one rank of the candidate's layout runs a training step of the real model code on
fake tensors, at the target world size, and its memory is measured term by term.

What runs, for the rank with coordinate 0 in every group of the stage the analytic model
says needs most (``world / pp * stage``):
- a fake process group (``torch.testing._internal.distributed.fake_pg``) of the layout's
  world size, the runtime's own meshes (``runtime/mesh.build_context``) and process groups;
  collectives return at once without moving data;
- the model of that stage as the runtime builds it (``keep_stages``), its ``E / ep`` local
  experts, bf16 parameters, the configured primitives: CP ring attention with its K/V
  exchange, the Gated DeltaNet CP scan (halo, transition all-gather), the MoE dispatch
  (``alltoall`` / ``chunked``) with its count exchange and uneven all-to-alls, recompute,
  and the loss;
- the kernels CUDA would run (``kernel_choice.assume("cuda", fla=True)``: ``varlen_attn``, FLA's
  chunk kernel through its fake op, ``_grouped_mm``, the linear CE's CUDA tiles), on fake CPU
  tensors (a CPU build cannot record autograd on fake CUDA tensors);
- 1F1B's steady state: ``min(pp - s, m)`` micro-batch forwards kept in flight, then the
  backward of the oldest (the peak), then the optimizer step (fp32 master and Adam moments,
  foreach-style temporaries), gradients preallocated (a steady-state step).

Labels: a checkpoint recomputes a layer inside whichever backward node first unpacks its
tensors (for Qwen3-MoE the MoE's); that recompute is labelled as the layer's ("recompute", the
mixer's and dispatch's own code keep theirs), and the mixer's backward is labelled from hooks
on the first forward's graph (the one backward walks).

Routing is an assumption (values do not exist): balanced counts, or ``skew`` x the fair
share for this rank's experts (``plan/fakerun.py`` carries the integer values the code
reads). Not run: tensor parallelism (no TP runtime; tp folds into dp), the sharding
primitive (FSDP2 / ZeRO wrappers: the static state is the unsharded 16 B/param, compared
with the same arithmetic), pipeline send/recv, kernel workspaces (fake kernels allocate
only outputs). Documents: one per sequence, or (``doc_len``, ``plan --dry-run --doc-len N``)
back-to-back documents of N tokens, as a packed corpus of short documents gives (the synthetic
task's curriculum starts at 16 tokens).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from contextlib import ExitStack

import torch

from bumblebee.config import ConfigError, PrimitivesConfig
from bumblebee.console import Progress
from bumblebee.plan.dryrun_result import TERMS, DryRunResult
from bumblebee.plan.fakerun import DataDependent, FakeRun, make_routing
from bumblebee.plan.hardware import GB
from bumblebee.plan.layout import Layout, Workload
from bumblebee.plan.memory import in_flight, local_tokens, stage_layers
from bumblebee.plan.recipe import Candidate
from bumblebee.plan.spec import ModelSpec
from bumblebee.plan.timeline import stage_timeline


def _arch(hf: dict):
    from bumblebee.models import FAMILIES, arch_from_hf_dict
    from bumblebee.models.family import family_of_model_type

    mt = hf.get("model_type")
    if family_of_model_type(mt) is None:
        raise ConfigError(
            f"--dry-run: model family of model_type {mt!r} is not implemented in bumblebee.models "
            f"yet (implemented: {', '.join(FAMILIES)}); the analytic estimate stands alone"
        )
    return arch_from_hf_dict(hf)


def _prims(p: PrimitivesConfig) -> PrimitivesConfig:
    """The candidate's choices with the implementations whose CUDA kernels the analytic model
    assumes; the sharding wrappers are not run."""
    modules = (
        ["norm", "attn_core", "moe_act", "linear_attn_core"] if p.recompute == "selective" else []
    )
    return dataclasses.replace(
        p,
        attention="varlen",
        cp_attention="ring",
        linear_attention="chunked",
        experts="grouped",
        recompute_modules=modules,
        sharding="none",
    )


def _seams(stack: ExitStack, docs, run: FakeRun) -> None:
    """The runtime's own code on fake CPU tensors: kernels chosen for CUDA with FLA present, the
    documents stated (fake position ids hold no values), recompute forwards labelled."""
    import torch.nn.attention.varlen  # noqa: F401  (registers the flash ops' fake kernels)

    from bumblebee.primitives import kernel_choice, packed, recompute
    from bumblebee.primitives.attention import dsa_cp

    stack.enter_context(kernel_choice.assume("cuda", fla=True))
    stack.enter_context(dsa_cp.assume_every_key())  # DSA's CP fetch: no selection values
    stack.enter_context(packed.assume_documents(docs))
    stack.enter_context(recompute.observe(lambda: _recompute_scope(run)))


@contextlib.contextmanager
def _recompute_scope(run: FakeRun):
    """A checkpoint's recompute forward (it runs inside whichever backward node first unpacks the
    layer's tensors) allocates under "recompute", the mixer's and the dispatch's under their own
    labels; the interrupted label comes back when it ends (also when torch stops it early)."""
    depth = len(run.stack)
    run.stack.append(run.label)
    run.label = "recompute"
    try:
        yield
    finally:
        del run.stack[depth + 1 :]
        run.label = run.stack.pop()


class _Scoped:
    """Runs ``fn`` under the label ``name``; in backward, the same label from the output's
    gradient node until the input's gradient is complete."""

    def __init__(self, fn, run: FakeRun, name: str, arg: int = 0):
        self.fn, self.run, self.name, self.arg = fn, run, name, arg

    def __call__(self, *args, **kwargs):
        prev, self.run.label = self.run.label, self.name
        try:
            out = self.fn(*args, **kwargs)
        finally:
            self.run.label = prev
        x = args[self.arg]
        if torch.is_grad_enabled() and out.grad_fn is not None and x.requires_grad:
            out.grad_fn.register_prehook(lambda g: setattr(self.run, "label", self.name))
            x.register_hook(lambda g: setattr(self.run, "label", "backward"))
        return out


@torch.no_grad()
def _adamw_foreach(params, state, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, wd=0.01) -> None:
    """One mixed-precision AdamW step as torch's foreach implementation allocates it: in-place
    updates of the fp32 master and moments, one fp32 ``sqrt(v)`` list for all parameters."""
    master, m, v = ([state[id(p)][i] for p in params] for i in range(3))
    grads = [p.grad.float() if p.grad.dtype != torch.float32 else p.grad for p in params]
    torch._foreach_lerp_(m, grads, 1 - betas[0])
    torch._foreach_mul_(v, betas[1])
    torch._foreach_addcmul_(v, grads, grads, 1 - betas[1])
    del grads
    denom = torch._foreach_sqrt(v)
    torch._foreach_add_(denom, eps)
    torch._foreach_mul_(master, 1 - lr * wd)
    torch._foreach_addcdiv_(master, m, denom, -lr)
    del denom
    for p, w in zip(params, master):
        p.copy_(w)


def dry_run(
    spec: ModelSpec,
    hf: dict,
    cand: Candidate,
    work: Workload,
    *,
    skew: float = 1.0,
    doc_len: int = 0,
) -> DryRunResult:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from bumblebee.models import build_model
    from bumblebee.primitives import packed
    from bumblebee.primitives.parallel import ParallelGroups
    from bumblebee.runtime import mesh

    start = time.perf_counter()
    lay, notes = cand.layout, []
    if lay.tp > 1:
        notes.append(f"tp={lay.tp} not run (no tensor-parallel runtime): folded into dp")
        lay = Layout(tp=1, pp=lay.pp, ep=lay.ep, cp=lay.cp, dp_shard=lay.dp_shard * lay.tp)
    prims = dataclasses.replace(cand.prims, sharding="none")
    analytic = stage_timeline(spec, lay, prims, work, skew)
    s = max(range(len(analytic)), key=lambda i: analytic[i].peak.total)
    layers = stage_layers(spec, lay.pp)[s]
    t, inflight = local_tokens(work, lay), in_flight(work, lay, s)
    if cand.prims.sharding != "none":
        notes.append(f"{cand.prims.sharding} wrappers not run: unsharded 16 B/param static state")
    if dist.is_initialized():
        raise ConfigError("--dry-run needs a process without torch.distributed initialized")
    arch = _arch(hf)

    def docs(
        pos,
    ):  # documents are data: one per sequence, or back-to-back documents of doc_len tokens
        T = pos.shape[1]
        row = tuple(range(0, T, doc_len)) + (T,) if 0 < doc_len < T else (0, T)
        return packed.DocLayout(bounds=(row,) * pos.shape[0], seq_len=T)

    if doc_len:
        notes.append(f"documents of {doc_len} tokens")
    run = FakeRun(make_routing(skew, spec.experts // lay.ep, lay.ep))
    dist.init_process_group(
        "fake", store=FakeStore(), rank=lay.world // lay.pp * s, world_size=lay.world
    )
    progress = Progress(
        f"plan --dry-run: stage {s} ({len(layers)} layers, fake tensors), layer passes"
    )
    try:
        with progress, ExitStack() as stack:
            _seams(stack, docs, run)
            ctx = mesh.build_context(lay, torch.device("cpu"), fake=True)
            groups = ParallelGroups(
                ep_group=ctx.ep_group if lay.ep > 1 else None, cp_group=ctx.cp_group
            )
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))
            stack.enter_context(run)
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                model = build_model(arch, _prims(prims), groups)
            finally:
                torch.set_default_dtype(old)
            if lay.pp > 1:
                # the spec counts MTP modules as layers after the decoder's (plan/spec.py): the model
                # holds them as its MTP part, run by the last stage's loss_terms
                model.keep_stages({s: [i for i in layers if i < arch.num_hidden_layers]}, lay.pp)
            params = [p for p in model.parameters() if p.requires_grad]
            run.relabel(params, "parameters")
            state = {
                id(p): (
                    p.float(),
                    torch.zeros_like(p, dtype=torch.float32),
                    torch.zeros_like(p, dtype=torch.float32),
                )
                for p in params
            }
            run.relabel([x for v in state.values() for x in v], "optimizer")
            for p in params:
                p.grad = torch.zeros_like(p)
            run.relabel([p.grad for p in params], "gradients")
            progress.update(0, note="model built")
            _instrument(model, run, layers, progress)
            _step(model, run, s, lay.pp, inflight, t, spec.hidden, work.micro_batch)
            run.set_phase("optimizer")
            run.label = "optim_temp"
            _adamw_foreach(params, state)
            static = sum(run.by_label.get(k, 0) for k in ("parameters", "gradients", "optimizer"))
    except DataDependent as e:
        raise ConfigError(
            f"--dry-run: the model code reads tensor values the run cannot supply ({e}); "
            f"the analytic estimate stands alone"
        ) from None
    finally:
        dist.destroy_process_group()
    n_local = sum(p.numel() for p in params)
    moments = dict(analytic[s].moments)
    moments.update(analytic[s].parts)
    terms = {}
    for key in (
        "forward",
        "forward:mixer",
        "forward:moe",
        "backward",
        "backward:moe",
        "backward:mixer",
        "loss",
        "optimizer",
    ):
        if key not in moments or key not in run.peaks:
            continue
        terms[key] = {
            k: (v / GB, getattr(moments[key], k) / GB) for k, v in _measured(run, key).items()
        }
    return DryRunResult(
        s,
        lay.short(),
        skew,
        terms,
        (static / GB, 16 * n_local / GB),
        notes,
        time.perf_counter() - start,
        dict(run.collectives),
    )


def _instrument(model, run: FakeRun, layers, progress=None) -> None:
    """Labels: each decoder layer's forward "fwd<mb>:L<i>", the MoE dispatch "moe", the loss "loss";
    ``progress`` counts every layer pass (forward, recomputed forward) for the progress line."""
    blocks = list(model.model.layers) + (model.mtp_units() if model.mtp is not None else [])
    for i in layers:
        layer = blocks[
            i
        ]  # past the decoder's layers: an MTP module (plan/spec.py counts them as layers)

        def pre(mod, args, i=i):
            if progress is not None:
                progress.update(note=f"{run.phase} of layer {i}")
            if run.phase == "forward":
                run.label = run.layer = f"fwd{run.mb}:L{i}"
            else:
                run.layer = f"L{i}"

        layer.register_forward_pre_hook(pre)
        for name in ("self_attn", "linear_attn"):  # the token mixer's backward: label "mixer"
            mixer = getattr(layer, name, None)
            if mixer is not None:
                mixer.register_forward_pre_hook(lambda mod, args: _enter(run, args))
                mixer.register_forward_hook(lambda mod, args, out: _leave(run, args, out))
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "dispatch"):
            mlp.dispatch = _Scoped(mlp.dispatch, run, "moe")
    model.head_loss = _Scoped(model.head_loss, run, "loss")
    if model.model.norm is not None:  # the final norm's output belongs to the loss moment
        model.model.norm.register_forward_pre_hook(
            lambda mod, args: setattr(run, "label", f"fwd{run.mb}:head")
        )


def _enter(run: FakeRun, args) -> None:
    """The mixer's (re)forward runs under "mixer"; the label it interrupts comes back after it
    (a recompute runs inside whatever backward node first unpacked the layer's tensors)."""
    run.stack.append(run.label)
    if run.phase in ("forward", "backward"):
        run.label = "mixer"


def _leave(run: FakeRun, args, out) -> None:
    run.label = run.stack.pop() if run.stack else run.label
    if run.phase != "forward":  # the backward walks the first forward's graph (not a recompute's)
        return
    y = out[0] if isinstance(out, tuple) else out
    x = next((a for a in args if isinstance(a, torch.Tensor) and a.requires_grad), None)
    if torch.is_grad_enabled() and y.grad_fn is not None and x is not None:
        y.grad_fn.register_prehook(lambda g: setattr(run, "label", "mixer"))
        x.register_hook(lambda g: setattr(run, "label", "backward"))


def _step(
    model, run: FakeRun, s: int, pp: int, inflight: int, t: int, hidden: int, mb: int
) -> None:
    first, last = s == 0, s == pp - 1
    stage = s if pp > 1 else None
    outs = []
    run.set_phase("forward")
    for j in range(inflight):
        run.mb, run.label = j, f"fwd{j}:in"
        width = (
            hidden * (1 + model.mtp_depth) if model.pipelined_mtp else hidden
        )  # + MTP embeddings (models/base.py)
        x = (
            torch.zeros(mb, t, dtype=torch.long)
            if first
            else torch.empty(mb, t, width, dtype=torch.bfloat16, requires_grad=True)
        )
        if last:
            outs.append(
                model.loss_terms(x, torch.zeros(mb, t, dtype=torch.long), stage=stage).loss_sum
            )
        else:
            outs.append(model.hidden_states(x, stage=stage)[0])
    run.set_phase("backward")
    run.label = "backward"
    out = outs.pop(0)
    out.backward() if last else out.backward(torch.empty_like(out))
    del out


def _measured(run: FakeRun, key: str) -> dict[str, float]:
    total, by, current = run.peaks[key]
    phase = key.split(":")[0]
    out = dict.fromkeys(TERMS, 0.0)
    for label, n in by.items():
        if label.endswith(":head"):
            key = "loss"
        elif label.startswith("fwd"):
            key = "live_layer" if (phase == "forward" and label == current) else "saved_inputs"
        else:
            key = {
                "backward": "live_layer",
                "mixer": "live_layer",
                "recompute": "live_layer",
                "moe": "moe_buffers",
                "loss": "loss",
                "optim_temp": "optim_temp",
            }.get(label)
        if key:
            out[key] += n
    return out

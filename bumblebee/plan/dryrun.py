"""Dry run: the real model code for one rank under ``FakeTensorMode`` (no memory, no GPU).

It builds the bumblebee model of the candidate's per-rank share -- the layers of
the stage that needs the most memory, ``num_experts / ep`` local experts, and
``seq / cp`` tokens -- and runs one steady-state training step (optimizer state
already allocated; forward, backward, AdamW, zero_grad) in bf16 with an fp32
master copy, the precision the planner models. Every
tensor is fake: only shapes exist. A dispatch mode watches every op's outputs
and tracks the bytes of live storages (weakref callbacks on free), giving the
peak of that step.

What a single process cannot do yet is scaled rather than run: tensor
parallelism is ignored (tp = 1 shapes), expert parallelism becomes local
experts with the ``local`` dispatch (no all-to-all buffers), pipeline in-flight
micro-batches are one, and parameters are unsharded (bf16 parameter and
gradient, fp32 master and Adam moments: 16 B each). The analytic figure it is compared with is the memory
model evaluated on exactly that executed shape, without the allocator overhead.

Data-dependent values do not exist under fake tensors, so the run assumes what
the planner assumes: one document per sequence (no packing boundaries), every
label valid (value checks pass), and balanced routing (``bincount`` returns per-expert counts whose
values are never read; the grouped expert GEMM keeps the routed row count).
"""

from __future__ import annotations

import dataclasses
import importlib
import time
import weakref
from contextlib import ExitStack
from dataclasses import dataclass
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bumblebee.config import ConfigError, PrimitivesConfig
from bumblebee.plan.hardware import GB
from bumblebee.plan.layout import Layout, Primitives, Workload
from bumblebee.plan.memory import local_tokens, stage_layers, stage_memory
from bumblebee.plan.recipe import Candidate
from bumblebee.plan.spec import ModelSpec

STATIC_B = 2 + 2 + 12  # executed: bf16 parameters and gradients, fp32 master + Adam moments
aten = torch.ops.aten


class _LiveBytes(TorchDispatchMode):
    """Live storage bytes of every tensor produced under the mode, and their peak."""

    def __init__(self, row_tokens: int):
        super().__init__()
        self.row_tokens = row_tokens  # one document per row: document lengths sum to this
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.current

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._live:
            return
        self._live[key] = st.nbytes()
        self.current += st.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.bincount.default:  # balanced routing: counts per expert, values unread
            minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            out = torch.empty(max(minlength, 1), dtype=torch.int64, device=args[0].device)
        elif func is aten.nonzero.default:  # every element set (every label valid)
            x = args[0]
            out = torch.empty(x.numel(), x.dim(), dtype=torch.int64, device=x.device)
        elif func is aten._local_scalar_dense.default:
            if args[0].dtype == torch.bool:  # an input check such as `if bad.any(): raise`: inputs are valid
                return False
            raise _DataDependent(str(func))
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            out = torch.empty(self.row_tokens, dtype=args[0].dtype, device=args[0].device)  # document ids
        elif func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            out = _grouped_mm_shape(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


class _DataDependent(RuntimeError):
    pass


def _grouped_mm_shape(func, args, kwargs):
    """``_grouped_mm``'s meta kernel accepts only bf16, but the CPU kernel also runs fp32:
    take the output shape from bf16 stand-ins (fake, untracked) and return the input dtype."""
    a, b = args[0], args[1]
    stand = [torch.empty_strided(x.shape, x.stride(), dtype=torch.bfloat16, device=x.device) for x in (a, b)]
    o = func(*stand, *args[2:], **kwargs)
    return torch.empty_strided(o.shape, o.stride(), dtype=a.dtype, device=o.device)


@dataclass
class DryRunResult:
    peak_gb: float  # measured: peak of a steady-state step
    static_gb: float  # measured: parameters + gradients + optimizer state
    analytic_gb: float  # memory model on the executed shape, no allocator overhead
    analytic_static_gb: float
    scaled: list[str]  # what was scaled from the target layout, and why
    seconds: float

    @property
    def ratio(self) -> float:
        return self.peak_gb / self.analytic_gb if self.analytic_gb else float("nan")

    def summary(self) -> str:
        dyn, a_dyn = self.peak_gb - self.static_gb, self.analytic_gb - self.analytic_static_gb
        return (f"dry run (one rank, FakeTensorMode, {self.seconds:.1f} s): peak {self.peak_gb:.2f} GB "
                f"(static {self.static_gb:.2f} + dynamic {dyn:.2f}) vs analytic {self.analytic_gb:.2f} GB "
                f"({self.analytic_static_gb:.2f} + {a_dyn:.2f}) for the executed shape, no allocator overhead: "
                f"{self.ratio - 1:+.1%}; " + "; ".join(self.scaled))

    def as_json(self) -> dict:
        return {"peak_gb": round(self.peak_gb, 3), "static_gb": round(self.static_gb, 3),
                "analytic_gb": round(self.analytic_gb, 3), "analytic_static_gb": round(self.analytic_static_gb, 3),
                "ratio": round(self.ratio, 4), "scaled": self.scaled}


def executed_shape(spec: ModelSpec, cand: Candidate, work: Workload) -> tuple[ModelSpec, Workload, range, list[str]]:
    """The per-rank share a single process runs, and notes on what was scaled."""
    lay, notes = cand.layout, []
    stages = stage_memory(spec, lay, cand.prims, work)
    s = max(range(len(stages)), key=lambda i: stages[i].total)
    layers = stage_layers(spec, lay.pp)[s]
    experts = spec.experts // lay.ep
    top_k = min(spec.top_k, experts)
    if lay.pp > 1:
        notes.append(f"pp={lay.pp}: stage {s} ({len(layers)} layers, one micro-batch in flight of "
                     f"{min(lay.pp - s, max(1, work.global_batch // lay.dp_shard))})")
    if lay.ep > 1:
        notes.append(f"ep={lay.ep}: {experts} local experts, local dispatch (no all-to-all buffers)")
    if top_k != spec.top_k:
        notes.append(f"top_k {spec.top_k} -> {top_k} (fewer local experts)")
    if lay.cp > 1:
        notes.append(f"cp={lay.cp}: {local_tokens(work, lay)} local tokens, no K/V exchange")
    if lay.tp > 1:
        notes.append(f"tp={lay.tp} ignored (no tensor-parallel runtime): tp=1 shapes")
    if cand.prims.sharding != "none":
        notes.append(f"{cand.prims.sharding} not run: unsharded state (16 B/param)")
    sub = dataclasses.replace(spec, mixers=tuple(spec.mixers[i] for i in layers),
                              mlps=tuple(spec.mlps[i] for i in layers), experts=experts, top_k=top_k)
    return sub, Workload(seq=local_tokens(work, lay), global_batch=1, micro_batch=work.micro_batch), layers, notes


def _arch(hf: dict, sub: ModelSpec, layers: range):
    from bumblebee.models import FAMILIES, arch_from_hf_dict
    from bumblebee.models.family import family_of_model_type

    mt = hf.get("model_type")
    if family_of_model_type(mt) is None:
        raise ConfigError(f"--dry-run: model family of model_type {mt!r} is not implemented in bumblebee.models "
                          f"yet (implemented: {', '.join(FAMILIES)}); the analytic estimate stands alone")
    arch = arch_from_hf_dict(hf)
    over = {"num_hidden_layers": len(layers), "num_experts": sub.experts, "num_experts_per_tok": sub.top_k}
    names = {f.name for f in dataclasses.fields(arch)}
    if "layer_types" in names:
        over["layer_types"] = ["full_attention" if m == "attention" else "linear_attention" for m in sub.mixers]
    if "mlp_only_layers" in names:
        over["mlp_only_layers"] = [j for j, m in enumerate(sub.mlps) if m != "moe"]
        over["decoder_sparse_step"] = 1
    return arch.with_overrides(over)


def _prims(p: Primitives) -> PrimitivesConfig:
    modules = ["norm", "attn_core", "moe_act", "linear_attn_core"] if p.recompute == "selective" else []
    return PrimitivesConfig(attention="varlen", linear_attention="chunked", experts="grouped", moe_comm="local",
                            loss=p.loss, recompute=p.recompute, recompute_modules=modules, sharding="none")


def analytic_executed(sub: ModelSpec, prims: Primitives, work: Workload) -> tuple[float, float]:
    """(total, static) bytes the memory model predicts for the executed single-rank shape."""
    one = Layout(tp=1, pp=1, ep=1, cp=1, dp_shard=1)
    p = dataclasses.replace(prims, sharding="none", moe_comm="local")
    mem = stage_memory(sub, one, p, work)[0]
    static = STATIC_B * sub.num_params()["total"]
    return static + mem.activations + mem.logits + mem.moe_buffers, static


def _build_bf16(build_model, arch, prims):
    """Build with bf16 parameters (``Module.to`` cannot swap fake parameters in place)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return build_model(arch, prims)
    finally:
        torch.set_default_dtype(old)


@torch.no_grad()
def _init_adamw(params: list[torch.Tensor], state: dict) -> None:
    for p in params:
        state[id(p)] = (p.float(), torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32))


@torch.no_grad()
def _adamw_step(params: list[torch.Tensor], state: dict, lr: float = 1e-4, betas=(0.9, 0.95),
                eps: float = 1e-8, wd: float = 0.01, chunk: int = 1 << 22) -> None:
    """Mixed-precision AdamW as the planner models it (Megatron-style fused Adam): bf16
    parameters and gradients, fp32 master copy and moments (12 B/param), temporaries no
    larger than one chunk. Written out because torch.optim reads its step counter on the
    host, which fake tensors cannot do. Frees the gradients (zero_grad)."""
    for p in params:
        if p.grad is None:
            continue
        master, m, v = (t.view(-1) for t in state[id(p)])
        g_all, p_all = p.grad.view(-1), p.view(-1)
        for s in range(0, g_all.numel(), chunk):
            g = g_all[s:s + chunk].float()
            m[s:s + chunk].lerp_(g, 1 - betas[0])
            v[s:s + chunk].mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            master[s:s + chunk].mul_(1 - lr * wd).addcdiv_(m[s:s + chunk], v[s:s + chunk].sqrt().add_(eps), value=-lr)
            p_all[s:s + chunk].copy_(master[s:s + chunk])
        p.grad = None


def dry_run(spec: ModelSpec, hf: dict, cand: Candidate, work: Workload) -> DryRunResult:
    from bumblebee.models import build_model
    from bumblebee.primitives import packed
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.perf_counter()
    sub, sub_work, layers, notes = executed_shape(spec, cand, work)
    arch = _arch(hf, sub, layers)
    prims = _prims(cand.prims)
    one_doc = packed.DocLayout(bounds=((0, sub_work.seq),) * sub_work.micro_batch, seq_len=sub_work.seq)
    tracker = _LiveBytes(sub_work.seq)
    try:
        with ExitStack() as stack:
            # one document per row: boundaries are data, which fake tensors do not have
            base = importlib.import_module("bumblebee.models.base")  # where the model builds its layout
            stack.enter_context(mock.patch.object(base, "doc_layout", lambda pos: one_doc))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))
            model = _build_bf16(build_model, arch, prims)  # fake: shapes only
            stack.enter_context(tracker)
            for p in model.parameters():
                tracker._track(p)
            params = [p for p in model.parameters() if p.requires_grad]
            state: dict[int, tuple[torch.Tensor, ...]] = {}
            _init_adamw(params, state)  # steady state: optimizer state exists before the step
            tracker.reset_peak()
            ids = torch.zeros(sub_work.micro_batch, sub_work.seq, dtype=torch.long)
            loss = model(ids, labels=ids)
            loss.backward()
            _adamw_step(params, state)
            del loss
            static = tracker.current + 2 * sum(p.numel() for p in params)  # + the bf16 grads set to None
            peak = tracker.peak
    except _DataDependent as e:
        raise ConfigError(f"--dry-run: the model code reads tensor values ({e}), which a fake-tensor run cannot; "
                          f"the analytic estimate stands alone") from None
    total, a_static = analytic_executed(sub, cand.prims, sub_work)
    return DryRunResult(peak / GB, static / GB, total / GB, a_static / GB, notes, time.perf_counter() - start)

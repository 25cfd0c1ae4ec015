"""Low-rank adapters (LoRA, Hu et al., 2021) on a model's projections and routed experts.

``add_lora(model, cfg.model.lora, train_dtype)`` turns a model built on the meta device (before it
is split and sharded) into W + (alpha / r) B A on every target:

- an ``nn.Linear`` of a decoder layer (attention, Gated DeltaNet, dense and shared-expert MLP
  projections) becomes a ``LoraLinear``: the same module (so FSDP units and names are unchanged)
  with ``lora_A`` [r, in] and ``lora_B`` [out, r] next to its ``weight``;
- an ``Experts`` module gets per-expert factors stacked on the expert dim
  (``Experts.add_lora``): expert parallelism and FSDP2 split them with their experts, and the
  grouped GEMMs stay grouped (two more per projection, primitives/moe/experts.py);
- every other parameter is frozen (no gradient, hence no optimizer state: the sharding
  primitives hand the optimizer trainable tensors only), its matrices stored in the base dtype.

A starts normal(0, 1/sqrt(in)) and B at zero (Hu et al.), so the adapted model starts equal to
the base. Weights out: ``merged_stream`` folds the factors into their base tensors (rollout
weight sync, HF export); ``write_peft_adapter`` writes the factors as a PEFT adapter directory
(safetensors + JSON: no ``peft`` import) that ``peft`` loads onto the ``transformers`` model,
routed experts through PEFT's ``target_parameters`` on the fused expert tensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bumblebee import safe_write
from bumblebee.errors import ConfigError, DiskFullError, disk_full
from bumblebee.primitives.moe.experts import Experts

# a base parameter's leaf name -> the suffix of its factors' names
_FACTOR_SUFFIX = {"weight": "", "w_gate_up": "_gate_up", "w_down": "_down"}
# the transformers name of a stacked expert tensor (fused, [E, out, in] as ours)
_HF_EXPERT_PARAM = {"_gate_up": "gate_up_proj", "_down": "down_proj"}


def is_lora_name(name: str) -> bool:
    return ".lora_" in name


@dataclass(frozen=True)
class LoraInfo:
    """What ``add_lora`` did: rank, alpha, scale = alpha / rank, the target names it matched."""

    rank: int
    alpha: float
    linear_targets: tuple  # leaf names of the adapted nn.Linear modules
    expert_paths: tuple  # module paths of the adapted Experts under a decoder layer (mlp.experts)
    bases: frozenset = frozenset()  # names of the adapted base parameters

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraLinear(nn.Linear):
    """``nn.Linear`` plus ``scale * B (A x)``; made from an existing module by ``to_lora``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight.to(x.dtype) if not _autocast(x) else self.weight, self.bias)
        a, b = self.lora_A, self.lora_B
        if not _autocast(x):
            a, b = a.to(x.dtype), b.to(x.dtype)
        return y + self.lora_scale * F.linear(F.linear(x, a), b)


def _autocast(x: torch.Tensor) -> bool:
    return torch.is_autocast_enabled(x.device.type)


def to_lora(m: nn.Linear, rank: int, scale: float) -> None:
    """Give ``m`` adapters in place (its class becomes ``LoraLinear``)."""
    m.__class__ = LoraLinear
    dev = m.weight.device
    m.lora_A = nn.Parameter(torch.empty(rank, m.in_features, device=dev))
    m.lora_B = nn.Parameter(torch.empty(m.out_features, rank, device=dev))
    m.lora_scale = scale


def base_dtype(lora_cfg, train_dtype: str) -> torch.dtype:
    name = lora_cfg.base_dtype
    if name == "auto":
        name = train_dtype
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def add_lora(model: nn.Module, lora_cfg, train_dtype: str = "float32") -> nn.Module:
    """Adapters on ``lora_cfg.targets`` of the decoder layers (all projections and the routed
    experts when empty), everything else frozen (module docstring). A no-op at rank 0."""
    if not lora_cfg.rank:
        return model
    r, scale = lora_cfg.rank, lora_cfg.alpha / lora_cfg.rank
    wanted = set(lora_cfg.targets)
    seen, linear, experts = set(), set(), set()
    for layer in model.decoder_layers:
        for path, m in layer.named_modules():
            leaf = path.rsplit(".", 1)[-1]
            if isinstance(m, Experts):
                seen.add("experts")
                if not wanted or "experts" in wanted:
                    m.add_lora(r, scale)
                    experts.add(path)
            elif type(m) is nn.Linear and not getattr(m, "reads_weight", False):
                seen.add(leaf)
                if not wanted or leaf in wanted:
                    to_lora(m, r, scale)
                    linear.add(leaf)
    unknown = sorted(wanted - seen)
    if unknown:
        raise ConfigError(
            f"model.lora.targets: {', '.join(unknown)} not in this model; valid: {', '.join(sorted(seen))}"
        )
    dtype, frozen = base_dtype(lora_cfg, train_dtype), {}
    for mn, m in model.named_modules():
        for pn, p in list(m.named_parameters(recurse=False)):
            if is_lora_name(f"{mn}.{pn}"):
                continue
            if id(p) not in frozen:  # a parameter shared by two modules stays shared
                cast = dtype if p.dim() >= 2 and p.is_floating_point() else p.dtype
                frozen[id(p)] = nn.Parameter(p.detach().to(cast), requires_grad=False)
            setattr(m, pn, frozen[id(p)])
    model.__dict__.pop("_expert_names", None)  # is_expert_param now also covers the factors
    names = {n for n, _ in model.named_parameters()}
    bases = frozenset(n for n in names if (ab := factor_names(n)) is not None and ab[0] in names)
    model.lora_info = LoraInfo(
        r, float(lora_cfg.alpha), tuple(sorted(linear)), tuple(sorted(experts)), bases
    )
    return model


def lora_init_rules(named_params, init) -> dict:
    """name -> fill for the factors: A normal(0, 1/sqrt(in)), B zeros."""
    rules = {}
    for name, p in named_params:
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("lora_A"):
            rules[name] = init.normal(p.shape[-1] ** -0.5)
        elif leaf.startswith("lora_B"):
            rules[name] = init.const(0.0)
    return rules


def factor_names(base: str) -> tuple[str, str] | None:
    """(A name, B name) of base parameter ``base``'s adapters, by naming rule (None: not adaptable)."""
    prefix, _, leaf = base.rpartition(".")
    suffix = _FACTOR_SUFFIX.get(leaf)
    if suffix is None:
        return None
    return f"{prefix}.lora_A{suffix}", f"{prefix}.lora_B{suffix}"


@torch.no_grad()
def merge(w, a, b, scale: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """W + scale * B A in fp32, rounded once to ``dtype`` (default W's; stacked experts: per
    expert)."""
    delta = torch.matmul(b.float(), a.float())
    return (w.float() + scale * delta).to(dtype or w.dtype)


def merged_stream(pairs, scale: float, dtype: torch.dtype | None = None):
    """(name, full tensor) pairs with every adapted base tensor replaced by its merged value and
    the factors dropped (``dtype``: the merged tensors' dtype, default their base's). A module's
    factors follow its base tensors (registration order), so the stream holds one module's
    tensors at a time."""
    pending: list = []

    def flush():
        got = dict(pending)
        for name, t in pending:
            if is_lora_name(name):
                continue
            ab = factor_names(name)
            if ab is not None and ab[0] in got:
                t = merge(t, got[ab[0]], got[ab[1]], scale, dtype)
            yield name, t
        pending.clear()

    prefix = None
    for name, t in pairs:
        here = name.rpartition(".")[0]
        if here != prefix:
            yield from flush()
            prefix = here
        pending.append((name, t))
    yield from flush()


def merged_state(model) -> dict[str, torch.Tensor]:
    """The whole (single-process) model's parameters with the adapters merged in, detached."""
    pairs = ((n, p.detach()) for n, p in model.named_parameters())
    info = getattr(model, "lora_info", None)
    return dict(merged_stream(pairs, info.scale) if info else pairs)


# ---------------------------------------------------------------------------------------- PEFT


def peft_tensors(name: str, t: torch.Tensor, hf_name_out=None):
    """The PEFT adapter-file entries of one factor ``name`` (full tensor ``t``). Linear: the factor
    as is under ``<module>.lora_{A,B}.weight``. Experts (PEFT's ``ParamWrapper`` on the fused
    [E, out, in] tensor, the first of ``target_parameters`` innermost, hence ``base_layer``):
    A [E, r, in] -> [E r, in] (row e r + i), B [E, out, r] -> [out, r E] (column i E + e)."""
    prefix, _, leaf = name.rpartition(".")
    ab, suffix = leaf[len("lora_")], leaf[len("lora_A") :]
    if hf_name_out is not None:
        prefix = hf_name_out(prefix + ".weight").rpartition(".")[0]
    key = f"base_model.model.{prefix}"
    if not suffix:
        return [(f"{key}.lora_{ab}.weight", t)]
    E = t.shape[0]
    if ab == "A":
        flat = t.reshape(E * t.shape[1], t.shape[2])
    else:
        flat = t.permute(1, 2, 0).reshape(t.shape[1], t.shape[2] * E)
    inner = ".base_layer" if suffix == "_gate_up" else ""
    return [(f"{key}{inner}.lora_{ab}.weight", flat.contiguous())]


def peft_config(info: LoraInfo, base_model: str = "") -> dict:
    """adapter_config.json: LoRA on the adapted Linear leaf names (``target_modules``) and the
    fused expert tensors (``target_parameters``, gate_up first: it is the inner wrapper)."""
    params = [
        f"{p}.{_HF_EXPERT_PARAM[s]}" for p in info.expert_paths for s in ("_gate_up", "_down")
    ]
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model or None,
        "r": info.rank,
        "lora_alpha": info.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "target_modules": list(info.linear_targets),
        "target_parameters": params or None,
    }


def write_peft_adapter(out_dir: str, info: LoraInfo, factors, hf_name_out=None, base_model=""):
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` from (name, full factor)."""
    from safetensors.torch import save

    tensors = {}
    for name, t in factors:
        for key, v in peft_tensors(name, t.detach().cpu(), hf_name_out):
            tensors[key] = v
    # the adapter is small: its bytes in memory, both files moved in together when complete
    data = save(tensors, {"format": "pt"})
    try:
        with safe_write.staged_dir(out_dir, doing="write the adapter") as stage:
            safe_write.write_file(os.path.join(stage.path, "adapter_model.safetensors"), data)
            safe_write.write_file(
                os.path.join(stage.path, "adapter_config.json"),
                json.dumps(peft_config(info, base_model), indent=2),
            )
    except DiskFullError as e:  # name the adapter directory, not its staging directory
        raise disk_full(out_dir, "write the adapter", getattr(e, "cause", e)) from None

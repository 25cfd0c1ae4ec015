"""Everything about a run that can be checked before any process group exists.

One resolver shared by the CLI, the launcher (in the parent process), the Trainer, the
RL Engine and the planner, so they cannot disagree about what runs:

- ``validate_run(cfg)``: the registered primitives, the model family, preset or HF
  directory and its architecture (``config.validate`` has already checked each value);
- ``resolve_layout(parallel, world, arch)``: ``dp_shard = "auto"`` resolved and the
  layout checked against a world size (EP folding, divisibility);
- ``check_run(cfg, world)``: both, plus what the step needs (rows per rank, zigzag
  chunks, pipeline stages, the kernel of each slot); returns the ``RunPlan`` every builder
  reads;
- ``load_config(path, overrides)``: parse + ``validate_run`` (``bumblebee.load_config``).

"Layout" means one thing in bumblebee: the sizes of the parallel dimensions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import torch

import bumblebee.primitives  # noqa: F401  (registers every implementation)
from bumblebee import registry
from bumblebee.config import Config, ConfigError, balance_mode
from bumblebee.config_checks import validate
from bumblebee.config_parse import parse_config
from bumblebee.errors import gather
from bumblebee.models import FAMILIES, family_of, resolve_arch
from bumblebee.primitives import emulation
from bumblebee.primitives.kernel_choice import Kernel, kernel_table
from bumblebee.primitives.parallel import Layout


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """A run resolved once (``check_run``): the Trainer, the pipeline, the RL Engine, pair and
    preflight read these instead of recomputing them from the config."""

    arch: Any  # the model family's arch dataclass
    layout: Layout
    rows_per_rank: int  # train.global_batch / dp_shard, or the Engine's rows
    micro_batches: int  # per step and rank: rows_per_rank / train.micro_batch
    pp_microbatches: int  # micro-batches of one pipeline schedule run (1 without pp)
    balance: str  # the balance-loss definition computed (config.balance_mode)
    # copies of the balance loss the global batch's mean runs over (micro-batches x dp x cp)
    balance_denominator: int
    tokens_per_step: int  # rows_per_rank x dp_shard x train.seq_len
    mtp_depth: int  # MTP depths trained
    device: str  # the device kind the kernels are for ("cuda" under train.emulate_cuda)
    kernels: dict[str, Kernel]  # slot -> the kernel its implementation runs there
    # micro-batches run two at a time, each one's all-to-alls under the other's compute
    # (an implementation declaring ``paired``: runtime/step.py run_micro_batches)
    paired: bool = False

    def on_device(self, cfg: Config, device: str) -> RunPlan:
        """This plan with the kernels of ``device`` (a Trainer given another device's plan)."""
        if device == self.device:
            return self
        return replace(
            self, device=device, kernels=run_kernels(cfg, self.arch, self.layout, device)
        )


def run_kernels(cfg: Config, arch, layout: Layout, device: str) -> dict[str, Kernel]:
    """slot -> kernel of the configured implementations on ``device`` for this model (its
    attention options) and layout (the CP slot), as ``bumblebee primitives`` lists them; under
    train.emulate_cuda, what the emulated CUDA run executes."""
    spec = arch.to_spec()
    options = {"sinks": spec.attn_sinks, "window": any(spec.windows)}
    emulate = cfg.train.emulate_cuda and not emulation.active()
    # only the dispatch's switch: no checked communication outside a run
    with emulation.emulate_cuda(check_comm=False) if emulate else contextlib.nullcontext():
        return kernel_table(cfg.primitives, device, cfg.train.dtype, cp=layout.cp, **options)


def device_kind(cfg: Config) -> str:
    """The device kind a run of ``cfg`` computes on here: "cuda" under train.emulate_cuda."""
    return "cuda" if cfg.train.emulate_cuda or torch.cuda.is_available() else "cpu"


def resolve_layout(parallel_cfg, world: int, arch) -> Layout:
    """Resolve ``dp_shard="auto"`` and reject impossible layouts (no process group needed)."""
    p = parallel_cfg
    if p.tp > 1:
        raise ConfigError(
            "parallel.tp > 1 is not implemented; the recipe keeps TP = 1 (use ep and cp)"
        )
    if p.pp > arch.num_hidden_layers:
        raise ConfigError(
            f"parallel.pp = {p.pp} stages need at least as many decoder layers, "
            f"the model has {arch.num_hidden_layers}"
        )
    inner = p.cp * p.tp * p.pp
    if p.dp_shard == "auto":
        if world % inner:
            raise ConfigError(f"world size {world} is not divisible by cp*tp*pp = {inner}")
        dp_shard = world // inner
    else:
        dp_shard = p.dp_shard
    if dp_shard * inner != world:
        raise ConfigError(
            f"pp*dp_shard*cp*tp = {p.pp}*{dp_shard}*{p.cp}*{p.tp} = {dp_shard * inner} "
            f"!= world size {world}"
        )
    fold = dp_shard * p.cp * p.tp
    if fold % p.ep:
        raise ConfigError(
            f"parallel.ep = {p.ep} must divide dp_shard*cp*tp = {fold} (ep folds over those ranks)"
        )
    num_experts = getattr(arch, "num_experts", 0)
    if p.ep > 1 and num_experts % p.ep:
        raise ConfigError(f"num_experts = {num_experts} is not divisible by parallel.ep = {p.ep}")
    return Layout(pp=p.pp, dp_shard=dp_shard, cp=p.cp, tp=p.tp, ep=p.ep)


def validate_run(cfg: Config):
    """The checks that need the registry and the model families; returns the architecture."""
    registry.validate_choices(cfg.primitives)
    arch = resolve_arch(cfg.model)  # validates family, preset, hf_path and the architecture
    if arch.vocab_size < 256 and cfg.data.source == "synthetic":
        raise ConfigError(
            f"the synthetic task is byte-level and needs vocab_size >= 256, got {arch.vocab_size}"
        )
    router = family_of(arch).router
    if (
        router and cfg.primitives.router == "softmax_topk"
    ):  # the default: the architecture's router instead
        cfg.primitives.router = router  # (the resolved config.toml of the run shows it)
    unmet = registry.unmet(
        registry.RunFacts(prims=cfg.primitives, moe_bias=arch.to_spec().moe_bias)
    )
    if unmet:
        raise ConfigError("\n".join(unmet))
    mtp_depth(cfg, arch)
    return arch


def mtp_depth(cfg: Config, arch) -> int:
    """The MTP depths a run trains: ``mtp.depth`` ("auto": every module the model holds)."""
    key = family_of(arch).mtp_arch_key
    held = getattr(arch, key) if key else 0
    depth = held if cfg.mtp.depth == "auto" else cfg.mtp.depth
    if depth > held:
        raise ConfigError(
            f"mtp.depth = {depth} but the model holds {held} MTP module(s)"
            + (f"; set model.arch.{key} to add modules" if key else " (its family has no MTP)")
        )
    return depth


def load_config(
    path: str | None = None, overrides: list[str] | None = None, errors: list | None = None
) -> Config:
    """Defaults <- TOML file <- ``--set`` overrides; every value and the model checked, all
    problems in one ConfigError (a line each): first every section's values and the model's
    architecture, together; the cross-checks (primitives, MTP) only on valid values, or one
    mistake would be reported twice. With ``errors``, a caller with checks of its own gets
    those lines appended there instead, and the config back."""
    cfg = parse_config(path, overrides, check=False)
    try:
        gather(lambda: validate(cfg), lambda: resolve_arch(cfg.model))
        validate_run(cfg)
    except ConfigError as e:
        if errors is None:
            raise
        errors += str(e).splitlines()
    return cfg


def check_run(
    cfg: Config, world: int, *, rows_per_rank: int | None = None, device: str | None = None
) -> RunPlan:
    """Everything about a run on ``world`` ranks that can be rejected before any process
    group exists (the launcher calls this in the parent process); every problem found, a line
    each. The ``RunPlan`` of what runs. ``rows_per_rank``: a caller that brings each rank's
    batch (the RL Engine) gives its rows per step instead of train.global_batch; ``device``:
    the device kind whose kernels the plan lists (default: ``device_kind(cfg)``)."""
    arch = resolve_arch(cfg.model)
    layout = resolve_layout(cfg.parallel, world, arch)
    p, t = cfg.primitives, cfg.train

    def contracts():
        # what each chosen implementation declares it needs of the layout (registry.Need)
        facts = registry.RunFacts(
            prims=p, world=world, ep=layout.ep, pp=layout.pp, cp=layout.cp, micro_batches=micro
        )
        if unmet := registry.unmet(facts):
            raise ConfigError("\n".join(unmet))

    def cp():
        if layout.cp > 1 and t.seq_len % (2 * layout.cp):
            raise ConfigError(
                f"train.seq_len ({t.seq_len}) must be divisible by 2 x parallel.cp "
                f"({2 * layout.cp}): each rank holds two of the 2*cp zigzag chunks"
            )
        if layout.cp > 1 and not FAMILIES[cfg.model.name].context_parallel:
            able = ", ".join(f.name for f in FAMILIES.values() if f.context_parallel)
            raise ConfigError(
                f"parallel.cp > 1 is not supported yet for model {cfg.model.name!r}; valid: {able}"
            )

    if rows_per_rank is None:
        rows, rem = divmod(t.global_batch, layout.dp_shard)
    else:
        rows, rem = rows_per_rank, 0
    micro = rows // t.micro_batch

    def batch():
        if rows_per_rank is not None and rows % t.micro_batch:
            raise ConfigError(
                f"train.micro_batch ({t.micro_batch}) must divide the {rows} rows of each rank"
            )
        if rem or rows % t.micro_batch:
            unit = layout.dp_shard * t.micro_batch
            raise ConfigError(
                f"train.global_batch ({t.global_batch}) must be a multiple of dp_shard "
                f"({layout.dp_shard}) x train.micro_batch ({t.micro_batch}), e.g. "
                f"--set train.global_batch={unit * max(1, round(t.global_batch / unit))}"
            )

    hint = rows_per_rank is None  # train.global_batch is what to change
    gather(contracts, cp, batch, lambda: check_pipeline(cfg, layout, arch, rows, hint))
    device = device or device_kind(cfg)
    pp_micro = (p.pp_microbatches or micro) if layout.pp > 1 else 1
    return RunPlan(
        arch=arch,
        layout=layout,
        rows_per_rank=rows,
        micro_batches=micro,
        pp_microbatches=pp_micro,
        balance=balance_mode(cfg, layout.pp),
        balance_denominator=(pp_micro if layout.pp > 1 else micro) * layout.dp_shard * layout.cp,
        tokens_per_step=rows * layout.dp_shard * t.seq_len,
        mtp_depth=mtp_depth(cfg, arch),
        device=device,
        kernels=run_kernels(cfg, arch, layout, device),
        paired=registry.paired(p),
    )


def check_pipeline(cfg, layout, arch, rows_per_rank: int, hint: bool = True) -> None:
    """Reject pipeline settings that cannot run (one-line ConfigErrors, before any process starts);
    ``hint``: suggest a train.global_batch."""
    p = cfg.primitives
    if p.pp_microbatches < 0 or p.pp_virtual_stages < 1:
        raise ConfigError(
            f"primitives.pp_microbatches must be >= 0 and pp_virtual_stages >= 1, "
            f"got {p.pp_microbatches} and {p.pp_virtual_stages}"
        )
    if layout.pp == 1:
        if p.pp_layout or p.pp_virtual_stages != 1:
            raise ConfigError("primitives.pp_layout and pp_virtual_stages need parallel.pp > 1")
        return
    gather(
        lambda: _check_schedule(cfg, layout, rows_per_rank, hint),
        lambda: _check_stages(cfg, layout, arch),
    )


def _check_schedule(cfg, layout, rows_per_rank: int, hint: bool) -> None:
    p = cfg.primitives
    m = p.pp_microbatches or rows_per_rank // cfg.train.micro_batch
    if rows_per_rank % m:
        raise ConfigError(
            f"primitives.pp_microbatches = {m} must divide the {rows_per_rank} rows of each "
            f"pipeline (train.global_batch / dp_shard)"
        )
    problem = registry.get("pipeline", p.pipeline).factory.check(layout.pp, m, p.pp_virtual_stages)
    if problem:
        more = ""
        if hint and not p.pp_microbatches and cfg.train.micro_batch == 1:
            more = (
                f" (train.global_batch {cfg.train.global_batch} / dp_shard {layout.dp_shard} rows per "
                f"pipeline): raise train.global_batch to {layout.dp_shard * layout.pp} or more"
            )
        raise ConfigError(f"primitives.pipeline = {p.pipeline!r} {problem}{more}")


def _check_stages(cfg, layout, arch) -> None:
    p = cfg.primitives
    if balance_mode(cfg, layout.pp) != "micro_batch":
        raise ConfigError(
            f"train.balance = '{cfg.train.balance}' needs every micro-batch's router statistics "
            "before the first backward, which a pipeline schedule (parallel.pp > 1) does not "
            "give; set train.balance = 'micro_batch' (or 'auto') with pp > 1"
        )
    stages, n = layout.pp * p.pp_virtual_stages, arch.num_hidden_layers
    if stages > n:
        raise ConfigError(
            f"pp x pp_virtual_stages = {stages} stages need at least as many decoder layers, "
            f"the model has {n}"
        )
    if arch.tie_word_embeddings:
        raise ConfigError(
            "tied embeddings cannot be split over pipeline stages (embedding on the first, "
            "LM head on the last); use parallel.pp = 1"
        )
    if p.pp_layout:
        ok = (
            isinstance(p.pp_layout, list)
            and len(p.pp_layout) == stages
            and all(isinstance(s, list) and s for s in p.pp_layout)
            and [i for s in p.pp_layout for i in s] == list(range(n))
        )
        if not ok:
            raise ConfigError(
                f"primitives.pp_layout must list {stages} non-empty stages of consecutive decoder "
                f"layers covering 0..{n - 1} in order, e.g. [[0, 1], [2, 3]]; got {p.pp_layout}"
            )

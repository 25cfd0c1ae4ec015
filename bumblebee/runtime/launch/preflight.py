"""Checks a training run passes before any rank starts: bad input fails in the
launching process with one line (exit 2), not in a worker after launch.

``preflight(cfg, world)`` adds to ``check_run`` (layout, pipeline) what needs more
than the config: the data (the synthetic task's limits; a JSONL file read and
validated once, here), the recompute module names, the checkpoint a resume names
(complete, and of the same architecture), Gated DeltaNet's conv window under
context parallelism, a CUDA machine without a fused kernel the model needs, and the
output directory (``outdir.check_out_dir``).
"""

from __future__ import annotations

import torch

from bumblebee import registry
from bumblebee.config import Config, ConfigError
from bumblebee.data.synthetic import KEYS, min_doc_len
from bumblebee.primitives.kernel_choice import select
from bumblebee.runtime.launch.outdir import check_out_dir
from bumblebee.runtime.resolve import check_run

SYNTHETIC_KEYS = len(KEYS)  # distinct key letters a document can hold


def _activations_fit(cfg: Config, layout, arch) -> None:
    """A lower bound only (one layer's input and output for one micro-batch, 2 bytes a value):
    a train.seq_len beyond it never reached step 1 (1e9 tokens: the data plan alone ran for
    hours), so it is refused now. The planner sizes everything else."""

    from bumblebee.data.cli import host_memory

    tokens = cfg.train.seq_len * cfg.train.micro_batch // max(layout.cp, 1)
    need = 2 * 2 * tokens * arch.hidden_size
    cuda = torch.cuda.is_available()
    have = torch.cuda.get_device_properties(0).total_memory if cuda else host_memory()
    if need > have:
        raise ConfigError(
            f"train.seq_len = {cfg.train.seq_len}: one micro-batch's activations alone need >= "
            f"{need / 2**30:.3g} GiB per rank ({tokens} tokens x hidden {arch.hidden_size}, in and out "
            f"of a layer), more than the {have / 2**30:.0f} GiB of {'GPU' if cuda else 'host'} "
            "memory; shorten it or split it with parallel.cp"
        )


def _parameters_fit(cfg: Config, layout, arch) -> None:
    """A lower bound only (fp32 master weights of the embedding and one hidden x hidden
    projection per layer, spread over every rank): a model past it fails in the allocator
    after minutes of start-up (model.arch.vocab_size = 1e12), so it is refused now."""
    from bumblebee.data.cli import host_memory

    hidden = arch.hidden_size
    params = arch.vocab_size * hidden + arch.num_hidden_layers * hidden * hidden
    need = 4 * params / max(layout.world, 1)
    cuda = torch.cuda.is_available()
    have = torch.cuda.get_device_properties(0).total_memory if cuda else host_memory()
    if need > have:
        raise ConfigError(
            f"the model (vocab_size {arch.vocab_size}, hidden_size {hidden}, "
            f"{arch.num_hidden_layers} layers) needs >= {need / 2**30:.3g} GiB per rank for its fp32 "
            f"weights alone, more than the {have / 2**30:.0f} GiB of {'GPU' if cuda else 'host'} "
            "memory; check model.arch, or spread it over more ranks"
        )


def preflight(cfg: Config, world: int):
    """Everything about the run on ``world`` ranks that can be rejected before launch;
    returns the ``RunPlan``. Raises ``ConfigError`` (one line)."""
    t, d = cfg.train, cfg.data
    if d.source == "synthetic":
        need = min_doc_len(d.min_records, d.value_len)
        if t.seq_len < need:
            raise ConfigError(
                f"train.seq_len = {t.seq_len} is too short for the synthetic key-value task: a row "
                f"needs >= {need} tokens (BOS, data.min_records records, their queries and answers)"
            )
        if d.max_records > SYNTHETIC_KEYS:
            raise ConfigError(
                f"data.max_records = {d.max_records} exceeds the synthetic task's {SYNTHETIC_KEYS} "
                "distinct key letters (records of one document have unique keys)"
            )
    plan = check_run(cfg, world)
    layout, arch = plan.layout, plan.arch
    _parameters_fit(cfg, layout, arch)
    _activations_fit(cfg, layout, arch)
    if (
        t.wandb
    ):  # an optional extra: missing, one line now rather than from rank 0 after the model is built
        from bumblebee.runtime.metrics import import_wandb

        import_wandb()
    registry.get("recompute", cfg.primitives.recompute).factory(cfg.primitives.recompute_modules)
    why = arch.context_parallel_error(layout.cp, t.seq_len) if layout.cp > 1 else None
    if why:
        raise ConfigError(why)
    if d.source == "jsonl":
        from bumblebee.data.jsonl import scan_samples

        trainable = []  # one pass, nothing kept: a token's label is the next token

        def visit(_offset, _ids, mask):
            if not trainable and any(mask[1:]):
                trainable.append(True)

        scan_samples(d.path, arch.vocab_size, visit)
        if not trainable:
            raise ConfigError(
                f"{d.path}: no sample has a loss token after its first token (all loss_mask "
                "false, or one-token documents): there is nothing to train on"
            )
    if d.source == "tokens":
        check_token_vocab(d.path, d.eval_path, arch.vocab_size, cfg.model)
    if t.resume:
        check_resume(cfg, arch)
    check_kernels(
        cfg, arch, cuda=plan.device == "cuda" and not t.emulate_cuda, kernels=plan.kernels
    )
    check_out_dir(
        t.out_dir,
        checkpoints=bool(t.save_every or t.export_hf),
        inputs=[cfg.data.path if cfg.data.source != "synthetic" else "", cfg.model.hf_path],
    )
    return plan


def check_kernels(cfg: Config, arch, cuda: bool, kernels: dict | None = None) -> None:
    """On CUDA, a model with Gated DeltaNet layers and no FLA would run the pure-PyTorch chunk loop
    (thousands of small kernels per layer, ~10x the fused kernel's activation memory): refuse it
    unless ``primitives.allow_fallback`` says the user wants exactly that. ``kernels``: the run's
    CUDA kernel table (``RunPlan.kernels``), asked here when not given."""
    if not cuda or cfg.primitives.allow_fallback or "linear_attention" not in arch.optional_slots():
        return
    kernel = (kernels or {}).get("linear_attention") or select(
        "linear_attention", cfg.primitives.linear_attention, "cuda", cfg.train.dtype
    )
    # a reference runs its own PyTorch code by design; an optimized one on its fallback is refused
    impl = registry.get("linear_attention", cfg.primitives.linear_attention)
    if not impl.reference and not kernel.fused:
        raise ConfigError(
            "Gated DeltaNet on CUDA needs flash-linear-attention's kernel: pip install -e '.[gpu]' "
            "(or set primitives.allow_fallback = true to run the slow pure-PyTorch chunk loop)"
        )


def check_resume(cfg: Config, arch) -> None:
    """The checkpoint ``train.resume`` names is complete and was saved for this architecture."""
    from bumblebee.runtime.checkpoint.directory import find_checkpoint, read_marker

    path = find_checkpoint(cfg.train.resume, cfg.train.out_dir)
    if path is None:  # "auto" in a run without checkpoints yet: a fresh start
        return
    saved, now = read_marker(path)["arch"], arch.to_hf_dict()
    changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if changed:
        shown = ", ".join(f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:3])
        raise ConfigError(
            f"train.resume: {path} was saved for another architecture ({shown}"
            f"{', ...' if len(changed) > 3 else ''}); resume with the model it was trained with"
        )


def check_token_vocab(path: str, eval_path: str, vocab_size: int, model_cfg) -> None:
    """A prepared corpus (meta.json) whose token ids reach past the model's vocabulary was
    tokenized for another model: say which directory, whose vocabulary, and how to fix it."""
    from bumblebee.data.store import open_store

    for where in (path, eval_path):
        if not where:
            continue
        meta = open_store(where).meta
        top = meta.get("max_token_id", -1)
        if top >= vocab_size:
            model = model_cfg.hf_path or f"{model_cfg.name}/{model_cfg.preset}"
            made_by = f" (tokenizer {meta['tokenizer']})" if meta.get("tokenizer") else ""
            raise ConfigError(
                f"{where}: prepared with token ids up to {top}{made_by}, but the model {model} has a "
                f"vocabulary of {vocab_size} ids: the data was tokenized for another model; prepare it "
                f"again with this model's tokenizer (bumblebee data prepare IN OUT --source ... "
                f"--tokenizer MODEL_TOKENIZER_DIR) and point data.path at OUT, or train the model "
                f"whose tokenizer made it"
            )

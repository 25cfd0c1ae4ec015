"""bumblebee as a verl training backend, driven through verl's own engine-level API: the engine is
built by verl's ``EngineRegistry`` from the "bumblebee" backend, then ``train_batch`` (verl's
BaseEngine: zero grad, ``forward_backward_batch`` over verl's micro-batches with verl's ``sft_loss``,
optimizer step) and ``infer_batch`` run on nested (no-padding) verl data. The loss, grad norm and the
updated log-probs equal bumblebee's own ``train_step`` with a token NLL on the same sequences.
On 2 gloo ranks (fsdp2, dp = 2) each rank passes its own samples, as verl's workers do: the
figures equal one process on all samples (verl's losses scale by dp_size for a dp mean, bumblebee
sums gradients over ranks: the adapter divides). Skipped without verl (an optional extra, in its own
environment: see pyproject.toml) -- and so skipped in CI, where verl is not installed (docs/rl.md says so)."""

from __future__ import annotations

import functools

import pytest
import torch
from dist_utils import run_distributed

verl = pytest.importorskip(
    "verl",
    reason='verl is not installed: pip install "bumblebee[verl]" (verl==0.9.*; '
    "in its own environment, with torch pinned: see pyproject.toml)",
)

from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import sft_loss  # noqa: E402

import bumblebee.integrations.verl  # noqa: E402,F401  (registers the backend)
from bumblebee import load_config  # noqa: E402
from bumblebee.rl.batch import pack_sequences  # noqa: E402
from bumblebee.rl.engine import Engine  # noqa: E402
from bumblebee.rl.losses import TokenNLL  # noqa: E402

SMALL = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.num_experts=4",
    "model.arch.moe_intermediate_size=32",
    "primitives.attention=sdpa",
    "model.arch.router_aux_loss_coef=0.0",
    "train.micro_batch=64",
]


def samples(n=6):
    g = torch.Generator().manual_seed(3)
    tokens = [
        torch.randint(0, 256, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g)
        for _ in range(n)
    ]
    masks = [
        (torch.arange(len(t)) >= 2).long() for t in tokens
    ]  # 2 prompt tokens, the rest trained
    return tokens, masks


def verl_data(tokens, masks, max_tokens=None):
    """verl's no-padding batch: fixed micro-batches of 2 samples, or ``max_tokens`` per micro-batch."""
    nested = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    mode = (
        {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2}
        if max_tokens is None
        else {"use_dynamic_bsz": True, "max_token_len_per_gpu": max_tokens}
    )
    return tu.get_tensordict(
        {
            "input_ids": nested(tokens),
            "position_ids": nested([torch.arange(len(t)) for t in tokens]),
            "loss_mask": nested(masks),
        },
        non_tensor_dict={**mode, "temperature": 1.0},
    )


def test_verl_engine_api_runs_bumblebee(tmp_path):
    cfg = load_config(None, SMALL + [f"train.out_dir={tmp_path}"])
    engine = EngineRegistry.new("language_model", "bumblebee", config=cfg)
    engine.initialize()
    tokens, masks = samples()
    loss_fn = functools.partial(sft_loss, None)
    with engine.train_mode():
        out = engine.train_batch(verl_data(tokens, masks), loss_fn)
    assert len(out["loss"]) == 3  # verl's micro-batches: 6 samples, 2 per micro-batch

    ref = Engine(cfg)  # the same step through bumblebee's own surface
    batch = pack_sequences([t.tolist() for t in tokens], [m.bool().tolist() for m in masks], 16)
    want = ref.train_step(batch, TokenNLL())
    assert sum(out["loss"]) == pytest.approx(want["loss"], rel=1e-5)
    assert out["metrics"]["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)

    with engine.eval_mode():
        lp = engine.infer_batch(verl_data(tokens, masks))["model_output"]["log_probs"]
    want_lp = batch.unpack(
        ref.compute_logprobs(batch).logprobs
    )  # token-aligned: lp[t] = log p(token t)
    for got, w in zip(lp.unbind(), want_lp):  # verl's alignment: lp[t] = log p(token t + 1)
        assert torch.allclose(got[:-1], w[1:], atol=1e-5)
    names = [n for n, _ in engine.get_per_tensor_param()[0]]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names


def _cpu_platform():
    """verl 0.9.1 has no CPU platform and falls back to "nvidia", whose device name puts verl's
    dp micro-batch count exchange on CUDA: a CPU variant through verl's own ``set_platform``."""
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import set_platform

    class PlatformCPU(PlatformCUDA):
        device_name = property(lambda self: "cpu")
        communication_backend_name = lambda self: "gloo"  # noqa: E731
        current_device = lambda self: 0  # noqa: E731

    set_platform(PlatformCPU())


def _ranks(rank, world, out_dir):
    _cpu_platform()
    cfg = load_config(None, SMALL + [f"train.out_dir={out_dir}", "primitives.sharding=fsdp2"])
    engine = EngineRegistry.new("language_model", "bumblebee", config=cfg)
    engine.initialize()
    tokens, masks = samples(8)
    mine = (
        slice(0, 3) if rank == 0 else slice(3, 8)
    )  # uneven: verl's dynamic batching evens the micro-batch count
    with engine.train_mode():
        out = engine.train_batch(
            verl_data(tokens[mine], masks[mine], max_tokens=24), functools.partial(sft_loss, None)
        )
    return sum(out["loss"]), out["metrics"]["grad_norm"]


def test_verl_engine_api_on_two_ranks(tmp_path):
    tokens, masks = samples(8)
    ref = Engine(load_config(None, SMALL + [f"train.out_dir={tmp_path}"]))
    want = ref.train_step(
        pack_sequences([t.tolist() for t in tokens], [m.bool().tolist() for m in masks], 16),
        TokenNLL(),
    )
    per_rank = run_distributed(_ranks, 2, str(tmp_path), timeout=300)
    assert sum(loss for loss, _ in per_rank) / 2 == pytest.approx(
        want["loss"], rel=1e-5
    )  # verl's x dp_size
    for _, norm in per_rank:
        assert norm == pytest.approx(want["grad_norm"], rel=1e-5)

"""A run resolved once (issue 36 items 1 and 5): the RL Engine's batch reaches ``check_run``
without rewriting the config; the ``RunPlan`` lists the kernel of each slot as the kernel-choice
does; one ``ParallelState`` carries the layout's sizes, so building a model and clipping
gradients never read a size back from a process group; the walk of ``train.global_batch``
from the Trainer stays short (``benchmarks/global_batch_walk.py``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

from bumblebee import load_config
from bumblebee.config import ConfigError
from bumblebee.primitives import emulation, kernel_choice
from bumblebee.runtime.resolve import check_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model.arch.num_hidden_layers=2", "train.seq_len=64"]


def test_engine_batch_needs_no_global_batch(tmp_path):
    """The Engine's rows per rank replace train.global_batch in the check (3 rows cannot split
    over 2 dp ranks, yet an Engine trains whatever its caller passes), and its config is the
    caller's, unchanged."""
    cfg = load_config(None, [*TINY, "train.global_batch=3", "train.micro_batch=2"])
    with pytest.raises(ConfigError, match="multiple of dp_shard"):
        check_run(cfg, 2)
    plan = check_run(cfg, 2, rows_per_rank=2)
    assert (plan.rows_per_rank, plan.micro_batches, plan.balance_denominator) == (2, 1, 2)
    assert plan.tokens_per_step == 2 * 2 * 64  # rows x dp ranks x seq_len
    with pytest.raises(ConfigError, match="must divide the 3 rows"):
        check_run(cfg, 2, rows_per_rank=3)

    from bumblebee.rl.engine import Engine

    cfg.train.out_dir = str(tmp_path)
    engine = Engine(cfg, device=torch.device("cpu"))
    assert engine.cfg.train.global_batch == 3  # not rewritten to pass the check
    assert (engine.plan.rows_per_rank, engine.plan.micro_batches) == (2, 1)


@pytest.mark.parametrize("model", ["qwen3_5_moe", "gpt_oss"])
def test_plan_lists_the_dispatch_kernels(model):
    """RunPlan.kernels is the kernel-choice table for the plan's device, the model's attention
    options (gpt-oss: sinks and windows) and the CP slot; under train.emulate_cuda the CUDA
    column as the emulated run executes it."""
    cfg = load_config(None, [*TINY, f"model.name={model}", "parallel.cp=2"])
    plan = check_run(cfg, 2, device="cuda")
    spec = plan.arch.to_spec()
    options = {"sinks": spec.attn_sinks, "window": any(spec.windows)}
    want = kernel_choice.kernel_table(cfg.primitives, "cuda", cfg.train.dtype, cp=2, **options)
    assert plan.device == "cuda" and plan.kernels == want and "cp_attention" in plan.kernels
    cpu = plan.on_device(cfg, "cpu")
    assert cpu.kernels == kernel_choice.kernel_table(
        cfg.primitives, "cpu", cfg.train.dtype, cp=2, **options
    )
    assert dataclasses.replace(cpu, kernels=plan.kernels, device="cuda") == plan
    cfg.train.emulate_cuda = True
    with emulation.emulate_cuda(check_comm=False):
        emulated = kernel_choice.kernel_table(
            cfg.primitives, "cuda", cfg.train.dtype, cp=2, **options
        )
    assert check_run(cfg, 2, device="cuda").kernels == emulated


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["zero1", "fsdp2"])
def test_sizes_are_carried(fake_world, monkeypatch, sharding):
    """On a (fake) 2-rank world with ep = 2: the model's experts, its MoE dispatch, the
    sharding's slices and the gradient clipping take every size from the ParallelState;
    ``dist.get_world_size(group)`` is refused while they are built and run."""
    from bumblebee.models import build_model
    from bumblebee.primitives.sharding.common import clip_grad_norm
    from bumblebee.registry import get
    from bumblebee.runtime.mesh import build_context

    cfg = load_config(
        None,
        [*TINY, "parallel.ep=2", "primitives.moe_comm=alltoall", f"primitives.sharding={sharding}"],
    )
    plan = check_run(cfg, 2)
    state = build_context(plan.layout, torch.device("cpu"), fake=True)
    assert (state.ep_size, state.dense_size, state.expert_size, state.ep_rank) == (2, 2, 1, 1)

    def refuse(group=None):
        if group is not None:
            raise AssertionError("a size read back from a process group")
        return 2

    monkeypatch.setattr(dist, "get_world_size", refuse)
    model = build_model(plan.arch, cfg.primitives, state, device="meta")
    experts = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))
    assert experts.experts.w_gate_up.shape[0] == plan.arch.num_experts // 2
    assert experts.dispatch.ep == 2
    if sharding == "zero1":
        wrapped = get("sharding", sharding).factory(state, cfg.train).wrap(model)
        assert wrapped is model
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 2.0)
    norm = clip_grad_norm(
        [("w", w)], state, 1.0, lambda n: False, dense_sharded=True, expert_sharded=True
    )
    assert float(norm) == pytest.approx(12**0.5)  # the fake group sums nothing


def _walker():
    spec = importlib.util.spec_from_file_location(
        "global_batch_walk", os.path.join(ROOT, "benchmarks", "global_batch_walk.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_global_batch_walk_is_short():
    """Issue 36's goal: from Trainer.__init__ through one step, train.global_batch and what is
    computed from it are used in at most 8 files, and no call on the way climbs back up."""
    walk = _walker()
    files = walk.walk()
    assert "bumblebee/runtime/resolve.py" in files and "bumblebee/runtime/trainer.py" in files
    figures = walk.measure(files)
    assert figures["files"] <= 8 and figures["climbs"] == 0, (figures, walk.climbs(), files)

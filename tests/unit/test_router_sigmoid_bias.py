"""Router ``sigmoid_bias`` (primitives/moe/sigmoid_bias.py): parity with ``transformers``'
``DeepseekV3TopkRouter`` (group-limited top-k, bias for selection only, routed scaling,
renormalization), the bias update rule, replay of given experts, one-line errors, and in a
training run: the bias follows the load, is saved and resumed exactly, and is exported under
Hugging Face's name."""

import io
import json
import os

import pytest
import torch

from bumblebee import load_config
from bumblebee.config import PrimitivesConfig
from bumblebee.errors import ConfigError
from bumblebee.models import build_model, resolve_arch
from bumblebee.primitives.moe.router import build_router
from bumblebee.primitives.moe.sigmoid_bias import SigmoidBiasRouter
from bumblebee.runtime.trainer import Trainer

transformers = pytest.importorskip("transformers")


def hf_router(E=16, K=4, n_group=4, topk_group=2, scale=2.5, norm=True, H=24):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Config,
        DeepseekV3TopkRouter,
    )

    cfg = DeepseekV3Config(
        hidden_size=H,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=scale,
        norm_topk_prob=norm,
    )
    return DeepseekV3TopkRouter(cfg)


def by_expert(idx, w):
    """Rows' (expert ids, weights) in ascending id order (HF's top-k is unsorted)."""
    order = idx.argsort(dim=-1)
    return idx.gather(1, order), w.gather(1, order)


@pytest.mark.parametrize(
    "n_group,topk_group,norm,scale", [(4, 2, True, 2.5), (1, 1, False, 1.0), (8, 3, True, 1.0)]
)
def test_matches_transformers(n_group, topk_group, norm, scale):
    torch.manual_seed(0)
    E, K, H = 16, 4, 24
    hf = hf_router(E, K, n_group, topk_group, scale, norm, H)
    ours = SigmoidBiasRouter(
        H, E, K, norm, n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale
    )
    with torch.no_grad():
        hf.weight.normal_(0, 0.3)
        hf.e_score_correction_bias.normal_(0, 0.2)  # large enough to change the choice
        ours.weight.copy_(hf.weight)
        ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(64, H)
    _, w_hf, i_hf = hf(x)
    r = ours(x)
    i_a, w_a = by_expert(r.idx_TK, r.weight_TK)
    i_b, w_b = by_expert(i_hf, w_hf)
    assert torch.equal(i_a, i_b)
    torch.testing.assert_close(w_a, w_b, rtol=1e-6, atol=1e-7)
    # the bias changed the selection of some tokens, never the weights' formula
    plain = SigmoidBiasRouter(
        H, E, K, norm, n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale
    )
    plain.load_state_dict(
        {"weight": ours.weight.detach(), "e_score_correction_bias": torch.zeros(E)}
    )
    assert not torch.equal(by_expert(plain(x).idx_TK, r.weight_TK)[0], i_a)
    # group-limited: every chosen expert lies in one of the topk_group kept groups
    groups = r.idx_TK // (E // n_group)
    assert all(len(set(g.tolist())) <= topk_group for g in groups)


def test_gradients_reach_the_weight_not_the_bias():
    torch.manual_seed(1)
    router = SigmoidBiasRouter(8, 8, 2, True)
    torch.nn.init.normal_(router.weight, 0, 0.5)
    x = torch.randn(10, 8, requires_grad=True)
    r = router(x)
    (r.weight_TK.sum() * 3 + r.probs_TE.pow(2).sum()).backward()
    assert (
        router.weight.grad is not None
        and router.weight.grad.abs().sum() > 0
        and x.grad.abs().sum() > 0
    )
    assert not router.e_score_correction_bias.requires_grad
    assert torch.allclose(r.probs_TE.sum(-1), torch.ones(10))


def test_bias_update_rule_and_replay():
    router = SigmoidBiasRouter(4, 4, 1, False)
    router.update_bias(
        torch.tensor([10.0, 2.0, 4.0, 4.0]), 0.01
    )  # mean 5: over, under, under, under
    assert router.e_score_correction_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    router.update_bias(torch.tensor([5.0, 5.0, 5.0, 5.0]), 0.01)  # balanced: unchanged
    assert router.e_score_correction_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])
    torch.nn.init.normal_(router.weight)
    x = torch.randn(6, 4)
    given = torch.tensor([[3], [2], [1], [0], [0], [1]])
    r = router(x, given)
    assert torch.equal(r.idx_TK, given)
    torch.testing.assert_close(r.weight_TK, router.scores(x).gather(1, given))


def test_bad_groups_and_softmax_refuses_groups():
    with pytest.raises(ConfigError, match="n_group must be >= 1 and divide num_experts"):
        SigmoidBiasRouter(8, 16, 2, True, n_group=3)
    with pytest.raises(ConfigError, match="topk_group must be in 1..n_group"):
        SigmoidBiasRouter(8, 16, 2, True, n_group=4, topk_group=5)
    with pytest.raises(ConfigError, match="exceeds the experts of the kept groups"):
        SigmoidBiasRouter(8, 16, 5, True, n_group=4, topk_group=1)

    class Arch:
        hidden_size, num_experts, num_experts_per_tok, norm_topk_prob = 8, 16, 2, True
        n_group, topk_group, routed_scaling_factor = 4, 2, 2.5

    with pytest.raises(ConfigError, match="softmax_topk' has no group-limited routing"):
        build_router("softmax_topk", Arch())
    r = build_router("sigmoid_bias", Arch())
    assert (r.n_group, r.topk_group, r.routed_scaling_factor) == (4, 2, 2.5)


SMALL = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=8",
    "model.arch.num_experts_per_tok=2",
    "primitives.loss=ce",
    "primitives.recompute=none",
    "primitives.router=sigmoid_bias",
    "train.seq_len=64",
    "train.global_batch=2",
    "train.micro_batch=1",
    "train.eval_every=0",
    "train.deterministic=true",
    "model.arch.router_aux_loss_coef=0.0",
    "moe.bias_update_rate=0.01",
]


def trainer(tmp_path, name, *extra):
    return Trainer(
        load_config(None, SMALL + [f"train.out_dir={tmp_path / name}", *extra]),
        stream=io.StringIO(),
    )


def biases(model):
    return torch.stack([r.e_score_correction_bias.clone() for r in model.routers()])


def test_training_moves_bias_saves_resumes_and_exports(tmp_path):
    t = trainer(
        tmp_path,
        "a",
        "train.steps=4",
        "train.save_every=2",
        "train.export_hf=true",
        "moe.load_histogram_every=2",
    )
    records = []
    for _ in range(2):
        records.append(t.train_step())
        t.checkpoint.on_step(t.step)
    at2 = biases(t.model)
    # one update per step of +-rate (0 at exactly mean load) per expert; the step's load decides the sign
    assert at2.abs().max().item() == pytest.approx(0.02, abs=1e-6)
    assert torch.allclose(at2 * 100, (at2 * 100).round(), atol=1e-4)
    rec = records[-1]
    assert (
        rec["expert_load_max_over_mean"] >= 1.0
        and rec["expert_load_cv"] >= 0.0
        and rec["dropped_tokens"] == 0
    )
    # the histogram every 2 steps: [layer][expert] counts of the global batch (2 x 64 tokens, top-2)
    hist = torch.tensor(rec["expert_load"], dtype=torch.float32)
    assert (
        "expert_load" not in records[0]
        and hist.shape == (2, 8)
        and hist.sum(1).tolist() == [256.0, 256.0]
    )
    assert rec["expert_load_max_over_mean"] == pytest.approx(
        float((hist.max(1).values / hist.mean(1)).max())
    )
    while t.step < 4:
        records.append(t.train_step())
        t.checkpoint.on_step(t.step)
    t.checkpoint.on_end(t.step)
    final = biases(t.model)
    # resume at step 2 (into another out_dir: a continuation in "a" would set a's step 4 aside, as a
    # run that redoes steps 3-4 must): the bias comes back from the checkpoint and the run continues exactly
    r = trainer(
        tmp_path,
        "a2",
        "train.steps=4",
        f"train.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000002'}",
    )
    assert torch.equal(biases(r.model), at2)
    resumed = [r.train_step() for _ in range(2)]
    assert [x["loss"] for x in resumed] == [x["loss"] for x in records[2:]]
    assert torch.equal(biases(r.model), final)
    # a fresh run without the checkpoint would not have this bias (so the check above can fail)
    assert not torch.equal(biases(trainer(tmp_path, "b", "train.steps=4").model), at2)
    # export: Hugging Face's name, the live values
    from safetensors.torch import load_file

    from bumblebee.runtime.checkpoint.export import export_checkpoint

    export_checkpoint(str(tmp_path / "a"), str(tmp_path / "hf"))
    tensors = load_file(os.path.join(tmp_path / "hf", "model.safetensors"))
    for i in range(2):
        assert torch.equal(tensors[f"model.layers.{i}.mlp.gate.e_score_correction_bias"], final[i])
    # and loads back into a sigmoid_bias model (from_hf with that router)
    import bumblebee

    back = bumblebee.from_hf(str(tmp_path / "hf"), prims=PrimitivesConfig(router="sigmoid_bias"))
    assert torch.equal(biases(back), final)
    assert json.load(open(tmp_path / "hf" / "config.json"))["model_type"] == "qwen3_moe"


def test_either_family_builds_it():
    for name in ("qwen3_moe", "qwen3_5_moe"):
        cfg = load_config(None, [f"model.name={name}", "primitives.router=sigmoid_bias"])
        model = build_model(resolve_arch(cfg.model), cfg.primitives)
        assert all(isinstance(r, SigmoidBiasRouter) for r in model.routers()) and model.routers()


def test_trainer_pipeline_refuses_what_it_cannot_do():
    from bumblebee.runtime.resolve import check_run

    def check_trainer_pipeline(cfg):  # what the Trainer resolves before building a pipeline
        check_run(cfg, 2)

    with pytest.raises(ConfigError, match="train.balance = 'step' needs every micro-batch"):
        check_trainer_pipeline(load_config(None, ["parallel.pp=2", "train.balance=step"]))
    check_trainer_pipeline(
        load_config(None, ["parallel.pp=2"])
    )  # "auto": micro_batch under a pipeline
    check_trainer_pipeline(load_config(None, ["parallel.pp=2", "train.balance=micro_batch"]))
    # each stage moves its own routers' biases (tests/distributed/test_deepseek_layouts.py)
    check_trainer_pipeline(
        load_config(
            None, ["parallel.pp=2", "train.balance=micro_batch", "primitives.router=sigmoid_bias"]
        )
    )


def test_progress_line_and_report_read_the_load():
    from bumblebee.report_panels import expert_series
    from bumblebee.runtime.metrics import MetricsWriter

    out = io.StringIO()
    w = MetricsWriter(None, total_steps=2, stream=out)
    w.active = True  # print only (no file)
    rec = {
        "step": 1,
        "loss": 1.0,
        "aux_loss": 2.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 1.0,
        "peak_mem_bytes": 0,
        "expert_load_max_over_mean": 3.25,
        "expert_load_worst_layer": 1,
        "expert_load_cv": 0.5,
        "expert_load": [[1, 2], [3, 4]],
    }
    w._progress(rec)
    w._progress({**rec, "expert_load_max_over_mean": 1.5})
    lines = out.getvalue().splitlines()
    assert "load max/mean 3.2 (layer 1)" in lines[0] and "load max/mean" not in lines[1]
    title, series = expert_series([rec])
    assert sorted(series) == ["expert_load_cv", "expert_load_max_over_mean"]

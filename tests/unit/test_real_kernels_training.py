"""Training steps with FLA's real Triton kernels on CPU (``train.emulate_cuda = "real_kernels"``:
the emulated-CUDA mode with FLA's ``chunk_gated_delta_rule``, ``chunk_kda`` and ``causal_conv1d``
run through Triton's interpreter in place of their references) against the plain CPU path, for a
tiny Qwen3.5-MoE (Gated DeltaNet + gated attention) and a tiny Kimi-Linear (KDA + MLA): two
optimizer steps on packed documents (several per row), losses and gradient norms equal to fp32
rounding, and FLA's entry points counted as called. The value's checks (a typo, the packages
absent) run everywhere; the steps are skipped without ``triton`` and ``fla-core``."""

import importlib
import io

import pytest
from data_helpers import write_jsonl_docs

from bumblebee import load_config
from bumblebee.config import ConfigError
from bumblebee.primitives import triton_interpreter
from bumblebee.runtime.trainer import Trainer

MISSING = triton_interpreter.missing()
# two rows of packed documents (the glue's two calls: documents with states, the middle one
# without); KDA's fewer tokens: one of its kernels runs a program per token
DOCS = {"qwen3_5": [[12, 20], [5, 14, 13]], "kimi_linear": [[6, 10], [3, 8, 5]]}
COMMON = [
    "train.global_batch=2",
    "train.micro_batch=2",
    "train.clip_grad=0",
    "train.lr=3e-3",
    "train.warmup_steps=1",
    "train.eval_every=0",
    "train.steps=2",
    "data.source='jsonl'",
    "model.arch.vocab_size=256",
    "model.arch.hidden_size=64",
    "model.arch.moe_intermediate_size=32",
    "model.arch.num_hidden_layers=2",
    'model.arch.layer_types=["linear_attention", "full_attention"]',
]
FAMILIES = {
    "qwen3_5": [
        "model.name=qwen3_5_moe",
        "model.arch.num_experts=4",
        "model.arch.shared_expert_intermediate_size=32",
        "model.arch.linear_num_key_heads=1",
        "model.arch.linear_num_value_heads=2",
        "model.arch.linear_key_head_dim=16",
        "model.arch.linear_value_head_dim=16",
        "model.arch.num_attention_heads=2",
        "model.arch.num_key_value_heads=1",
        "model.arch.head_dim=16",
    ],
    "kimi_linear": [
        "model.name=kimi_linear",
        "model.arch.n_routed_experts=4",
        "model.arch.intermediate_size=64",
        'model.arch.mlp_layer_types=["dense", "sparse"]',
        "model.arch.linear_num_heads=2",
        "model.arch.linear_head_dim=16",
        "model.arch.num_attention_heads=2",
        "model.arch.kv_lora_rank=16",
        "model.arch.qk_nope_head_dim=16",
        "model.arch.qk_rope_head_dim=8",
        "model.arch.v_head_dim=16",
    ],
}
# FLA entry points each family's linear-attention layer calls
CALLED = {
    "qwen3_5": ("chunk_gated_delta_rule", "causal_conv1d"),
    "kimi_linear": ("chunk_kda", "causal_conv1d"),
}


def test_emulate_cuda_values_are_checked():
    with pytest.raises(
        ConfigError, match="train.emulate_cuda must be true, false or 'real_kernels'"
    ):
        load_config(None, ["train.emulate_cuda=real"])


def test_real_kernels_refused_without_packages(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "fla" else find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match="fla-core not installed") as e:
        load_config(None, ["train.emulate_cuda=real_kernels"])
    assert len(str(e.value).splitlines()) == 1


def _counted(fn, name, calls):
    def spy(*a, **k):
        calls[name] = calls.get(name, 0) + 1
        return fn(*a, **k)

    return spy


def _steps(overrides):
    trainer = Trainer(load_config(None, overrides), stream=io.StringIO())
    return [(r["loss"], r["grad_norm"]) for r in (trainer.train_step(), trainer.train_step())]


@pytest.mark.skipif(MISSING is not None, reason=f"real kernels: {MISSING}")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_real_kernels_training_matches_cpu(family, tmp_path, monkeypatch):
    data = write_jsonl_docs(tmp_path / "docs.jsonl", DOCS[family])
    seq = f"train.seq_len={sum(DOCS[family][0])}"
    base = COMMON + FAMILIES[family] + [seq, f"data.path={data}"]
    cpu = _steps(base + [f"train.out_dir={tmp_path / 'cpu'}"])
    calls = {}
    for name in CALLED[family]:
        module, attr = triton_interpreter.ENTRY_POINTS[name]
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, attr, _counted(getattr(mod, attr), name, calls))
    real = _steps(base + [f"train.out_dir={tmp_path / 'real'}", "train.emulate_cuda=real_kernels"])
    assert set(calls) == set(CALLED[family]), calls
    for step, ((l0, g0), (l1, g1)) in enumerate(zip(cpu, real), 1):
        assert abs(l1 - l0) <= 2e-5 * abs(l0), f"{family} step {step}: loss {l1} vs {l0}"
        assert abs(g1 - g0) <= 1e-4 * abs(g0), f"{family} step {step}: grad norm {g1} vs {g0}"

"""``train.balance = "step"`` does not depend on layout or micro-batching: one process
with accumulation 4 (and with one micro-batch of 4 sequences), 2 ranks (dp = 2; dp = 1 x
cp = 2, accumulation 4) and 4 ranks (dp = 4 x ep = 2, accumulation 1) give the same loss, balance
loss and grad norm per step,
for the softmax router with a large balance coefficient and for ``sigmoid_bias`` (whose bias,
updated from the global load, must also end identical). ``micro_batch`` balancing changes
with the micro-batch size (what global-batch balancing removes)."""

import io

import pytest
import torch
from dist_utils import run_distributed

from bumblebee import load_config
from bumblebee.runtime.trainer import Trainer

STEPS = 2
BASE = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=8",
    "model.arch.num_experts_per_tok=2",
    "model.arch.router_aux_loss_coef=0.1",
    "primitives.loss=ce",
    "primitives.recompute=full",
    "train.seq_len=64",
    "train.global_batch=4",
    "train.micro_batch=1",
    f"train.steps={STEPS}",
    "train.eval_every=0",
    "data.min_records=2",
    "data.max_records=4",
    "train.lr=1e-2",
    "train.warmup_steps=1",
    "train.balance=step",
]
ROUTERS = {
    "softmax": [],
    "sigmoid_bias": ["primitives.router=sigmoid_bias", "moe.bias_update_rate=0.01"],
}
# per-micro-batch balancing: cp ranks hold identical copies of each micro-batch's balance loss, so
# its coefficient is divided by cp as well (balance_denominator); a large coefficient makes the
# balance gradient a large part of the grad norm, so a missing factor shows far above rounding
MICRO = {
    "softmax micro_batch": ["train.balance=micro_batch", "model.arch.router_aux_loss_coef=1.0"]
}
SINGLE = ["primitives.sharding=none", "primitives.moe_comm=local"]


def run(overrides, out_dir):
    cfg = load_config(None, BASE + overrides + [f"train.out_dir={out_dir}"])
    t = Trainer(cfg, stream=io.StringIO())
    trace = [t.train_step() for _ in range(STEPS)]
    bias = (
        torch.stack([r.e_score_correction_bias for r in t.model.routers()])
        if "sigmoid" in str(overrides)
        else None
    )
    return [(r["loss"], r["aux_loss"], r["grad_norm"]) for r in trace], bias


def _ranks(rank, world, cases, out_dir):
    return [run(o, f"{out_dir}/{rank}") for o in cases]


def check(got, ref, what):
    (trace, bias), (ref_trace, ref_bias) = got, ref
    for step, (a, b) in enumerate(zip(trace, ref_trace)):
        for name, x, y in zip(("loss", "aux_loss", "grad_norm"), a, b):
            assert x == pytest.approx(y, rel=2e-5), f"{what}: step {step + 1} {name} {x} vs {y}"
    if ref_bias is not None:
        torch.testing.assert_close(bias, ref_bias, rtol=0, atol=1e-7, msg=what)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    refs = {r: run(SINGLE + extra + ["train.balance=step"], out) for r, extra in ROUTERS.items()}
    return refs | {r: run(SINGLE + extra, out) for r, extra in MICRO.items()}


def test_single_process_micro_batching(references, tmp_path):
    for router, extra in ROUTERS.items():
        got = run(SINGLE + extra + ["train.micro_batch=4"], tmp_path)
        check(got, references[router], f"{router} micro_batch=4")
    # per-micro-batch statistics are another loss at another micro-batch size
    a = run(SINGLE + ["train.balance=micro_batch"], tmp_path)[0]
    b = run(SINGLE + ["train.balance=micro_batch", "train.micro_batch=4"], tmp_path)[0]
    assert abs(a[0][1] - b[0][1]) > 1e-3


# (layout, router): each router on a 2-rank layout, the bias on 4 ranks
TWO = {
    ("fsdp2 dp=2", "softmax"): ["parallel.cp=1"],
    ("fsdp2 cp=2", "sigmoid_bias"): ["parallel.cp=2"],
    ("fsdp2 cp=2", "softmax micro_batch"): ["parallel.cp=2"],
}
FOUR = {("fsdp2 dp=4 x ep=2", "sigmoid_bias"): ["parallel.ep=2"]}


@pytest.mark.parametrize("world,layouts", [(2, TWO), (4, FOUR)])
def test_ranks_match_single_process(references, tmp_path, world, layouts):
    cases = [
        (name, router, (ROUTERS | MICRO)[router] + layout)
        for (name, router), layout in layouts.items()
    ]
    results = run_distributed(_ranks, world, [c[2] for c in cases], str(tmp_path))
    for i, (name, router, _) in enumerate(cases):
        check(results[0][i], references[router], f"{router} {name}")
        for r in range(1, world):  # every rank ends with the same bias
            if results[r][i][1] is not None:
                assert torch.equal(results[r][i][1], results[0][i][1]), (
                    f"{router} {name}: rank {r} bias"
                )

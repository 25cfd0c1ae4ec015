"""The primitive boundary: an implementation registered from outside the package, declaring its
own contract and costs, is trained, checked, planned, listed and paired without any other file
knowing its name.

Two stand-ins, registered by this file only: a MoE exchange that sorts rows with ``argsort``
(one rank) and a cross-entropy that runs the LM head in blocks of rows under checkpointing. Then
a grep: no code outside ``bumblebee/primitives/`` compares a value with the name of a MoE
exchange (the slot whose launch checks and planner terms are all declared facts).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from bumblebee import registry
from bumblebee.cli import main
from bumblebee.errors import ConfigError
from bumblebee.primitives.kernel_choice import Kernel, KernelQuery
from bumblebee.primitives.loss.ce import COSTS as CE_COSTS
from bumblebee.primitives.loss.ce import check_loss_args, reduce_loss
from bumblebee.primitives.moe.costs import MoeCommCosts
from bumblebee.registry import Need
from bumblebee.runtime.resolve import check_run, load_config
from bumblebee.runtime.trainer import Trainer

PACKAGE = Path(__file__).resolve().parents[2] / "bumblebee"


# ------------------------------------------------------------------ stand-in 1: a MoE exchange
class SortedDispatch:
    """All experts on this rank; rows grouped by a stable argsort of the expert ids."""

    def __init__(self, num_experts: int, **_unused):
        self.num_experts = num_experts

    def __call__(self, x_TH, idx_TK, weight_TK, expert_fn, drops: bool = False):
        T, K = idx_TK.shape
        order_N = torch.argsort(idx_TK.reshape(-1), stable=True)
        counts_E = torch.bincount(idx_TK.reshape(-1), minlength=self.num_experts)
        y_NH = expert_fn(x_TH[order_N // K], counts_E[: self.num_experts])
        y_TKH = torch.empty_like(y_NH).index_copy_(0, order_N, y_NH).view(T, K, -1)
        return (y_TKH * weight_TK[..., None].to(y_NH.dtype)).sum(1)


SORTED_COSTS = MoeCommCosts(
    # permuted input, fc1 output, activation and its gate product, fc2 output, the unsorted copy
    routed=lambda c, last: {
        "fwd": (((0, 0), (3, 4)),),
        "recompute": (((0, 0), (4 - last, 4)),),
        "bwd": (((0, 0), (4, 5)),),
    },
    exchanges=False,
)
SORTED_NEEDS = (Need("parallel.ep = 1 (every expert on this rank)", lambda f: f.ep == 1),)


# ------------------------------------------------------------ stand-in 2: a cross-entropy loss
def blocked_ce(
    hidden_TH,
    weight_VH,
    labels_T,
    *,
    ignore_index=-100,
    reduction="mean",
    with_entropy=False,
    temperature=1.0,
    vocab_group=None,
):
    """The LM head and CE over blocks of 16 rows, each block's logits recomputed in backward."""
    check_loss_args(hidden_TH, weight_VH, labels_T, reduction, temperature)
    valid_T = labels_T != ignore_index

    def block(h, y):
        logp = torch.log_softmax(F.linear(h, weight_VH).float() / temperature, -1)
        entropy = -(logp.exp() * logp).sum(-1)
        return -logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1), entropy

    parts = [
        checkpoint(block, h, y, use_reentrant=False)
        for h, y in zip(hidden_TH.split(16), labels_T.split(16), strict=True)
    ]
    loss_T = torch.cat([p[0] for p in parts]) * valid_T
    loss = reduce_loss(loss_T, valid_T, reduction)
    return (loss, torch.cat([p[1] for p in parts])) if with_entropy else loss


def blocked_kernel(q: KernelQuery) -> Kernel:
    return Kernel("blocks", f"16-row blocks ({'CUDA' if q.cuda else 'CPU'} eager)", False)


BLOCKED_COSTS = CE_COSTS.__class__(
    **{**vars(CE_COSTS), "kept_per_logit": 0, "work_per_logit": 10, "workspace": 0}
)


@pytest.fixture
def stand_ins():
    registry.register(
        "moe_comm",
        "sorted",
        summary="argsort-grouped rows, one rank",
        costs=SORTED_COSTS,
        needs=SORTED_NEEDS,
    )(SortedDispatch)
    registry.register("loss", "blocked_ce", costs=BLOCKED_COSTS, kernel=blocked_kernel)(blocked_ce)
    yield
    registry.unregister("moe_comm", "sorted")
    registry.unregister("loss", "blocked_ce")


TINY = [
    "model.arch.num_hidden_layers=2",
    "model.arch.hidden_size=32",
    "model.arch.head_dim=8",
    "model.arch.moe_intermediate_size=16",
    "model.arch.num_experts=4",
    "model.arch.num_experts_per_tok=2",
    "primitives.recompute=none",
    "primitives.attention=sdpa",
    "train.seq_len=48",
    "train.global_batch=2",
    "train.lr=3e-3",
    "train.warmup_steps=0",
    "train.eval_every=0",
    "data.min_records=2",
    "data.max_records=8",
]


def _losses(tmp_path, name, prims):
    out = tmp_path / name
    cfg = load_config(None, TINY + prims + ["train.steps=6", f"train.out_dir={out}"])
    Trainer(cfg, stream=io.StringIO()).run()
    return [json.loads(r)["loss"] for r in open(out / "metrics.jsonl") if '"loss"' in r]


def test_a_run_trains_with_both_stand_ins(stand_ins, tmp_path):
    """The stand-ins train, and match the references they replace step by step."""
    ref = _losses(tmp_path, "ref", ["primitives.moe_comm=local", "primitives.loss=ce"])
    got = _losses(tmp_path, "new", ["primitives.moe_comm=sorted", "primitives.loss=blocked_ce"])
    assert len(got) == len(ref) == 6
    assert got == pytest.approx(ref, rel=1e-4)
    assert got[-1] < got[0]


def test_launch_checks_read_the_declared_needs(stand_ins):
    cfg = load_config(None, TINY + ["primitives.moe_comm=sorted", "parallel.ep=2"])
    with pytest.raises(ConfigError, match=r"moe_comm = 'sorted' needs parallel.ep = 1 \(every"):
        check_run(cfg, 2)
    plan = check_run(load_config(None, TINY + ["primitives.moe_comm=sorted"]), 1)
    assert not plan.paired


def test_the_planner_prices_them(stand_ins, capsys):
    def plan(*sets):
        argv = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--seq", "16384"]
        argv += ["--layout", "tp=1 pp=1 ep=1 cp=8", "--json"]
        assert main(argv + [x for s in sets for x in ("--set", s)]) == 0
        return json.loads(capsys.readouterr().out)

    ref = plan("primitives.moe_comm=local", "primitives.loss=ce")
    new = plan("primitives.moe_comm=sorted", "primitives.loss=blocked_ce")
    label = json.dumps(new)
    assert "sorted" in label and "blocked_ce" in label
    # blocked_ce keeps no logits between forward and backward; its declared working set is larger
    assert json.dumps(ref) != json.dumps(new)


def test_listed_and_paired(stand_ins, tmp_path, capsys):
    assert main(["primitives"]) == 0
    listing = capsys.readouterr().out
    assert re.search(r"^\s+sorted\s+argsort-grouped rows, one rank", listing, re.M)
    assert re.search(r"^\s+blocked_ce\s+The LM head and CE over blocks", listing, re.M)
    assert re.search(r"cuda, bfloat16\s+-> 16-row blocks \(CUDA eager\)", listing)
    cfg = load_config(None, TINY + ["primitives.loss=blocked_ce"])
    assert check_run(cfg, 1, device="cuda").kernels["loss"].name == "blocks"
    sets = [x for s in TINY + [f"train.out_dir={tmp_path}"] for x in ("--set", s)]
    argv = ["pair", "--slot", "loss", "--a", "ce", "--b", "blocked_ce", "--steps", "2"]
    assert main(argv + sets) == 0, capsys.readouterr().out
    argv = ["pair", "--slot", "moe_comm", "--a", "local", "--b", "sorted", "--steps", "2"]
    assert main(argv + sets) == 0, capsys.readouterr().out


def test_no_code_outside_primitives_compares_a_moe_exchange_name():
    names = sorted(registry.implementations("moe_comm"))
    quoted = "|".join(re.escape(n) for n in names)
    compare = re.compile(
        rf"""(==|!=|\bin\s*[(\[{{])[^#\n]*["']({quoted})["']|["']({quoted})["']\s*(==|!=)"""
    )
    found = []
    for path in PACKAGE.rglob("*.py"):
        if "primitives" in path.relative_to(PACKAGE).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if compare.search(line.split("#")[0]):
                found.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)

"""``plan --explain``'s check of Megatron Bridge's CP sizing rules beside the recipe's."""

import json

from bumblebee.plan import cli
from bumblebee.plan.cp_rules import _pow2_near, check_cp_rules
from bumblebee.plan.hardware import get_gpu
from bumblebee.plan.layout import Layout, Workload
from bumblebee.plan.recipe import evaluate, recipe, recipe_primitives
from bumblebee.plan.spec import load_spec


def _rules(model, gpus, seq, layout=None, **prims):
    spec, _ = load_spec(model)
    gpu, work = get_gpu("h100"), Workload(seq=seq, global_batch=32)
    if layout is None:
        cand = recipe(spec, gpus, gpu, work, recipe_primitives(), set()).candidate
    else:
        p = recipe_primitives()
        p = type(p)(**{**p.__dict__, **prims})
        cand = evaluate(spec, layout, p, work, gpu)
    return cand, {r.rule: r for r in check_cp_rules(spec, cand, work, gpu)}


def test_pow2_near():
    assert [_pow2_near(x) for x in (0.5, 1, 2.7, 3.0, 5.6, 6, 32)] == [1, 1, 2, 4, 4, 8, 32]


def test_recipe_disagrees_at_128k_and_the_alternative_is_evaluated():
    cand, r = _rules("qwen3.5-35b-a3b", 32, 131072)
    assert cand.layout.cp == 4  # the recipe: 32K tokens per GPU
    first = r["cp ~= seq/4096, power of two"]
    assert not first.holds and "the rule gives cp 32" in first.detail
    # both alternatives at cp 32 evaluated with the planner's models, with their numbers
    assert "cp=32" in first.detail and "selective" in first.detail and "tok/s/GPU" in first.detail
    assert r["keep data parallelism alive"].holds
    assert r["cp a power of two"].holds
    assert not r["prefer selective recompute"].holds  # the recipe runs full recompute


def test_agreement_and_the_dp_floor():
    # 32K tokens: the rule's cp 8 on 8 GPUs leaves one data rank
    lay = Layout(tp=1, pp=1, ep=8, cp=8, dp_shard=1)
    _, r = _rules("qwen3-30b-a3b", 8, 32768, lay, moe_comm="alltoall", recompute="selective")
    assert r["cp ~= seq/4096, power of two"].holds
    assert not r["keep data parallelism alive"].holds
    assert "32 micro-batches per rank" in r["shrink the global batch as cp grows"].detail
    assert r["prefer selective recompute"].holds


def test_non_power_of_two_cp():
    lay = Layout(tp=1, pp=1, ep=2, cp=3, dp_shard=2)
    _, r = _rules("qwen3-30b-a3b", 6, 6 * 4096, lay, moe_comm="alltoall")
    assert not r["cp a power of two"].holds


def test_cli_text_and_json(capsys):
    args = ["--model", "qwen3-30b-a3b", "--gpus", "8", "--seq", "65536", "--explain"]
    assert cli.main(args + ["--layout", "tp=1 pp=1 ep=8 cp=2"]) == 0
    assert "CP sizing: Megatron Bridge's rules of thumb" in capsys.readouterr().out
    assert cli.main(args + ["--layout", "tp=1 pp=1 ep=8 cp=2", "--json"]) == 0
    rules = json.loads(capsys.readouterr().out)["cp_rules"]
    assert {r["rule"] for r in rules} >= {"keep data parallelism alive", "cp a power of two"}
    assert all(set(r) == {"rule", "holds", "detail"} for r in rules)

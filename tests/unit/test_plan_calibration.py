"""Planner calibration against the published Qwen3.5-35B-A3B / 32 x H100 / 128K points
(REFERENCE.md), and sanity of the memory and throughput models.

The published layouts are evaluated by the same formulas as every other layout
(no lookup). The published peak is read from rank 0, i.e. the first pipeline
stage: the last stage of the TP=2 PP=4 row holds the 32.55 GB fp32 logits of
REFERENCE.md's arithmetic on top of ~20 GB of static state, so 42.91 GB cannot be
that stage's peak (see the last test).
"""

import dataclasses

import pytest

from bumblebee.plan.hardware import GB, GPUS
from bumblebee.plan.layout import Layout, Primitives, Workload
from bumblebee.plan.memory import stage_memory
from bumblebee.plan.perf import estimate
from bumblebee.plan.recipe import evaluate
from bumblebee.plan.spec import load_spec, spec_from_hf_dict

H100 = GPUS["h100"]
WORK = Workload(seq=131072, global_batch=32)  # the planner's default global batch: one sequence per GPU
PUBLISHED = [  # (layout, loss, TFLOPs/GPU, peak GB): REFERENCE.md, full recompute, distributed optimizer
    (Layout(tp=2, pp=4, ep=8, cp=2, dp=2), "ce", 127.53, 42.91),
    (Layout(tp=1, pp=2, ep=8, cp=4, dp=4), "linear_ce", 162.07, 55.91),
]


@pytest.fixture(scope="module")
def qwen35():
    return load_spec("qwen3.5-35b-a3b")[0]


def _prims(loss):
    return Primitives(sharding="zero1", loss=loss, recompute="full", moe_comm="alltoall")


@pytest.mark.parametrize("layout,loss,tflops,peak_gb", PUBLISHED)
def test_published_points(qwen35, layout, loss, tflops, peak_gb):
    stages = stage_memory(qwen35, layout, _prims(loss), WORK)
    rank0 = stages[0].total / GB
    assert rank0 == pytest.approx(peak_gb, rel=0.10), stages[0].as_gb()
    perf = estimate(qwen35, layout, _prims(loss), WORK, H100)
    assert perf.tflops_per_gpu == pytest.approx(tflops, rel=0.15), perf.parts_s
    # the ordering of the two published layouts is reproduced
    assert perf.tokens_per_s_per_gpu == pytest.approx(
        perf.tflops_per_gpu * 1e12 / qwen35.model_flops_per_token(WORK.seq))


def test_published_ordering(qwen35):
    (l1, c1, *_), (l2, c2, *_) = PUBLISHED
    t1 = estimate(qwen35, l1, _prims(c1), WORK, H100).tflops_per_gpu
    t2 = estimate(qwen35, l2, _prims(c2), WORK, H100).tflops_per_gpu
    assert t2 > t1  # TP=1 PP=2 CP=4 linear CE beats TP=2 PP=4 CP=2 materialized CE


def test_reference_logits_arithmetic_and_last_stage(qwen35):
    """65,536 x 124,160 x 4 B = 32.55 GB fp32 logits (REFERENCE.md) sit on the last stage."""
    layout, loss, _, peak_gb = PUBLISHED[0]
    assert 65536 * (qwen35.vocab // layout.tp) * 4 / GB == pytest.approx(32.55, abs=0.01)
    last = stage_memory(qwen35, layout, _prims(loss), WORK)[-1]
    assert last.logits / GB > 32.55 and last.total / GB > peak_gb * 1.2


def test_param_counts_match_hf_and_arch():
    from bumblebee.models.arch import Qwen3MoeArch
    from bumblebee.models.presets import PRESETS

    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        arch = Qwen3MoeArch.from_hf_dict(PRESETS["qwen3_moe"][name])
        assert load_spec(name)[0].num_params()["total"] == arch.num_params()["total"]
    n = load_spec("qwen3.5-35b-a3b")[0].num_params()
    assert 34e9 < n["total"] < 36e9 and n["expert"] > 0.9 * n["total"]


def test_qwen35_config_forms_agree():
    """Text config, multimodal wrapper (text_config) and a config without layer_types."""
    from bumblebee.models.presets import PRESETS

    text = dict(PRESETS["qwen3_5_moe"]["qwen3.5-35b-a3b"])
    wrapped = {"model_type": "qwen3_5_moe", "text_config": {**text, "model_type": "qwen3_5_moe_text"},
               "vision_config": {"depth": 2}}
    no_types = {k: v for k, v in text.items() if k != "layer_types"}
    a, b, c = (spec_from_hf_dict(d) for d in (text, wrapped, no_types))
    assert a.num_params() == b.num_params() == c.num_params()
    assert a.mixers.count("attention") == 10 and a.mixers.count("gdn") == 30


# ---------------------------------------------------------------------------------- sanity


def _mem(spec, layout, prims, seq=131072, batch=32):
    return max(s.total for s in stage_memory(spec, layout, prims, Workload(seq=seq, global_batch=batch)))


def test_memory_falls_with_more_gpus_and_cp(qwen35):
    p = Primitives()
    m16 = _mem(qwen35, Layout(ep=8, cp=4, dp=4), p)
    m32 = _mem(qwen35, Layout(ep=8, cp=4, dp=8), p)
    m64 = _mem(qwen35, Layout(ep=8, cp=4, dp=16), p)
    assert m16 > m32 > m64  # fsdp2 shards static state over every GPU
    assert _mem(qwen35, Layout(ep=8, cp=2, dp=16), p) > m32 > _mem(qwen35, Layout(ep=8, cp=8, dp=4), p)


def test_linear_ce_logits_below_ce(qwen35):
    lay = Layout(ep=8, cp=4, dp=8)
    ce = stage_memory(qwen35, lay, Primitives(loss="ce"), WORK)[-1]
    lin = stage_memory(qwen35, lay, Primitives(loss="linear_ce"), WORK)[-1]
    assert lin.logits < ce.logits / 10 and lin.total < ce.total


def test_fsdp2_static_below_zero1(qwen35):
    lay = Layout(ep=8, cp=4, dp=8)
    f = stage_memory(qwen35, lay, Primitives(sharding="fsdp2"), WORK)[0]
    z = stage_memory(qwen35, lay, Primitives(sharding="zero1"), WORK)[0]
    static = lambda m: m.parameters + m.gradients + m.optimizer  # noqa: E731
    assert static(f) < static(z)
    assert static(f) / GB == pytest.approx(qwen35.num_params()["total"] * 18 / 32 / GB, rel=0.02)
    assert f.allgather > 0 and z.allgather == 0


def test_recompute_ordering(qwen35):
    lay = Layout(ep=8, cp=8, dp=4)
    full, sel, none = (stage_memory(qwen35, lay, Primitives(recompute=r, moe_comm="alltoall"), WORK)[0].activations
                       for r in ("full", "selective", "none"))
    assert full < sel < none
    t = {r: estimate(qwen35, lay, Primitives(recompute=r, moe_comm="alltoall"), WORK, H100).step_s
         for r in ("full", "none")}
    assert 1.1 < t["full"] / t["none"] < 1.45  # ~30% extra compute (REFERENCE.md)


def test_chunked_ep_hides_more_at_long_local_seq(qwen35):
    lay = Layout(ep=8, cp=1, dp=32)

    def gain(seq):
        w = Workload(seq=seq, global_batch=32)
        a = estimate(qwen35, lay, Primitives(moe_comm="alltoall"), w, H100).parts_s["ep_comm"]
        c = estimate(qwen35, lay, Primitives(moe_comm="chunked", moe_chunks=2), w, H100).parts_s["ep_comm"]
        return 1 - c / a

    assert 0 < gain(4096) < gain(65536)


def test_short_local_sequences_pay_launch_overhead(qwen35):
    def launch_share(seq):
        p = estimate(qwen35, Layout(ep=8, dp=32), Primitives(), Workload(seq=seq, global_batch=32), H100).parts_s
        return p["launch"] / sum(p.values())

    assert launch_share(1024) > 3 * launch_share(32768)


def test_faster_gpu_is_faster(qwen35):
    lay, p = Layout(ep=8, cp=4, dp=8), Primitives()
    h100 = evaluate(qwen35, lay, p, WORK, GPUS["h100"])
    b200 = evaluate(qwen35, lay, p, WORK, GPUS["b200"])
    assert b200.tokens_per_s > 1.5 * h100.tokens_per_s
    assert dataclasses.asdict(b200.memory) == dataclasses.asdict(h100.memory)

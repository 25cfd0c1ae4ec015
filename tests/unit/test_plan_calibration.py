"""Planner calibration: which published points the model was fitted on, and which
published behaviour it is checked against out of sample.

Source of every GPU figure below: published measurements of Qwen3.5-35B-A3B training on
32 x H100 80GB at a 128K sequence (full recompute in both rows, Megatron-style
distributed optimizer), and the published memory and overlap figures from the same
long-context MoE practice (the project records them without a URL; see docs/planner.md, "Calibration").

FITTED (in-sample). Four constants were tuned on the two points ``FIT_POINTS``:
``Efficiency.attn_fwd`` / ``attn_bwd`` (throughput) and ``FIXED_OVERHEAD_GB`` /
``FRAGMENTATION`` (peak memory), all in ``plan/hardware.py``. Re-evaluating those points
only shows the fit's residual; the test pins it (tolerance = the residual at fit time,
rounded up) so that a change elsewhere in the model cannot move them silently. The
published peak is rank 0's, i.e. the first pipeline stage's (see ``test_published_peak_
is_not_the_last_stage``). Every other memory term is arithmetic from the code that runs,
checked against the fake-tensor dry run (tests/unit/test_plan_dryrun.py), not fitted.

CHECKED (out of sample; no constant was fitted on these): full recompute's ~30% extra
compute, chunked EP overlap's gain at 4K and 64K, the fp32 logits arithmetic, plus the
monotone sanity properties at the end.
"""

import dataclasses
from typing import NamedTuple

import pytest

from bumblebee.config import PrimitivesConfig
from bumblebee.plan.hardware import GB, GPUS, MEMORY_MARGIN
from bumblebee.plan.layout import Layout, Workload
from bumblebee.plan.perf import estimate
from bumblebee.plan.recipe import evaluate, recipe_primitives
from bumblebee.plan.spec import load_spec, spec_from_hf_dict
from bumblebee.plan.timeline import stage_memory

H100 = GPUS["h100"]
WORK = Workload(seq=131072, global_batch=32)  # one 128K sequence per GPU


class Published(NamedTuple):
    layout: Layout
    loss: str
    tflops_per_gpu: float
    peak_gb: float


# published, Qwen3.5-35B-A3B / 32 x H100 / 128K / full recompute / distributed optimizer
PUBLISHED_TP2_PP4_EP8_CP2_CE = Published(
    Layout(tp=2, pp=4, ep=8, cp=2, dp_shard=2), "ce", 127.53, 42.91
)
PUBLISHED_TP1_PP2_EP8_CP4_LINEAR_CE = Published(
    Layout(tp=1, pp=2, ep=8, cp=4, dp_shard=4), "linear_ce", 162.07, 55.91
)
FIT_POINTS = [PUBLISHED_TP2_PP4_EP8_CP2_CE, PUBLISHED_TP1_PP2_EP8_CP4_LINEAR_CE]
# residual of the fit (model / published - 1), measured when the constants were set:
# memory +2.5 % / -2.4 % (stage 0; re-fitted when the GDN CP terms were counted from the two-call
# scan, which left the old constants at +0.2 % / -4.2 %), throughput +9.0 % / +3.4 %
FIT_RESIDUAL_MEMORY, FIT_RESIDUAL_TFLOPS = 0.03, 0.10

# published facts used out of sample
PUBLISHED_RECOMPUTE_EXTRA_COMPUTE = 0.30  # "full recompute costs about 30% extra compute"
PUBLISHED_LOGITS_GB = 32.55  # fp32 logits, 65,536 local tokens x 124,160 vocab shard (TP=2) x 4 B
# chunked EP overlap (2 chunks), gain on one MoE layer forward + backward:
# "single-digit percent at 4K, around a quarter at 64K"
PUBLISHED_CHUNKED_GAIN_4K_MAX, PUBLISHED_CHUNKED_GAIN_64K = 0.10, 0.25


@pytest.fixture(scope="module")
def qwen35():
    return load_spec("qwen3.5-35b-a3b")[0]


def _prims(loss):
    return PrimitivesConfig(sharding="zero1", loss=loss, recompute="full", moe_comm="alltoall")


# ------------------------------------------------------------------------ fitted (in-sample)
@pytest.mark.parametrize("point", FIT_POINTS, ids=["tp2_pp4_ce", "tp1_pp2_linear_ce"])
def test_fit_residual_on_the_fitted_points(qwen35, point):
    stages = stage_memory(qwen35, point.layout, _prims(point.loss), WORK)
    assert stages[0].total / GB == pytest.approx(point.peak_gb, rel=FIT_RESIDUAL_MEMORY), stages[
        0
    ].as_gb()
    perf = estimate(qwen35, point.layout, _prims(point.loss), WORK, H100)
    assert perf.tflops_per_gpu == pytest.approx(point.tflops_per_gpu, rel=FIT_RESIDUAL_TFLOPS), (
        perf.parts_s
    )


def test_fitted_points_keep_their_order(qwen35):
    """The linear-CE TP=1 layout is the faster one by 27% published; the model must keep
    the order with a margin (not merely by rounding)."""
    t1, t2 = (
        estimate(qwen35, p.layout, _prims(p.loss), WORK, H100).tflops_per_gpu for p in FIT_POINTS
    )
    assert t2 / t1 > 1.15


# -------------------------------------------------------------------- checked (out of sample)
def test_full_recompute_costs_about_30_percent(qwen35):
    lay = Layout(ep=8, cp=8, dp_shard=4)
    t = {
        r: estimate(
            qwen35, lay, PrimitivesConfig(recompute=r, moe_comm="alltoall"), WORK, H100
        ).step_s
        for r in ("full", "none")
    }
    assert t["full"] / t["none"] - 1 == pytest.approx(PUBLISHED_RECOMPUTE_EXTRA_COMPUTE, abs=0.1)


def _moe_layer_gain(spec, seq):
    """1 - (chunk2 / no-chunk) time of the MoE part (expert GEMMs, exposed all-to-all and
    the extra kernel launches of chunking), forward + backward."""
    lay, w = Layout(ep=8, cp=1, dp_shard=32), Workload(seq=seq, global_batch=32)
    moe = lambda p: p["experts"] + p["ep_comm"] + p["launch"]  # noqa: E731
    a = estimate(spec, lay, PrimitivesConfig(moe_comm="alltoall"), w, H100).parts_s
    c = estimate(spec, lay, PrimitivesConfig(moe_comm="chunked", moe_chunks=2), w, H100).parts_s
    return 1 - moe(c) / moe(a)


def test_chunked_ep_gain_at_64k_is_about_a_quarter(qwen35):
    g4, g64 = _moe_layer_gain(qwen35, 4096), _moe_layer_gain(qwen35, 65536)
    assert g64 > g4 > 0
    assert g64 == pytest.approx(PUBLISHED_CHUNKED_GAIN_64K, abs=0.07)


@pytest.mark.xfail(
    strict=True,
    reason="known disagreement: the model hides ~25% of the MoE layer at 4K "
    "(published: single-digit percent); it under-counts small-chunk costs",
)
def test_chunked_ep_gain_at_4k_is_single_digit(qwen35):
    assert _moe_layer_gain(qwen35, 4096) < PUBLISHED_CHUNKED_GAIN_4K_MAX


def test_published_peak_is_not_the_last_stage(qwen35):
    """The last stage of the TP=2 PP=4 row holds the published 32.55 GB of fp32 logits on
    top of its static state, so the published 42.91 GB peak cannot be that stage's."""
    point = PUBLISHED_TP2_PP4_EP8_CP2_CE
    assert qwen35.vocab == 248_320  # 124,160 per TP=2 shard, as the published arithmetic uses
    last = stage_memory(qwen35, point.layout, _prims(point.loss), WORK)[-1]
    assert last.moment == "loss" and last.loss / GB > PUBLISHED_LOGITS_GB  # + the bf16 logits
    assert last.total / GB > point.peak_gb * 1.2


@pytest.mark.parametrize("point", FIT_POINTS, ids=["tp2_pp4_ce", "tp1_pp2_linear_ce"])
def test_every_stage_of_the_published_runs_fits(qwen35, point):
    """Both rows ran on 80 GB H100s: every stage of both must come out feasible. Checked, not
    fitted: the fit only sees stage 0; the TP=2 last stage holds the vocab-parallel CE's bf16
    logits and one fp32 working copy (6 B per logit, 48.8 GB)."""
    limit = H100.hbm_gb * (1 - MEMORY_MARGIN)
    stages = stage_memory(qwen35, point.layout, _prims(point.loss), WORK)
    assert all(s.total / GB <= limit for s in stages), [round(s.total / GB, 1) for s in stages]
    assert evaluate(qwen35, point.layout, _prims(point.loss), WORK, H100).feasible


def test_ce_logits_are_six_bytes_per_element(qwen35):
    """The vocab-parallel CE's peak: bf16 logits + one fp32 copy, 65,536 x 124,160 x 6 B."""
    point = PUBLISHED_TP2_PP4_EP8_CP2_CE
    last = stage_memory(qwen35, point.layout, _prims("ce"), WORK)[-1]
    logits = 65_536 * 124_160 * 6
    assert logits < last.loss < logits * 1.03


def test_param_counts_match_hf_and_arch():
    from bumblebee.models.presets import PRESETS
    from bumblebee.models.qwen3_moe import Qwen3MoeArch

    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        arch = Qwen3MoeArch.from_hf_dict(PRESETS["qwen3_moe"][name])
        assert load_spec(name)[0].num_params()["total"] == arch.num_params()["total"]
    n = load_spec("qwen3.5-35b-a3b")[0].num_params()
    assert 34e9 < n["total"] < 36e9 and n["expert"] > 0.9 * n["total"]


def test_qwen35_config_forms_agree():
    """Text config, multimodal wrapper (text_config) and a config without layer_types."""
    from bumblebee.models.presets import PRESETS

    text = dict(PRESETS["qwen3_5_moe"]["qwen3.5-35b-a3b"])
    wrapped = {
        "model_type": "qwen3_5_moe",
        "text_config": {**text, "model_type": "qwen3_5_moe_text"},
        "vision_config": {"depth": 2},
    }
    no_types = {k: v for k, v in text.items() if k != "layer_types"}
    a, b, c = (spec_from_hf_dict(d) for d in (text, wrapped, no_types))
    assert a.num_params() == b.num_params() == c.num_params()
    assert a.mixers.count("attention") == 10 and a.mixers.count("gdn") == 30


# ---------------------------------------------------------------------------------- sanity


def _mem(spec, layout, prims, seq=131072, batch=32):
    return max(
        s.total for s in stage_memory(spec, layout, prims, Workload(seq=seq, global_batch=batch))
    )


def test_memory_falls_with_more_gpus_and_cp(qwen35):
    p = recipe_primitives()
    m16 = _mem(qwen35, Layout(ep=8, cp=4, dp_shard=4), p)
    m32 = _mem(qwen35, Layout(ep=8, cp=4, dp_shard=8), p)
    m64 = _mem(qwen35, Layout(ep=8, cp=4, dp_shard=16), p)
    assert m16 > m32 > m64  # fsdp2 shards static state over every GPU
    assert (
        _mem(qwen35, Layout(ep=8, cp=2, dp_shard=16), p)
        > m32
        > _mem(qwen35, Layout(ep=8, cp=8, dp_shard=4), p)
    )


def test_linear_ce_logits_below_ce(qwen35):
    lay = Layout(ep=8, cp=4, dp_shard=8)
    ce = stage_memory(qwen35, lay, PrimitivesConfig(loss="ce", moe_comm="chunked"), WORK)[-1]
    lin = stage_memory(qwen35, lay, PrimitivesConfig(loss="linear_ce", moe_comm="chunked"), WORK)[
        -1
    ]
    assert lin.loss < ce.loss / 10 and lin.total < ce.total


def test_fsdp2_static_below_zero1(qwen35):
    lay = Layout(ep=8, cp=4, dp_shard=8)
    f = stage_memory(qwen35, lay, PrimitivesConfig(sharding="fsdp2", moe_comm="chunked"), WORK)[0]
    z = stage_memory(qwen35, lay, PrimitivesConfig(sharding="zero1", moe_comm="chunked"), WORK)[0]
    static = lambda m: m.parameters + m.gradients + m.optimizer  # noqa: E731
    assert static(f) < static(z)
    assert static(f) / GB == pytest.approx(
        qwen35.num_params()["total"] * 16 / 32 / GB, rel=0.02
    )  # fp32 4+4+8
    assert f.allgather > 0 and z.allgather == 0


def test_recompute_ordering(qwen35):
    lay = Layout(ep=8, cp=8, dp_shard=4)
    full, sel, none = (
        stage_memory(qwen35, lay, PrimitivesConfig(recompute=r, moe_comm="alltoall"), WORK)[
            0
        ].saved_inputs
        for r in ("full", "selective", "none")
    )
    assert full < sel < none


def test_short_local_sequences_pay_launch_overhead(qwen35):
    def launch_share(seq):
        p = estimate(
            qwen35,
            Layout(ep=8, dp_shard=32),
            recipe_primitives(),
            Workload(seq=seq, global_batch=32),
            H100,
        ).parts_s
        return p["launch"] / sum(p.values())

    assert launch_share(1024) > 3 * launch_share(32768)


def test_faster_gpu_is_faster(qwen35):
    lay, p = Layout(ep=8, cp=4, dp_shard=8), recipe_primitives()
    h100 = evaluate(qwen35, lay, p, WORK, GPUS["h100"])
    b200 = evaluate(qwen35, lay, p, WORK, GPUS["b200"])
    assert b200.tokens_per_s > 1.5 * h100.tokens_per_s
    assert dataclasses.asdict(b200.memory) == dataclasses.asdict(h100.memory)

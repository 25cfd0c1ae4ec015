"""The planner counts held-out evaluation (plan/timeline.py, moment ``eval``): every stage has
it, it holds at least the static state, the stage's forward working set and, on the last stage,
the loss primitive's forward (``ce``: logits of every local token), and it never exceeds the
training moments of the stage (forward-only: no saved inputs, no head gradient)."""

import pytest

from bumblebee.config import PrimitivesConfig
from bumblebee.plan.hardware import GB
from bumblebee.plan.layout import Layout, Workload
from bumblebee.plan.spec import load_spec
from bumblebee.plan.timeline import stage_timeline

LAYOUTS = [
    Layout(ep=8, cp=1, dp_shard=8),
    Layout(ep=8, cp=4, dp_shard=8),
    Layout(pp=2, ep=8, cp=2, dp_shard=4),
]


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "qwen3.5-35b-a3b"])
@pytest.mark.parametrize("loss", ["linear_ce", "ce"])
def test_eval_moment_is_counted_and_below_training(model, loss):
    spec = load_spec(model)[0]
    prims, work = (
        PrimitivesConfig(loss=loss, moe_comm="alltoall"),
        Workload(seq=32768, global_batch=64),
    )
    for lay in LAYOUTS:
        stages = stage_timeline(spec, lay, prims, work)
        for st in stages:
            ev = st.moments["eval"]
            train = max(m.total for name, m in st.moments.items() if name != "eval")
            static = ev.parameters + ev.gradients + ev.optimizer
            fwd = st.moments["forward"]
            print(
                f"{model} {loss} {lay} stage {st.stage}: eval {ev.total / GB:.2f} GB, training peak "
                f"{train / GB:.2f} GB"
            )
            assert static < ev.total <= train, (lay, st.stage)
            # at least the largest layer forward ...
            assert (
                ev.total
                >= static + fwd.live_layer + fwd.moe_buffers + fwd.workspace + fwd.allgather
            )
        # ... and on the last stage the loss forward
        t = work.seq * work.micro_batch // lay.cp
        # ce: bf16 logits + fp32 working copy; linear_ce: four fp32 [2048, 8192] tiles
        head = t * spec.vocab * 6 if loss == "ce" else 4 * 2048 * 8192 * 4
        ev = stages[-1].moments["eval"]
        assert ev.total >= ev.parameters + ev.gradients + ev.optimizer + head

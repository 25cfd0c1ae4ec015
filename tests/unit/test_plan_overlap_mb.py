"""The planner's terms for ``moe_comm = overlap_mb`` (two micro-batches in flight, pp = 1).

Time (plan/perf_layer.py): every all-to-all runs under the partner micro-batch's compute of the same
pass, so the exposed all-to-all is what that pass cannot cover: none where the layer's compute
outlasts its exchanges, the excess where it does not. Never more than ``alltoall``'s (fully
exposed), and the expert GEMMs are unchanged. Memory (plan/memory.py, timeline.py): both
micro-batches sit inside a layer at once, so the live layer and MoE buffers count twice, and
with the micro-batch balance loss two micro-batches' saved inputs are alive instead of one.
"""

import dataclasses

import pytest

from bumblebee.config import PrimitivesConfig
from bumblebee.plan.hardware import GPUS
from bumblebee.plan.layout import Layout, Workload
from bumblebee.plan.memory import in_flight
from bumblebee.plan.perf import estimate
from bumblebee.plan.spec import load_spec
from bumblebee.plan.timeline import stage_memory

LAY = Layout(ep=8, cp=1, dp_shard=16)
H100 = GPUS["h100"]


@pytest.fixture(scope="module")
def spec():
    return load_spec("qwen3-30b-a3b")[0]


def prims(comm, **kw):
    return PrimitivesConfig(sharding="zero1", recompute="full", moe_comm=comm, **kw)


@pytest.mark.parametrize("seq", [4096, 65536])
def test_exposed_all_to_all(spec, seq):
    work = Workload(seq=seq, global_batch=32)
    a2a = estimate(spec, LAY, prims("alltoall"), work, H100).parts_s
    mb = estimate(spec, LAY, prims("overlap_mb"), work, H100).parts_s
    assert mb["experts"] == pytest.approx(a2a["experts"])
    assert a2a["ep_comm"] > 0
    assert mb["ep_comm"] < a2a["ep_comm"]
    # a hugely slower network: the partner's compute covers only part of the exchanges
    slow = dataclasses.replace(
        H100, nvlink_gbps=H100.nvlink_gbps / 1000, ib_gbps=H100.ib_gbps / 1000
    )
    a2a_s = estimate(spec, LAY, prims("alltoall"), work, slow).parts_s
    mb_s = estimate(spec, LAY, prims("overlap_mb"), work, slow).parts_s
    assert 0 < mb_s["ep_comm"] < a2a_s["ep_comm"]
    hidden = a2a_s["ep_comm"] - mb_s["ep_comm"]  # at most the layers' compute of one micro-batch
    assert hidden <= sum(v for k, v in a2a_s.items() if k not in ("ep_comm", "loss")) * 1.0001


def test_memory_two_in_a_layer(spec):
    work = Workload(seq=16384, global_batch=32, balance="micro_batch")
    assert in_flight(work, LAY, 0, prims("alltoall")) == 1
    assert in_flight(work, LAY, 0, prims("overlap_mb")) == 2
    a2a, mb = (stage_memory(spec, LAY, prims(c), work)[0] for c in ("alltoall", "overlap_mb"))
    assert mb.moment == a2a.moment == "backward"
    assert mb.live_layer == pytest.approx(2 * a2a.live_layer)
    assert mb.moe_buffers == pytest.approx(2 * a2a.moe_buffers)
    assert mb.saved_inputs > a2a.saved_inputs  # the partner's saved layer inputs
    assert mb.total > a2a.total
    # the global-batch balance loss keeps every micro-batch in flight already
    glob = dataclasses.replace(work, balance="step")
    assert in_flight(glob, LAY, 0, prims("overlap_mb")) == in_flight(
        glob, LAY, 0, prims("alltoall")
    )

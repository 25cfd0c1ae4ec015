"""Layout-independent initialization (primitives/init.py): any row range of a tensor drawn on its
own equals those rows of the full tensor, so a shard, an expert block or a pipeline stage starts
from exactly its part of the weights; a model built on the meta device and materialized equals
one built directly; the values depend on the seed and the tensor name, not on the order of
construction or on torch's global generator."""

from __future__ import annotations

import math

import pytest
import torch

import bumblebee
from bumblebee.config import ModelConfig
from bumblebee.models import build_model, materialize, resolve_arch
from bumblebee.primitives import init


@pytest.mark.parametrize(
    "shape", [(37,), (300, 7), (5, 1024, 1024), (9000, 600)]
)  # the last two: 2 blocks
def test_any_row_range_equals_the_rows_of_the_full_tensor(shape):
    fill = init.normal(0.02)
    full = torch.empty(shape)
    init.fill_rows(full, shape, 0, fill, seed=3, name="w")
    if math.prod(shape) > init.BLOCK_ELEMENTS:
        assert (
            init.rows_per_block(shape) < shape[0]
        )  # several blocks: ranges cross a block boundary
    for lo, hi in [
        (0, 1),
        (1, shape[0]),
        (shape[0] // 3, 2 * shape[0] // 3 + 1),
        (shape[0] - 1, shape[0]),
    ]:
        part = torch.empty((hi - lo, *shape[1:]))
        init.fill_rows(part, shape, lo, fill, seed=3, name="w")
        assert torch.equal(part, full[lo:hi]), (lo, hi)
    other = torch.empty(shape)
    init.fill_rows(other, shape, 0, fill, seed=3, name="w2")
    assert not torch.equal(other, full)  # another tensor, other values


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_meta_build_then_materialize_equals_direct_build(family):
    arch = resolve_arch(ModelConfig(name=family))
    direct = build_model(arch, seed=7)
    torch.manual_seed(123)  # the global generator plays no part
    meta = build_model(arch, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    materialize(meta, torch.device("cpu"), seed=7)
    for (name, a), b in zip(direct.named_parameters(), meta.parameters(), strict=True):
        assert torch.equal(a, b), name
    stds = {n: p.std().item() for n, p in direct.named_parameters() if p.dim() > 1}
    assert all(0.015 < s < 0.025 for s in stds.values()), stds  # normal(0, 0.02) for matrices
    vectors = dict(direct.named_parameters())
    if family == "qwen3_5_moe":  # (1 + w) norms start at 0, GDN A_log = log U(0.01, 16), dt_bias 1
        assert torch.all(vectors["model.norm.weight"] == 0)
        a_log = vectors["model.layers.0.linear_attn.A_log"]
        assert torch.all(
            (a_log >= torch.log(torch.tensor(0.01))) & (a_log <= torch.log(torch.tensor(16.0)))
        )
        assert torch.all(vectors["model.layers.0.linear_attn.dt_bias"] == 1)
    else:
        assert torch.all(vectors["model.norm.weight"] == 1)


def test_seed_none_follows_the_global_generator():
    arch = resolve_arch(ModelConfig())
    torch.manual_seed(0)
    a = bumblebee.build_model(arch)
    torch.manual_seed(0)
    b = bumblebee.build_model(arch)
    c = bumblebee.build_model(arch)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(b.lm_head.weight, c.lm_head.weight)


def test_init_device_reaches_every_tensor_and_keeps_cpu_values(monkeypatch):
    """``train.init_device = "device"`` draws each tensor on its own device (a GPU run's real-width
    init in seconds); on the CPU that is the CPU draw, so the weights are the same either way."""
    arch = resolve_arch(ModelConfig(name="qwen3_5_moe"))
    ref = materialize(build_model(arch, device="meta"), torch.device("cpu"), seed=5)
    flags = []
    real = init.fill_rows

    def spy(*args, on_device=False, **kw):
        flags.append(on_device)
        return real(*args, on_device=on_device, **kw)

    monkeypatch.setattr(init, "fill_rows", spy)
    dev = materialize(
        build_model(arch, device="meta"), torch.device("cpu"), seed=5, init_on_device=True
    )
    assert flags and all(flags)
    for (name, a), b in zip(ref.state_dict().items(), dev.state_dict().values()):
        assert torch.equal(a, b), name


def test_init_device_is_validated():
    with pytest.raises(bumblebee.ConfigError, match="train.init_device must be 'cpu' or 'device'"):
        bumblebee.load_config(None, ["train.init_device=gpu"])

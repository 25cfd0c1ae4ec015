"""A model family is a decoder layer, an arch, presets and a name map: nothing in runtime/rl/plan.

The stand-in below (a parallel attention + MoE block, GPT-J style, built from the same
primitives) is registered in the family table and then trained by the Trainer, sharded,
planned and exported without a line of runtime, RL or planner code knowing it.
"""

import dataclasses
import io

import pytest
import torch
from torch import nn

from bumblebee import load_config
from bumblebee.models import FAMILIES, build_model, resolve_arch
from bumblebee.models.base import CausalLM
from bumblebee.models.blocks import Attention, MoE
from bumblebee.models.family import Family, register_family
from bumblebee.models.presets import PRESETS
from bumblebee.models.qwen3_moe import Qwen3MoeArch
from bumblebee.primitives.norms import RMSNorm


# ------------------------------------------------------------------ the whole stand-in family (20 lines)
@dataclasses.dataclass(kw_only=True)
class ParallelArch(Qwen3MoeArch):
    model_type: str = "parallel_moe"

    def to_spec(self, name="custom"):
        return dataclasses.replace(super().to_spec(name), family="parallel_moe")


class ParallelLayer(nn.Module):
    is_moe = True

    def __init__(self, arch, index, parts):
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, parts.attend, parts.recompute)
        self.mlp = MoE(arch, parts.prims, parts.dispatch, parts.groups)

    def forward(self, x, cos, sin, layout):
        h = self.norm(x)
        y, aux = self.mlp(h)
        return x + self.self_attn(h, cos, sin, layout) + y, aux


class ParallelMoe(CausalLM):
    family, norm_cls = "parallel_moe", RMSNorm

    def make_layer(self, index, parts):
        return ParallelLayer(self.arch, index, parts)


TINY = {**PRESETS["qwen3_moe"]["tiny"], "model_type": "parallel_moe", "num_hidden_layers": 2}
# ------------------------------------------------------------------


@pytest.fixture
def family():
    fam = register_family(
        Family(
            name="parallel_moe",
            arch=ParallelArch,
            model=ParallelMoe,
            presets={"tiny": TINY},
            hf_model_types=("parallel_moe",),
        )
    )
    yield fam
    del FAMILIES["parallel_moe"]


def test_stand_in_family_trains_through_the_runtime(family, tmp_path):
    from bumblebee.runtime.trainer import Trainer

    cfg = load_config(
        None,
        [
            "model.name=parallel_moe",
            "train.steps=6",
            "train.seq_len=512",
            "train.lr=1e-2",
            f"train.out_dir={tmp_path}",
            "train.warmup_steps=0",
            "data.max_records=16",
        ],
    )
    trainer = Trainer(cfg, stream=io.StringIO())
    assert isinstance(trainer.model, ParallelMoe)
    losses = [trainer.train_step()["loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.5, losses  # it learns (the byte-level format at least)


def test_stand_in_family_is_planned_and_exported(family, tmp_path):
    from bumblebee.models.hf import from_hf, to_hf
    from bumblebee.plan.spec import load_spec

    spec, _ = load_spec("parallel_moe/tiny")
    model = build_model(resolve_arch(load_config(None, ["model.name=parallel_moe"]).model))
    assert (
        spec.family == "parallel_moe"
    )  # the planner read the family's own spec (one norm per layer
    # fewer than the Qwen3 arithmetic it inherits: within 0.1%)
    assert spec.num_params()["total"] == pytest.approx(
        sum(p.numel() for p in model.parameters()), rel=1e-3
    )
    to_hf(model, str(tmp_path / "hf"))
    back = from_hf(str(tmp_path / "hf"))
    ids = torch.randint(0, 256, (1, 32))
    assert torch.equal(model(ids), back(ids))


def test_kv_cache_decoding_uses_the_models_own_layers(family):
    """Prefill + one cached step through a new family equal the full forward (no copied attention)."""
    from bumblebee.rl.sampler import Sampler

    model = build_model(resolve_arch(load_config(None, ["model.name=parallel_moe"]).model)).eval()
    ids = torch.randint(0, 256, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    cache = model.new_kv_cache(rows=2, length=9)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    prefill = model.forward_cached(ids[:, :8], pos[:, :8], cache, 0, causal)
    step = model.forward_cached(ids[:, 8:], pos[:, 8:], cache, 8, None)
    with torch.no_grad():
        full = model(ids).float()
    torch.testing.assert_close(torch.cat([prefill, step], dim=1), full, rtol=1e-5, atol=1e-5)
    hybrid = build_model(resolve_arch(load_config(None, ["model.name=qwen3_5_moe"]).model))
    with pytest.raises(ValueError, match="linear attention"):
        Sampler(hybrid)


def _register_stand_in():
    if "parallel_moe" not in FAMILIES:
        register_family(
            Family(
                name="parallel_moe",
                arch=ParallelArch,
                model=ParallelMoe,
                presets={"tiny": TINY},
                hf_model_types=("parallel_moe",),
            )
        )


LAYOUT_RUN = [
    "model.name=parallel_moe",
    "train.steps=3",
    "train.seq_len=128",
    "train.global_batch=4",
]


def _losses(overrides, out_dir):
    from bumblebee.runtime.trainer import Trainer

    cfg = load_config(None, LAYOUT_RUN + overrides + [f"train.out_dir={out_dir}"])
    trainer = Trainer(cfg, stream=io.StringIO())
    return [trainer.train_step()["loss"] for _ in range(3)]


def _layout_ranks(rank, world, out_dir):
    _register_stand_in()
    return [_losses([f"parallel.{axis}=2"], f"{out_dir}/{axis}/{rank}") for axis in ("cp", "pp")]


def test_stand_in_family_trains_with_cp_and_pp(family, tmp_path):
    """No line outside the family's own code: context and pipeline parallelism take it as it is
    (CP from the family table's default, pipeline balance from its ModelSpec FLOPs)."""
    from dist_utils import run_distributed

    reference = _losses([], tmp_path / "one")
    cp, pp = run_distributed(_layout_ranks, 2, str(tmp_path))[0]
    assert cp == pytest.approx(reference, rel=1e-5), (cp, reference)
    assert pp == pytest.approx(reference, rel=1e-5), (pp, reference)


def test_no_family_name_outside_models():
    """Runtime, plan, RL and primitives never name a family (config.py's default run is the one
    place a family is chosen)."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "bumblebee"
    names = re.compile("|".join(sorted(FAMILIES)))
    found = [
        f"{path.relative_to(root)}:{i}"
        for path in root.rglob("*.py")
        if "models" not in path.relative_to(root).parts[:1]
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if names.search(line) and not (path.name == "config.py" and "name: str =" in line)
    ]
    assert not found, found

"""Block-FP8 checkpoints as released (DeepSeek-V3, Kimi-K2, MiniMax-M2): ``float8_e4m3fn``
weights with a per-block fp32 ``<name>_scale_inv`` and ``quantization_config`` in config.json.

The checkpoint is built here: a random tiny deepseek_v3 written by bumblebee's own exporter,
then its matrices quantized by this file (blocks of 16 x 24, so a 40-row or 128-column weight
ends in a partial block and a rank's rows start and end inside blocks). The reference is
dequantized here block by block; bumblebee's load must equal it bit for bit, for the whole
model and for each rank's rows of 2 and 3 ranks, reading only those rows and their scale
blocks. Every format it cannot read exactly is refused with one line.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import bumblebee
from bumblebee.errors import CheckpointError, ConfigError
from bumblebee.models import arch_from_hf_dict, build_model, hf_read
from bumblebee.models.deepseek_v3.presets import PRESETS
from bumblebee.models.hf import hf_state_dict

BLOCK = [16, 24]
QCFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def quantizable(name: str, t: torch.Tensor) -> bool:
    # as the releases do: matrices of the linear layers; embeddings, head, norms and router stay
    return t.dim() == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight"))


def quantize(w: torch.Tensor, b0: int, b1: int) -> tuple[torch.Tensor, torch.Tensor]:
    R, C = w.shape
    scale = torch.empty(-(-R // b0), -(-C // b1))
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (blk / scale[i, j]).to(q.dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


def ref_scaled(ref) -> set[str]:
    return {n for n in ref if n.endswith("_scale_inv")}


def read_all(path) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """(directory, reference tensors by HF name) of a tiny block-FP8 deepseek_v3."""
    path = str(tmp_path_factory.mktemp("fp8"))
    torch.manual_seed(0)
    model = build_model(arch_from_hf_dict(dict(PRESETS["tiny"])))
    model.reset_parameters(std=0.05)
    bumblebee.to_hf(model, path, dtype=torch.float32)
    tensors, ref = {}, {}
    for name, t in read_all(path).items():
        if quantizable(name, t):
            q, s = quantize(t, *BLOCK)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            ref[name] = dequantize(q, s, *BLOCK)
            ref[name + "_scale_inv"] = s
        else:
            tensors[name] = ref[name] = t
    assert sum(n.endswith("_scale_inv") for n in tensors) > 30  # attention, MLPs, experts, MTP
    save_file(tensors, os.path.join(path, "model.safetensors"))
    edit_config(path, quantization_config={**QCFG, "weight_block_size": BLOCK})
    return path, ref


def edit_config(path, **changes):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def test_loads_equal_to_dequantized_reference(fp8_dir):
    path, ref = fp8_dir
    model = bumblebee.from_hf(path, dtype=torch.float32)
    got = dict(hf_state_dict(model))
    assert set(got) == set(ref) - ref_scaled(ref)  # no _scale_inv reported, none missing
    for name, t in got.items():
        assert torch.equal(t, ref[name]), name


class Counting:
    """``safe_open`` that counts the bytes each tensor gives out (get_slice rows, get_tensor)."""

    read: dict[str, int] = defaultdict(int)

    def __init__(self, *args, **kwargs):
        self.f = safe_open(*args, **kwargs)

    def __enter__(self):
        self.h = self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.h.keys()

    def get_tensor(self, name):
        t = self.h.get_tensor(name)
        Counting.read[name] += t.nbytes
        return t

    def get_slice(self, name):
        sl = self.h.get_slice(name)

        class Slice:
            get_shape, get_dtype = sl.get_shape, sl.get_dtype

            def __getitem__(self, index):
                t = sl[index]
                Counting.read[name] += t.nbytes
                return t

        return Slice()


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_and_dequantizes_only_its_rows(fp8_dir, world, monkeypatch):
    """Each 'rank' of an FSDP2 row split (``row_extent``'s torch.chunk rows, set here without
    processes) fills exactly its rows with the reference values and reads only those rows of
    each fp8 weight and the scale block rows they touch."""
    path, ref = fp8_dir
    whole = bumblebee.from_hf(path, dtype=torch.float32)
    b0 = BLOCK[0]
    monkeypatch.setattr(hf_read, "safe_open", Counting)
    for rank in range(world):

        def extent(t, is_expert=False, ep_rank=0, ep=1, rank=rank):
            if not t.dim():
                return (), 0, t
            chunk = -(-t.shape[0] // world)
            lo = min(t.shape[0], rank * chunk)
            return tuple(t.shape), lo, t[lo : lo + chunk]

        monkeypatch.setattr(hf_read, "row_extent", extent)
        model = build_model(whole.arch)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        Counting.read.clear()
        hf_read.load_hf_weights(model, path)
        edges = 0
        for (name, p), q in zip(model.named_parameters(), whole.parameters()):
            _, lo, part = extent(p)
            hi = lo + (part.shape[0] if p.dim() else 1)
            assert torch.equal(part, q[lo:hi] if p.dim() else q), (name, rank)
            assert torch.isnan(p[:lo]).all() and torch.isnan(p[hi:]).all(), name  # not written
            if name + "_scale_inv" in ref_scaled(ref):  # a plain (not stacked, not MTP) fp8 matrix
                cols = p.shape[1]
                assert Counting.read[name] == (hi - lo) * cols  # 1 byte per fp8 value
                blocks = -(-hi // b0) - lo // b0 if hi > lo else 0
                assert Counting.read[name + "_scale_inv"] == blocks * -(-cols // BLOCK[1]) * 4
                edges += lo % b0 != 0 or hi % b0 != 0
        assert edges > 0  # some slices start or end inside a scale block
        fp8 = [n[: -len("_scale_inv")] for n in ref_scaled(ref)]
        mine = sum(Counting.read[n] for n in fp8)
        total = sum(ref[n].numel() for n in fp8)
        assert 0 < mine <= total // world + 2 * whole.arch.hidden_size * 256  # ~1/world, not all
        print(f"rank {rank}/{world}: read {mine} of {total} fp8 weight bytes ({mine / total:.2f})")


def test_export_writes_plain_weights_without_quantization_config(fp8_dir, tmp_path):
    path, ref = fp8_dir
    model = bumblebee.from_hf(path, dtype=torch.float32)
    out = str(tmp_path / "out")
    bumblebee.to_hf(model, out, dtype=torch.bfloat16, source=path)
    with open(os.path.join(out, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    got = read_all(out)
    assert set(got) == set(ref) - ref_scaled(ref)  # no _scale_inv
    for name, t in got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref[name].to(torch.bfloat16)), name


def refusal_dir(fp8_dir, tmp_path, change_tensors=None, **config):
    path = str(tmp_path / "bad")
    os.makedirs(path)
    tensors = read_all(fp8_dir[0])
    if change_tensors:
        change_tensors(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with (
        open(os.path.join(fp8_dir[0], "config.json")) as f,
        open(os.path.join(path, "config.json"), "w") as g,
    ):
        g.write(f.read())
    edit_config(path, **config)
    return path


Q = "model.layers.0.self_attn.q_a_proj.weight"


def _drop(name):
    return lambda t: t.pop(name)


def _e5m2(t):
    t[Q] = t[Q].float().to(torch.float8_e5m2)


def _plain_with_scale(t):
    t[Q] = t[Q].float()


def _orphan(t):
    t["model.layers.0.self_attn.nothing.weight_scale_inv"] = torch.ones(1, 1)


CASES = {
    "quant_method": (
        None,
        {"quantization_config": {**QCFG, "quant_method": "gptq"}},
        "quant_method",
    ),
    "fmt": (
        None,
        {"quantization_config": {**QCFG, "fmt": "e5m2", "weight_block_size": BLOCK}},
        "fmt",
    ),
    "block_malformed": (
        None,
        {"quantization_config": {**QCFG, "weight_block_size": [128]}},
        "weight_block_size",
    ),
    "block_other": (
        None,
        {"quantization_config": {**QCFG, "weight_block_size": [128, 128]}},
        "weight_block_size [128, 128]",
    ),
    "no_config": (None, {"quantization_config": None}, "declares no block-FP8"),
    "weight_without_scale": (_drop(Q + "_scale_inv"), {}, f"without its {Q}_scale_inv"),
    "scale_without_weight": (_orphan, {}, "scale without its weight"),
    "scale_of_plain_weight": (_plain_with_scale, {}, "has a _scale_inv"),
    "e5m2_weights": (_e5m2, {}, "float8_e5m2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unknown_format_is_refused_in_one_line(fp8_dir, tmp_path, case):
    change, config, says = CASES[case]
    path = refusal_dir(fp8_dir, tmp_path, change, **config)
    with pytest.raises(CheckpointError) as e:
        bumblebee.from_hf(path)
    assert isinstance(e.value, ConfigError) and "\n" not in str(e.value)
    assert says in str(e.value), str(e.value)


def test_fused_fp8_experts_load_per_rank(fp8_dir, tmp_path, monkeypatch):
    """HF's fused expert tensors ([E, 2F, H] / [E, H, F]) in FP8 with a scale per expert: dim 0
    is whole experts, so a rank reads its experts' matrices and scales."""

    def fuse(t):
        E = PRESETS["tiny"]["n_routed_experts"]
        for layer in range(1, PRESETS["tiny"]["num_hidden_layers"]):
            base = f"model.layers.{layer}.mlp.experts"
            for fused, projs in (
                ("gate_up_proj", ("gate_proj", "up_proj")),
                ("down_proj", ("down_proj",)),
            ):
                for sfx in ("", "_scale_inv"):
                    per = [
                        torch.cat([t.pop(f"{base}.{e}.{p}.weight{sfx}") for p in projs])
                        for e in range(E)
                    ]
                    t[f"{base}.{fused}{sfx}"] = torch.stack(per)

    path = refusal_dir(fp8_dir, tmp_path, fuse)
    whole = bumblebee.from_hf(fp8_dir[0], dtype=torch.float32)
    for n, a in bumblebee.from_hf(path, dtype=torch.float32).state_dict().items():
        assert torch.equal(a, whole.state_dict()[n]), n
    monkeypatch.setattr(hf_read, "safe_open", Counting)
    name = "model.layers.1.mlp.experts.w_down"
    for rank in range(3):

        def extent(t, is_expert=False, ep_rank=0, ep=1, rank=rank):
            lo = min(t.shape[0], rank * -(-t.shape[0] // 3)) if t.dim() else 0
            return tuple(t.shape), lo, t[lo : lo + -(-t.shape[0] // 3)] if t.dim() else t

        monkeypatch.setattr(hf_read, "row_extent", extent)
        model = build_model(whole.arch)
        Counting.read.clear()
        hf_read.load_hf_weights(model, path)
        _, lo, part = extent(model.get_parameter(name))
        assert torch.equal(part, whole.get_parameter(name)[lo : lo + part.shape[0]])
        stored = "model.layers.1.mlp.experts.down_proj"
        assert Counting.read[stored] == part.numel()  # its experts' fp8 bytes only
        assert Counting.read[stored + "_scale_inv"] == part.shape[0] * 8 * 3 * 4

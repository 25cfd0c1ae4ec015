"""Typed config: TOML + --set overrides, validation with one-line errors."""

import pytest

from bumblebee import load_config
from bumblebee.config import ConfigError
from bumblebee.config_parse import dump_toml, parse_override


def test_defaults_validate():
    cfg = load_config()
    assert cfg.model.name == "qwen3_moe" and cfg.train.steps > 0


def test_toml_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = 7\nlr = 1e-3\n[primitives]\nexperts = "loop"\n')
    cfg = load_config(
        str(f), ["train.steps=9", "model.arch.num_hidden_layers=2", "train.out_dir=x/y"]
    )
    assert cfg.train.steps == 9 and cfg.train.lr == 1e-3 and cfg.primitives.experts == "loop"
    assert cfg.model.arch == {"num_hidden_layers": 2} and cfg.train.out_dir == "x/y"


def test_dump_roundtrip(tmp_path):
    cfg = load_config(
        None, ["model.arch.num_hidden_layers=2", "primitives.recompute_modules=['norm']"]
    )
    f = tmp_path / "c.toml"
    f.write_text(dump_toml(cfg))
    assert load_config(str(f)) == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.stepz=3"], "unknown key train.stepz"),
        (["trian.steps=3"], "unknown section [trian]"),
        (["train.steps=-1"], "train.steps must be a positive integer"),
        (["train.steps=abc"], "expected an integer"),
        (["primitives.loss=nope"], "unknown loss implementation 'nope'"),
        (
            ["primitives.linear_attention_cp=probe"],
            "primitives.linear_attention_cp must be 'scan' or 'relay'",
        ),
        (["primitives.fused=no"], "primitives.fused must be 'auto' or 'off'"),
        (["model.arch.num_key_value_heads=3"], "must be divisible by num_key_value_heads"),
        (["model.preset=huge"], "unknown qwen3_moe preset 'huge'"),
        (["model.name=gpt2"], "unknown model.name"),
        (["data.source=jsonl"], "needs data.path"),
        (["data.source=jsonl", "data.path=/nonexistent.jsonl"], "data.path not found"),
        (["train.dtype=fp8"], "train.dtype must be"),
        (["model.hf_path=/nonexistent"], "no config.json"),
        (["train.steps"], "expected section.key=value"),
    ],
)
def test_invalid_overrides(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_and_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "none.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1\n")
    with pytest.raises(ConfigError, match="malformed TOML"):
        load_config(str(bad))


def test_override_values_are_toml_literals():
    assert parse_override("train.lr=1e-4") == (["train", "lr"], 1e-4)
    assert parse_override("model.preset=tiny") == (["model", "preset"], "tiny")
    assert parse_override("train.deterministic=true") == (["train", "deterministic"], True)


def test_example_default_toml_is_the_embedded_default():
    """examples/default.toml says it gives the same run as `bumblebee train`: every key it sets equals the
    built-in default (a changed default that the example does not follow fails here)."""
    import dataclasses
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "default.toml"

    def flat(c, prefix=""):
        out = {}
        for f in dataclasses.fields(c):
            v = getattr(c, f.name)
            out.update(
                flat(v, f"{prefix}{f.name}.")
                if dataclasses.is_dataclass(v)
                else {prefix + f.name: v}
            )
        return out

    assert flat(load_config(str(example), [])) == flat(load_config(None, []))

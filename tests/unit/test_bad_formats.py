"""Every external format bumblebee reads, broken in generated ways, ends in one line
``bumblebee: error: <file>: <problem>`` (exit 2) or is read as valid: never a traceback.

Variants per file: truncation at every 10% of its bytes (0%..90%), random byte flips (fixed
seeds) and hand-written wrong JSON types / shapes. Each family states how many it tries."""

import json
import random

import numpy as np
import pytest
from cli_helpers import sets

from bumblebee.cli import main

FLIPS = 8  # byte-flip variants per file


def variants(data: bytes, seed: int = 0):
    """(name, bytes): the file cut at every 10% and FLIPS copies with 1-3 random bytes changed."""
    out = [(f"cut{p}%", data[: len(data) * p // 10]) for p in range(10)]
    rng = random.Random(seed)
    for i in range(FLIPS):
        b = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            j = rng.randrange(len(b))
            b[j] = (b[j] + rng.randint(1, 255)) % 256
        out.append((f"flip{i}", bytes(b)))
    return out


def ends_cleanly(capsys, argv, must_fail: bool, names=()) -> str:
    """Exit 0, or exit 2 with one last stderr line ``bumblebee: error: ...`` naming one of ``names``."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    if code == 0 and not must_fail:
        return ""
    lines = err.strip().splitlines()
    assert code == 2 and lines and lines[-1].startswith("bumblebee: error: "), (code, err)
    assert not names or any(str(n) in lines[-1] for n in names), lines[-1]
    return lines[-1]


# ---------------------------------------------------------------- prepared corpus (data prepare output)

VOCAB_IDS = 200


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from bumblebee.data.store import StoreWriter

    d = tmp_path_factory.mktemp("corpus") / "prepared"
    w = StoreWriter(str(d))
    rng = np.random.default_rng(0)
    lengths = np.array([40, 33, 57, 40, 21, 64], np.int64)
    toks = rng.integers(3, VOCAB_IDS, int(lengths.sum())).astype(np.uint32)
    w.append(toks, np.ones(len(toks), np.uint8), lengths)
    w.close(
        {
            "source": "generated",
            "kind": "tokens",
            "max_token_id": int(toks.max()),
            "skipped": {},
            "skipped_total": 0,
            "notes": {},
        }
    )
    return d


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _train(path, tmp_path):
    return ["train"] + sets(
        [
            "model.arch.num_hidden_layers=1",
            "model.arch.hidden_size=32",
            "model.arch.head_dim=8",
            "model.arch.moe_intermediate_size=16",
            "model.arch.num_experts=2",
            "model.arch.num_experts_per_tok=1",
            "model.arch.vocab_size=256",
            "primitives.loss=ce",
            "primitives.recompute=none",
            "train.seq_len=32",
            "train.global_batch=1",
            "train.steps=1",
            "train.eval_every=0",
            "data.source=tokens",
            f"data.path={path}",
            f"train.out_dir={tmp_path / 'run'}",
        ]
    )


def _meta_variants(meta: dict):
    """(name, bytes, must_fail) for meta.json."""
    raw = json.dumps(meta, indent=1).encode()
    out = [(n, b, n.startswith("cut")) for n, b in variants(raw, seed=1)]
    typed = [
        ("garbage", b"\x00\xff garbage \x89PNG"),
        ("list", b"[1, 2, 3]"),
        ("string", b'"meta"'),
        ("null", b"null"),
        ("empty-object", b"{}"),
        ("deep", b"[" * 100000),
    ]
    out += [(n, b, True) for n, b in typed]
    for k in ("documents", "tokens", "loss_tokens", "format"):
        out.append(
            (f"no-{k}", json.dumps({x: v for x, v in meta.items() if x != k}).encode(), True)
        )
    for k, bad in (
        ("documents", "6"),
        ("tokens", -1),
        ("loss_tokens", 1.5),
        ("tokens", True),
        ("documents", None),
        ("max_token_id", "x"),
        ("skipped", [1]),
        ("notes", {"a": "b"}),
        ("source", 3),
        ("loss_tokens", 10**9),
        ("documents", 10**30),
    ):
        out.append((f"{k}={bad!r}", json.dumps({**meta, k: bad}).encode(), True))
    return out


def _offsets_variants(offsets: np.ndarray):
    """(name, array or bytes, must_fail) for offsets.i64."""
    out = []
    o = offsets.copy()
    o[2], o[3] = o[3], o[2]
    out.append(("swapped", o, True))  # noqa: E702
    o = offsets.copy()
    o[1] = -5
    out.append(("negative", o, True))  # noqa: E702
    o = offsets.copy()
    o[3] = 10**12
    out.append(("past-end", o, True))  # noqa: E702
    o = offsets.copy()
    o[0] = 3
    out.append(("first-not-0", o, True))  # noqa: E702
    o = offsets.copy()
    o[-1] += 7
    out.append(("last-past-tokens", o, True))  # noqa: E702
    o = offsets.copy()
    o[-2] = o[-1] + 1
    out.append(("overlap-end", o, True))  # noqa: E702
    raw = offsets.tobytes()
    out += [(n, b, True if n.startswith("cut") else None) for n, b in variants(raw, seed=2)]
    out.append(("odd-size", raw + b"\x01\x02\x03", True))
    return out


def test_prepared_corpus_broken_meta_and_offsets(capsys, tmp_path, corpus):
    """meta.json: 10 truncations + 8 flips + 6 non-objects + 4 missing keys + 11 wrong types = 39;
    offsets.i64: 6 non-monotonic / out-of-range + 10 truncations + 8 flips + 1 odd size = 25.
    All 64 through ``data inspect``; the ones that must fail also through ``train``."""
    from bumblebee.data.store import open_store

    meta = json.loads((corpus / "meta.json").read_text())
    offsets = np.fromfile(corpus / "offsets.i64", np.int64)
    cases = [("meta.json", n, b, f) for n, b, f in _meta_variants(meta)]
    cases += [("offsets.i64", n, b, f) for n, b, f in _offsets_variants(offsets)]
    assert len(cases) == 64
    trained = 0
    for i, (fname, name, data, must_fail) in enumerate(cases):
        d = _copy(corpus, tmp_path / f"c{i}")
        (d / fname).write_bytes(data.tobytes() if isinstance(data, np.ndarray) else data)
        if must_fail is None:  # a flip in offsets: fails unless it left a valid layout
            try:
                open_store(str(d))
                must_fail = False
            except Exception:
                must_fail = True
        try:
            ends_cleanly(
                capsys, ["data", "inspect", str(d), "--seq-len", "32"], must_fail, names=[d]
            )
            if (
                must_fail and trained < 12 and (i % 3 == 0 or fname == "offsets.i64")
            ):  # train reads the same loader
                trained += 1
                ends_cleanly(capsys, _train(d, tmp_path / f"r{i}"), True, names=[d])
        except AssertionError as e:
            raise AssertionError(f"{fname} variant {name}: {e}") from None
    assert trained >= 8


# ---------------------------------------------------------------- tokenizer directory


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from data_helpers import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tok", vocab_size=280)


def _json_type_variants(obj: dict):
    """Non-objects and a wrong type per top-level key (up to 6 keys)."""
    out = [
        ("list", b"[1, 2]"),
        ("string", b'"x"'),
        ("null", b"null"),
        ("binary", bytes(range(256)) * 4),
        ("utf16", json.dumps(obj).encode("utf-16")),
    ]
    for k in list(obj)[:6]:
        bad = [] if not isinstance(obj[k], list) else {"x": 1}
        out.append((f"{k}=wrong-type", json.dumps({**obj, k: bad}).encode()))
    return out


@pytest.mark.parametrize("fname", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_directory_broken_files(capsys, tmp_path, tok_dir, fname):
    """Per file: 10 truncations + 8 flips + 5 non-objects + up to 6 wrong-typed keys = 29 (28)
    variants,
    through ``data prepare --source text``: exit 0 or one line naming the directory or file."""
    import shutil

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "alpha beta gamma delta"}\n{"text": "user assistant system words"}\n')
    raw = open(f"{tok_dir}/{fname}", "rb").read()
    cases = [(n, b, n.startswith("cut") or None) for n, b in variants(raw, seed=3)]
    cases += [
        (n, b, n in ("list", "string", "null", "binary", "utf16") or None)
        for n, b in _json_type_variants(json.loads(raw))
    ]
    assert len(cases) >= 28  # tokenizer_config.json has 5 top-level keys
    for i, (name, data, must_fail) in enumerate(cases):
        d = tmp_path / f"t{i}"
        shutil.copytree(tok_dir, d)
        (d / fname).write_bytes(data)
        try:
            ends_cleanly(
                capsys,
                [
                    "data",
                    "prepare",
                    "--source",
                    "text",
                    "--tokenizer",
                    str(d),
                    str(src),
                    str(tmp_path / f"o{i}"),
                    "--workers",
                    "1",
                    "--no-progress",
                ],
                bool(must_fail),
                names=[d],
            )
        except AssertionError as e:
            raise AssertionError(f"{fname} variant {name}: {e}") from None


# ---------------------------------------------------------------- Parquet and datasets directories


def _prepare_tokens(src, out):
    return [
        "data",
        "prepare",
        "--source",
        "tokens",
        str(src),
        str(out),
        "--workers",
        "1",
        "--no-progress",
    ]


def _rows():
    return {"input_ids": [[(7 * d + i) % 200 for i in range(20 + d)] for d in range(12)]}


def test_parquet_broken_files(capsys, tmp_path):
    """10 truncations + 12 byte flips = 22 variants through ``data prepare --source tokens``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table(_rows()), good)
    raw = good.read_bytes()
    cases = variants(raw, seed=4) + [
        (f"flip-b{i}", v) for i, (_, v) in enumerate(variants(raw, seed=5)[-4:])
    ]
    assert len(cases) == 22
    for i, (name, data) in enumerate(cases):
        f = tmp_path / f"v{i}.parquet"
        f.write_bytes(data)
        try:
            ends_cleanly(
                capsys, _prepare_tokens(f, tmp_path / f"o{i}"), name.startswith("cut"), names=[f]
            )
        except AssertionError as e:
            raise AssertionError(f"parquet variant {name}: {e}") from None


def test_datasets_directory_broken(capsys, tmp_path):
    """state.json: 10 truncations + 8 flips + 5 non-objects + 4 wrong shapes; the arrow file
    missing, 10 truncations, 8 flips; dataset_dict.json: 3 broken = 49 variants."""
    import shutil

    import pyarrow as pa

    good = tmp_path / "good"
    good.mkdir()
    table = pa.table(_rows())
    with (
        pa.OSFile(str(good / "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)
    state = {
        "_data_files": [{"filename": "data-00000-of-00001.arrow"}],
        "_fingerprint": "x",
        "_split": None,
    }
    (good / "state.json").write_text(json.dumps(state))
    (good / "dataset_info.json").write_text("{}")
    assert main(_prepare_tokens(good, tmp_path / "ok")) == 0, capsys.readouterr().err
    capsys.readouterr()
    arrow = (good / "data-00000-of-00001.arrow").read_bytes()
    raw_state = json.dumps(state).encode()
    cases = [("state.json", n, b, n.startswith("cut")) for n, b in variants(raw_state, seed=6)]
    cases += [
        ("state.json", n, b, True)
        for n, b in (
            ("list", b"[]"),
            ("null", b"null"),
            ("string", b'"s"'),
            ("binary", bytes(range(256))),
            ("utf16", raw_state.decode().encode("utf-16")),
            ("no-files", b"{}"),
            ("files-dict", json.dumps({"_data_files": {"filename": "a"}}).encode()),
            ("filename-int", json.dumps({"_data_files": [{"filename": 3}]}).encode()),
            (
                "filename-escape",
                json.dumps({"_data_files": [{"filename": "../../etc/passwd"}]}).encode(),
            ),
        )
    ]
    cases.append(("data-00000-of-00001.arrow", "missing", None, True))
    cases += [
        ("data-00000-of-00001.arrow", n, b, n.startswith("cut")) for n, b in variants(arrow, seed=7)
    ]
    cases += [
        ("dataset_dict.json", n, b, True)
        for n, b in (
            ("garbage", b"\x00garbage"),
            ("list", b"[1]"),
            ("splits-str", b'{"splits": "train"}'),
        )
    ]
    assert len(cases) == 49
    for i, (fname, name, data, must_fail) in enumerate(cases):
        d = tmp_path / f"d{i}"
        shutil.copytree(good, d)
        if data is None:
            (d / fname).unlink()
        else:
            (d / fname).write_bytes(data)
        try:
            ends_cleanly(capsys, _prepare_tokens(d, tmp_path / f"o{i}"), must_fail, names=[d])
        except AssertionError as e:
            raise AssertionError(f"datasets {fname} variant {name}: {e}") from None


# ---------------------------------------------------------------- bumblebee report


def _metrics_lines(n=6):
    return [
        json.dumps(
            {
                "step": s,
                "loss": 5.0 - 0.1 * s,
                "grad_norm": 1.0,
                "lr": 1e-3,
                "tokens_per_s": 1000.0,
                "peak_mem_gb": 1.0,
            }
        )
        for s in range(1, n + 1)
    ]


def test_report_broken_metrics_and_outputs(capsys, tmp_path):
    """metrics.jsonl: 10 truncations + 8 flips + 8 wrong types / shapes; output paths: 7 bad
    ones = 33 variants of ``bumblebee report``."""
    pytest.importorskip("matplotlib")
    lines = _metrics_lines()
    raw = ("\n".join(lines) + "\n").encode()
    cases = [(n, b, True if n == "cut0%" else None) for n, b in variants(raw, seed=8)]
    bad_lines = {
        "array-line": "[1, 2, 3]",
        "no-step": json.dumps({"loss": 1.0}),
        "step-str": '{"step": "3"}',
        "step-bool": '{"step": true}',
        "number-line": "42",
        "null-line": "null",
    }
    for name, line in bad_lines.items():
        cases.append((name, ("\n".join(lines[:2] + [line] + lines[2:]) + "\n").encode(), True))
    cases.append(("binary", bytes(range(256)) * 8, True))
    cases.append(("utf16", raw.decode().encode("utf-16"), True))
    run = tmp_path / "run"
    run.mkdir()
    for i, (name, data, must_fail) in enumerate(cases):
        (run / "metrics.jsonl").write_bytes(data)
        if (
            must_fail is None
        ):  # a cut or a flip: fails unless every line but a torn last one stays a record
            from bumblebee.report_inputs import load_metrics

            try:
                load_metrics(str(run))
                must_fail = False
            except Exception:
                must_fail = True
        try:
            ends_cleanly(
                capsys,
                ["report", str(run), "-o", str(tmp_path / f"r{i}.png")],
                must_fail,
                names=[run / "metrics.jsonl", run],
            )
        except AssertionError as e:
            raise AssertionError(f"metrics variant {name}: {e}") from None
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "a_file").write_text("x")
    outs = {
        "txt": tmp_path / "r.txt",
        "csv": tmp_path / "r.csv",
        "no-extension": tmp_path / "report",
        "directory": tmp_path / "dir.png",
        "input-metrics": run / "metrics.jsonl",
        "input-run": run,
        "under-a-file": tmp_path / "a_file" / "r.png",
    }
    (tmp_path / "dir.png").mkdir()
    for name, out in outs.items():
        before = (run / "metrics.jsonl").read_bytes()
        try:
            ends_cleanly(capsys, ["report", str(run), "-o", str(out)], True, names=[out])
        except AssertionError as e:
            raise AssertionError(f"output variant {name}: {e}") from None
        assert (run / "metrics.jsonl").read_bytes() == before


# ---------------------------------------------------------------- TOML


def test_toml_not_utf8_or_broken(capsys, tmp_path):
    """A valid config's bytes: 10 truncations + 8 flips + 6 encodings / non-UTF-8 bytes = 24
    variants. The 6 must fail through ``train --config``; a cut or flip may leave a valid config
    (any config: it is not trained), so those go through ``parse_config``, which must return or
    raise a one-line ConfigError."""
    from bumblebee.config import ConfigError
    from bumblebee.config_parse import parse_config

    text = (
        '# a config\n[model]\nname = "qwen3_moe"\n\n[train]\nsteps = 3\nseq_len = 64\nlr = 3e-4\n'
        'out_dir = "runs/café"\n\n[data]\nsource = "synthetic"\n'
    )
    raw = text.encode()
    cases = [(n, b, None) for n, b in variants(raw, seed=9)]
    cases += [
        ("utf16", text.encode("utf-16"), True),
        ("utf16-be", text.encode("utf-16-be"), True),
        ("latin1", text.encode("latin-1"), True),
        ("cp1252-quote", raw.replace(b"a config", b"\x93a\x94"), True),
        ("binary", bytes(range(256)), True),
        ("deep", b"a = " + b"[" * 100000, True),
    ]
    assert len(cases) == 24
    for i, (name, data, must_fail) in enumerate(cases):
        f = tmp_path / f"c{i}.toml"
        f.write_bytes(data)
        try:
            if must_fail is None:
                try:
                    parse_config(str(f))
                except ConfigError as e:
                    assert "\n" not in str(e), str(e)
                continue
            ends_cleanly(capsys, ["train", "--config", str(f)], True, names=[f])
        except AssertionError as e:
            raise AssertionError(f"toml variant {name}: {e}") from None

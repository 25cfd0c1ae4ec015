"""Chat data as it ships: messages reach the template unchanged (tool calls, reasoning, list-of-parts
content, tool turns), tools and template keyword arguments from the config, a ``{% generation %}``
template's own marks, a history-rewriting (Qwen3-style) template rendered per turn, ShareGPT
records, and what was skipped or remarked counted with its reason. Expected tokens are built piece
by piece from the fixtures' rules, independently of the chat template."""

import contextlib
import io
import json
import random

import pytest
from data_helpers import (
    GENERATION_TEMPLATE,
    QWEN3_TEMPLATE,
    TOOL_TEMPLATE,
    conversation,
    make_tokenizer,
)

from bumblebee.data.chat import PER_TURN, UNRENDERED_CALLS
from bumblebee.data.encode import Encoder
from bumblebee.data.errors import DataError
from bumblebee.data.prepare import encode_in_memory

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
AGENT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "the weather"}, {"type": "image"}]},
    {"role": "assistant", "reasoning_content": "a tool", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "red flowers"},
    {"role": "assistant", "reasoning_content": "easy", "content": "seven bees hum"},
]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    d = tmp_path_factory.mktemp("toks")
    return {
        name: make_tokenizer(d / name, template=t)
        for name, t in (
            ("tool", TOOL_TEMPLATE),
            ("qwen3", QWEN3_TEMPLATE),
            ("gen", GENERATION_TEMPLATE),
        )
    }


def body(m: dict, think: bool) -> str:
    """A message's text after its role header, by the fixtures' rules (not through jinja)."""
    c = m.get("content") or ""
    text = c if isinstance(c, str) else "".join(p["text"] for p in c if p["type"] == "text")
    calls = "".join(CALL_TEXT for _ in m.get("tool_calls", []))
    return (
        (f"<think>{m['reasoning_content']}</think>" if think and m.get("reasoning_content") else "")
        + text
        + calls
    )


def expected(tok, pieces):
    """(ids, mask) from (text, is_target) pieces, tokenized piece by piece."""
    ids, mask = [], []
    for text, target in pieces:
        t = tok.encode(text, add_special_tokens=False)
        ids, mask = ids + t, mask + [int(target)] * len(t)
    return ids, mask


def targets(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_tool_calls_reasoning_and_list_content_pass_through(toks, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    enc = Encoder("chat", toks["tool"], tools=str(tools))
    ids, mask = enc.encode({"messages": AGENT})
    want = [("<|im_start|>system\ntools: get_weather<|im_end|>\n", 0)]
    for m in AGENT:
        want += [
            (f"<|im_start|>{m['role']}\n", 0),
            (body(m, think=True) + "<|im_end|>\n", m["role"] == "assistant"),
        ]
    assert (ids, mask) == expected(enc.tok, want)
    assert targets(enc.tok, ids, mask) == (
        f"<think>a tool</think>{CALL_TEXT}<|im_end|>\n<think>easy</think>seven bees hum<|im_end|>\n"
    )
    # a record's own tools win over data.tools (here as a JSON string, as some datasets store them)
    own = json.dumps([{"type": "function", "function": {"name": "lazy_dog"}}])
    ids2, _ = enc.encode({"messages": AGENT, "tools": own})
    assert enc.tok.decode(ids2).startswith("<|im_start|>system\ntools: lazy_dog<|im_end|>")
    assert enc.documents({"messages": AGENT})[1] == []  # nothing to remark


def test_history_rewriting_template_is_rendered_per_turn(toks):
    """Qwen3-style: earlier <think> blocks vanish from later renderings, so prefixes are not prefixes;
    each assistant turn becomes its own document, trained in the context it is generated in."""
    msgs = [
        {"role": "user", "content": "the fox"},
        {"role": "assistant", "reasoning_content": "r one", "content": "jumps"},
        {"role": "user", "content": "the dog"},
        {"role": "assistant", "reasoning_content": "r two", "content": "sleeps"},
    ]
    enc = Encoder("chat", toks["qwen3"])
    docs, notes = enc.documents({"messages": msgs})
    assert notes == [PER_TURN] and len(docs) == 2
    head = lambda m: (f"<|im_start|>{m['role']}\n", 0)  # noqa: E731
    first = [
        head(msgs[0]),
        ("the fox<|im_end|>\n", 0),
        head(msgs[1]),
        ("<think>r one</think>\njumps<|im_end|>\n", 1),
    ]
    second = [
        head(msgs[0]),
        ("the fox<|im_end|>\n", 0),
        head(msgs[1]),
        ("jumps<|im_end|>\n", 0),  # think dropped
        head(msgs[2]),
        ("the dog<|im_end|>\n", 0),
        head(msgs[3]),
        ("<think>r two</think>\nsleeps<|im_end|>\n", 1),
    ]
    assert docs == [expected(enc.tok, first), expected(enc.tok, second)]
    # one user turn: nothing rewritten, one document, no remark
    docs, notes = enc.documents({"messages": msgs[:2]})
    assert notes == [] and docs == [expected(enc.tok, first)]
    # enable_thinking = false (template keyword): the empty think block is part of the prompt, not trained
    plain = [{"role": "user", "content": "the fox"}, {"role": "assistant", "content": "jumps"}]
    assert (
        targets(enc.tok, *enc.encode({"messages": plain})) == "<think></think>\njumps<|im_end|>\n"
    )
    quiet = Encoder("chat", toks["qwen3"], template_kwargs={"enable_thinking": False})
    assert targets(quiet.tok, *quiet.encode({"messages": plain})) == "jumps<|im_end|>\n"


def test_generation_markers_decide_the_targets(toks):
    """The fixture's {% generation %} covers the content only; the prefix rule would also train
    <|im_end|>: the template's marks win, and equal transformers' assistant mask."""
    enc = Encoder("chat", toks["gen"])
    rng = random.Random(4)
    for _ in range(5):
        rec = conversation(rng, turns=rng.randint(1, 3))
        ids, mask = enc.encode(rec)
        assert targets(enc.tok, ids, mask) == "".join(
            m["content"] for m in rec["messages"] if m["role"] == "assistant"
        )
        hf = enc.tok.apply_chat_template(
            rec["messages"], return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids == hf["input_ids"] and mask == hf["assistant_masks"]


def test_sharegpt_records_and_counted_skips(toks, tmp_path):
    rng = random.Random(5)
    recs = [conversation(rng, turns=2) for _ in range(4)]
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    share = [
        {
            "conversations": [
                {"from": speaker[m["role"]], "value": m["content"]} for m in r["messages"]
            ]
        }
        for r in recs
    ]
    enc = Encoder("chat", toks["tool"])
    for r, s in zip(recs, share):
        assert enc.encode(s) == enc.encode(r)
    lines = share + [
        {"conversations": [{"from": "bot", "value": "hi"}]},
        {"messages": [{"role": "user"}]},
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [CALL]},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "the end", "tool_calls": [CALL]},
            ]
        },
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(
        DataError, match=r"mixed.jsonl:5: message 0: unknown ShareGPT speaker 'bot'"
    ):
        encode_in_memory(str(path), enc)
    store = encode_in_memory(str(path), Encoder("chat", toks["gen"]), on_error="skip")
    assert store.meta["skipped"] == {
        "message 0: unknown ShareGPT speaker 'bot'": 1,
        "no assistant message: nothing to train on": 1,
        "no assistant tokens: the template marks nothing to train on": 1,
    }
    # the generation template ignores tool_calls: a call-only turn trains nothing (skipped above); a
    # turn with content is kept, and the unrendered call counted
    assert store.num_docs == 5 and store.meta["notes"] == {UNRENDERED_CALLS: 1}
    from bumblebee.data.stream import TokenSource

    line = TokenSource(store, seq_len=64, global_batch=1, seed=0, vocab_size=300).describe()
    assert (
        "skipped 3 (message 0: unknown ShareGPT speaker 'bot': 1, no assistant message: nothing to train on: 1, no "
        "assistant tokens: the template marks nothing to train on: 1)"
        in line
        and f"records {UNRENDERED_CALLS}: 1" in line
    )


def test_tools_and_template_kwargs_from_config_and_cli(toks, tmp_path):
    from bumblebee import load_config
    from bumblebee.cli import main
    from bumblebee.config import ConfigError
    from bumblebee.data import build_source

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a", "tool_calls": [CALL]},
                ]
            }
        )
        + "\n"
    )
    base = ["data.source=chat", f"data.path={path}", "train.seq_len=128", "train.global_batch=1"]
    cfg = load_config(
        None,
        base
        + [
            f"data.tokenizer={toks['qwen3']}",
            f"data.tools={tools}",
            "data.chat_template_kwargs={enable_thinking = false}",
        ],
    )
    src = build_source(cfg.data, cfg.train, vocab_size=300)
    row = src.rows.build(src.train_rows[:1]).input_ids[0].tolist()
    tok = Encoder("chat", toks["qwen3"]).tok
    assert tok.decode(row).startswith("<|im_start|>system\ntools: get_weather<|im_end|>")
    assert src.rows.store.meta["chat_template_kwargs"] == {"enable_thinking": False}
    # reasoning in the data but enable_thinking = false: the turn does not follow its prompt
    think = tmp_path / "think.jsonl"
    think.write_text(json.dumps({"messages": AGENT[:3]}) + "\n")
    cfg.data.path = str(think)
    with pytest.raises(
        DataError, match=r"think.jsonl:1: .*message 2 after the generation prompt .*enable_thinking"
    ):
        build_source(cfg.data, cfg.train, vocab_size=300)
    with pytest.raises(ConfigError, match="data.tools not found: nope.json"):
        load_config(None, base + [f"data.tokenizer={toks['qwen3']}", "data.tools=nope.json"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x"}')
    with pytest.raises(DataError, match="must hold a JSON list of tool schemas"):
        Encoder("chat", toks["qwen3"], tools=str(bad))
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main(
            [
                "data",
                "prepare",
                "--source",
                "chat",
                "--tokenizer",
                toks["qwen3"],
                "--tools",
                str(tools),
                "--template-kwarg",
                "enable_thinking=false",
                "--no-progress",
                "--workers",
                "1",
                str(path),
                str(tmp_path / "p"),
            ]
        )
    assert rc == 0
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    assert meta["chat_template_kwargs"] == {"enable_thinking": False} and meta["tools"] == str(
        tools
    )

"""A run trained with a tokenizer exports a directory ready to serve: its tokenizer files, the special
token ids in config.json and generation_config.json (chat: generation stops at the template's
end-of-turn too), loaded back with transformers' AutoTokenizer and AutoModelForCausalLM; a run on a
prepared ``tokens`` directory exports the tokenizer that directory was made with."""

import io
import json
import random

import torch
from data_helpers import conversation, make_tokenizer, sentence

from bumblebee import load_config
from bumblebee.data.encode import Encoder
from bumblebee.data.prepare import prepare
from bumblebee.runtime.trainer import Trainer

SMALL = [
    "model.arch.num_hidden_layers=1",
    "model.arch.hidden_size=32",
    "model.arch.moe_intermediate_size=32",
    "model.arch.vocab_size=320",
    "train.seq_len=96",
    "train.global_batch=2",
    "train.warmup_steps=1",
    "train.steps=1",
    "train.eval_every=0",
]


def run(out, *overrides):
    Trainer(
        load_config(None, SMALL + [f"train.out_dir={out}", "train.export_hf=true", *overrides]),
        stream=io.StringIO(),
    ).run()
    return out / "hf"


def test_chat_run_exports_tokenizer_and_generation_config(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_dir = make_tokenizer(
        tmp_path / "tok", bos=True
    )  # bos <|im_start|> = 1, eos <|endoftext|> = 0
    rng = random.Random(0)
    (tmp_path / "chat.jsonl").write_text(
        "".join(json.dumps(conversation(rng)) + "\n" for _ in range(8))
    )
    hf = run(
        tmp_path / "run",
        "data.source=chat",
        f"data.path={tmp_path / 'chat.jsonl'}",
        f"data.tokenizer={tok_dir}",
    )
    cfg = json.loads((hf / "config.json").read_text())
    gen = json.loads((hf / "generation_config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 0, 0)
    assert (
        gen["eos_token_id"] == [2, 0] and gen["bos_token_id"] == 1
    )  # <|im_end|> ends a chat answer
    orig, back = AutoTokenizer.from_pretrained(tok_dir), AutoTokenizer.from_pretrained(hf)
    msgs = conversation(random.Random(1))["messages"]
    assert back.apply_chat_template(msgs, tokenize=False) == orig.apply_chat_template(
        msgs, tokenize=False
    )
    text = "the quick brown fox"
    assert back(text)["input_ids"] == orig(text)["input_ids"] and back.eos_token_id == 0
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.generation_config.eos_token_id == [2, 0] and model.config.bos_token_id == 1
    ids = back.apply_chat_template(
        msgs[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert (
        out.shape[1] <= ids["input_ids"].shape[1] + 3 and torch.isfinite(model(**ids).logits).all()
    )


def test_tokens_run_exports_the_prepared_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok_dir = make_tokenizer(tmp_path / "tok")
    rng = random.Random(3)
    (tmp_path / "t.jsonl").write_text(
        "".join(json.dumps({"text": sentence(rng, 8, 30)}) + "\n" for _ in range(20))
    )
    prepare(
        str(tmp_path / "t.jsonl"), str(tmp_path / "p"), Encoder("text", tok_dir), progress=False
    )
    hf = run(tmp_path / "run", "data.source=tokens", f"data.path={tmp_path / 'p'}")
    assert sorted(p.name for p in hf.iterdir() if p.name.startswith("tokenizer")) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    gen = json.loads((hf / "generation_config.json").read_text())
    assert (
        gen["eos_token_id"] == 0 and "bos_token_id" not in gen
    )  # text: the EOS alone; no BOS defined
    assert (
        AutoTokenizer.from_pretrained(hf)("a lazy dog")["input_ids"]
        == AutoTokenizer.from_pretrained(tok_dir)("a lazy dog")["input_ids"]
    )

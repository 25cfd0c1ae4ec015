"""A Hugging Face export ready to serve: the run's tokenizer files and its special token ids.

A run trained with ``data.tokenizer`` exports that tokenizer beside the weights
(``tokenizer.json``, ``tokenizer_config.json``, the chat template, ...: the
tokenizer files only, never a weights file of the directory they sit in) and
writes its ids into ``config.json`` (``bos_token_id``, ``eos_token_id``,
``pad_token_id``) and ``generation_config.json`` (merged into one carried over
from ``model.hf_path``), so ``AutoTokenizer`` / ``AutoModelForCausalLM`` and
serving engines load the directory as it is and know where to stop.

Where generation stops: the tokenizer's EOS, and for a run trained on chat data
also the chat template's end-of-turn token (``<|im_end|>``), which is what a
chat model emits at the end of its answer (``generation_config.eos_token_id`` is
then a list, as Qwen's own instruct models ship it). The end-of-turn token is the
first special token the template renders after an assistant message's content
(found by rendering a one-turn conversation; needs ``transformers``, and is left
out, with the EOS alone, where it is not installed).

The ids are read from the tokenizer's own JSON files (``tokenizer_config.json``
names the tokens, ``tokenizer.json`` gives their ids), without loading it.
"""

from __future__ import annotations

import fnmatch
import json
import os

from bumblebee import safe_write

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "*.tiktoken",
)


def tokenizer_files(tok_dir: str) -> list[str]:
    return sorted(
        n
        for n in os.listdir(tok_dir)
        if os.path.isfile(os.path.join(tok_dir, n))
        and any(fnmatch.fnmatch(n, p) for p in TOKENIZER_FILES)
    )


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def _token_id(tok_json: dict, token) -> int | None:
    """The id of ``token`` (a string, or tokenizer_config's {"content": ...} form) in tokenizer.json."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    for added in tok_json.get("added_tokens", []):
        if added.get("content") == token:
            return added.get("id")
    vocab = tok_json.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        return vocab.get(token)
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        return next((i for i, (piece, *_) in enumerate(vocab) if piece == token), None)
    return None


def special_ids(tok_dir: str) -> dict:
    """{bos_token_id, eos_token_id, pad_token_id} the tokenizer defines (those it does not are left out)."""
    cfg = _read(os.path.join(tok_dir, "tokenizer_config.json"))
    cfg = {**_read(os.path.join(tok_dir, "special_tokens_map.json")), **cfg}
    tok_json = _read(os.path.join(tok_dir, "tokenizer.json"))
    out = {}
    for key in ("bos", "eos", "pad"):
        i = _token_id(tok_json, cfg.get(f"{key}_token"))
        if i is not None:
            out[f"{key}_token_id"] = i
    return out


def end_of_turn_id(tok_dir: str) -> int | None:
    """The first special token the chat template renders after an assistant turn's content."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        if not getattr(tok, "chat_template", None):
            return None
        marker = "bumblebee end of turn probe"
        text = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
            tokenize=False,
        )
        after = text[text.rindex(marker) + len(marker) :]
        special = set(tok.all_special_ids) | {int(i) for i in tok.added_tokens_decoder}
        return next(
            (i for i in tok(after, add_special_tokens=False)["input_ids"] if i in special), None
        )
    except Exception:  # no transformers, or a template that cannot render the probe: the EOS alone
        return None


def add_tokenizer(out_dir: str, tok_dir: str, *, chat: bool) -> dict:
    """Copy ``tok_dir``'s tokenizer files into the export ``out_dir`` and write the token ids into its
    config.json and generation_config.json; returns the generation config written."""
    for name in tokenizer_files(tok_dir):
        safe_write.copy_file(
            os.path.join(tok_dir, name), os.path.join(out_dir, name), doing="write the export"
        )
    ids = special_ids(tok_dir)
    cfg_path = os.path.join(out_dir, "config.json")
    cfg = _read(cfg_path)
    cfg.update(ids)
    if isinstance(cfg.get("text_config"), dict):  # the multimodal wrapper: its language model too
        cfg["text_config"].update(ids)
    safe_write.write_file(cfg_path, json.dumps(cfg, indent=2), doing="write the export")
    gen_path = os.path.join(out_dir, "generation_config.json")
    gen = {**_read(gen_path), **ids}
    eot = end_of_turn_id(tok_dir) if chat else None
    if eot is not None and eot != ids.get("eos_token_id"):
        gen["eos_token_id"] = [eot] + ([ids["eos_token_id"]] if "eos_token_id" in ids else [])
    safe_write.write_file(gen_path, json.dumps(gen, indent=2), doing="write the export")
    return gen

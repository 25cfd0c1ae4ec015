"""One record -> (token ids, loss mask): pre-tokenized, plain text, or a chat conversation.

Kinds (``data.source`` / ``prepare --source``):

- ``tokens``: ``{"input_ids": [...], "loss_mask": [...]}`` (mask optional, default all 1).
- ``text``: ``{"text": "..."}``, tokenized with the tokenizer's own special tokens
  (a BOS if its post-processor adds one), then **EOS appended** unless the text
  already ends with it; every token is a target, so the model learns to end a
  document.
- ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered with the
  tokenizer's chat template (no EOS appended: the template's end-of-turn tokens are
  what a serving engine stops on). With ``chat_loss = "assistant"`` only assistant
  turns are targets: the characters each assistant message adds to the rendering,
  i.e. its content and the template's end-of-turn marker (``<|im_end|>``), not the
  role header; with ``"all"`` every token is.

Assistant spans come from rendering prefixes of the conversation: turn i spans
``render(msgs[:i], add_generation_prompt=True)`` .. ``render(msgs[:i+1])``. A
template that rewrites earlier turns (so prefixes are not prefixes of the full
rendering) makes that record a bad record with a reason. A token is a target when
its first character lies in a span (tokenizer offsets).

The tokenizer is a local Hugging Face directory (``tokenizer.json`` +
``tokenizer_config.json``, chat template from there), loaded with ``transformers``
without any network access (the ``[data]`` extra).
"""

from __future__ import annotations

import os

import numpy as np

from bumblebee.data.errors import BadRecord, DataError, require

KINDS = ("tokens", "text", "chat")


def load_tokenizer(path: str):
    """A local Hugging Face tokenizer directory; nothing is downloaded."""
    if not path:
        raise DataError("text and chat data need a tokenizer: set data.tokenizer (or --tokenizer) to a local "
                        "Hugging Face tokenizer directory")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise DataError(f"{path}: not a tokenizer directory (no tokenizer.json)")
    transformers = require("transformers", "a Hugging Face tokenizer (text / chat data)")
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


class Encoder:
    """Turns records of one kind into (ids, mask). Picklable: the tokenizer loads lazily."""

    def __init__(self, kind: str, tokenizer: str = "", *, chat_loss: str = "assistant"):
        if kind not in KINDS:
            raise DataError(f"unknown data kind {kind!r}; valid: {', '.join(KINDS)}")
        if chat_loss not in ("assistant", "all"):
            raise DataError(f"chat_loss must be 'assistant' or 'all', got {chat_loss!r}")
        self.kind, self.tokenizer_path, self.chat_loss = kind, tokenizer, chat_loss
        self._tok = None
        if kind != "tokens":
            self._tok = load_tokenizer(tokenizer)  # fail now, not in a worker
            if kind == "chat" and not getattr(self._tok, "chat_template", None):
                raise DataError(f"{tokenizer}: the tokenizer has no chat template (chat_template.jinja or "
                                "tokenizer_config.json 'chat_template')")

    def __getstate__(self):
        return {**self.__dict__, "_tok": None}

    @property
    def tok(self):
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer_path)
        return self._tok

    def describe(self) -> dict:
        d = {"kind": self.kind}
        if self.kind != "tokens":
            d.update(tokenizer=os.path.abspath(self.tokenizer_path), eos_id=self.tok.eos_token_id,
                     pad_id=self.tok.pad_token_id, vocab_size=len(self.tok))
        if self.kind == "chat":
            d["chat_loss"] = self.chat_loss
        return d

    def encode(self, rec) -> tuple[list[int], list[int]]:
        if not isinstance(rec, dict):
            raise BadRecord(f"expected a JSON object, got {type(rec).__name__}")
        return getattr(self, f"_{self.kind}")(rec)

    @staticmethod
    def _tokens(rec: dict) -> tuple[list[int], list[int]]:
        if "input_ids" not in rec:
            raise BadRecord("missing field 'input_ids'")
        ids, mask = rec["input_ids"], rec.get("loss_mask")
        if not isinstance(ids, list) or not ids or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32 for i in ids):
            raise BadRecord("'input_ids' must be a non-empty list of non-negative integers")
        if mask is None:
            mask = [1] * len(ids)
        if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
            raise BadRecord("'loss_mask' must be a list of 0/1 of the same length as 'input_ids'")
        return ids, [int(m) for m in mask]

    def _text(self, rec: dict) -> tuple[list[int], list[int]]:
        if "text" not in rec:
            raise BadRecord("missing field 'text'")
        text = rec["text"]
        if not isinstance(text, str) or not text.strip():
            raise BadRecord("'text' must be a non-empty string")
        ids = list(self.tok(text, add_special_tokens=True)["input_ids"])
        eos = self.tok.eos_token_id
        if eos is not None and ids[-1] != eos:
            ids.append(eos)
        return ids, [1] * len(ids)

    def _chat(self, rec: dict) -> tuple[list[int], list[int]]:
        if "messages" not in rec:
            raise BadRecord("missing field 'messages'")
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise BadRecord("empty conversation ('messages' must be a non-empty list)")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BadRecord(f"message {i}: expected {{'role': str, 'content': str}}")
        msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if self.chat_loss == "assistant" and not turns:
            raise BadRecord("no assistant message: nothing to train on")
        full = self._render(msgs)
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        if not ids:
            raise BadRecord("the conversation renders to no tokens")
        if self.chat_loss == "all":
            return ids, [1] * len(ids)
        starts = np.array([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.int64)
        for i in turns:
            a, b = self._span(msgs, i, full)
            mask[(starts >= a) & (starts < b)] = 1
        return ids, mask.tolist()

    def _render(self, msgs: list[dict], gen: bool = False) -> str:
        try:
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as e:  # a template's raise_exception() or a jinja error: this record
            raise BadRecord(f"chat template failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}")

    def _span(self, msgs: list[dict], i: int, full: str) -> tuple[int, int]:
        """Characters of ``full`` that assistant turn i adds (content + end-of-turn)."""
        upto = self._render(msgs[:i + 1])
        try:
            pre = self._render(msgs[:i], gen=True) if i else ""
        except BadRecord:  # some templates cannot render an empty / system-only prefix
            pre = ""
        if not (full.startswith(upto) and upto.startswith(pre)):
            raise BadRecord(f"the chat template does not render message {i} as a prefix of the conversation; "
                            "assistant spans cannot be located (use chat_loss = 'all')")
        return len(pre), len(upto)

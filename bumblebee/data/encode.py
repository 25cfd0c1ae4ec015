"""One record -> (token ids, loss mask): pre-tokenized, plain text, or a chat conversation.

Kinds (``data.source`` / ``prepare --source``):

- ``tokens``: ``{"input_ids": [...], "loss_mask": [...]}`` (mask optional, default all 1).
- ``text``: ``{"text": "..."}``, tokenized with the tokenizer's own special tokens
  (a BOS if its post-processor adds one), then **EOS appended** unless the text
  already ends with it; every token is a target, so the model learns to end a
  document.
- ``chat``: ``{"messages": [...]}`` or ShareGPT ``{"conversations": [...]}``, rendered with the
  tokenizer's chat template, messages unchanged (tool calls, reasoning, list-of-parts content;
  chat.py); no EOS appended: the template's end-of-turn tokens are what a serving engine stops
  on. With ``chat_loss = "assistant"`` only assistant turns are targets (their content, tool
  calls, reasoning and end-of-turn marker, never the role header; ``{% generation %}`` markers
  where the template has them); with ``"all"`` every token is. A record may give several
  documents (a history-rewriting template: one per assistant turn), hence ``documents(rec)``.

The tokenizer is a local Hugging Face directory (``tokenizer.json`` +
``tokenizer_config.json``, chat template from there), loaded with ``transformers``
without any network access (the ``[data]`` extra).
"""

from __future__ import annotations

import json
import os

from bumblebee.data.errors import BadRecord, DataError, check_json_object, require

KINDS = ("tokens", "text", "chat")


def load_tokenizer(path: str):
    """A local Hugging Face tokenizer directory; nothing is downloaded."""
    if not path:
        raise DataError(
            "text and chat data need a tokenizer: set data.tokenizer (or --tokenizer) to a local "
            "Hugging Face tokenizer directory"
        )
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise DataError(f"{path}: not a tokenizer directory (no tokenizer.json)")
    transformers = require("transformers", "a Hugging Face tokenizer (text / chat data)")
    for name in TOKENIZER_JSON:
        check_json_object(os.path.join(path, name), "tokenizer file")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        tok.decode(
            tok("bumblebee tokenizer probe")["input_ids"]
        )  # a wrong-typed setting fails here, not mid-run
        probe = tok("bumblebee tokenizer probe", add_special_tokens=False)["input_ids"]
    except (KeyboardInterrupt, SystemExit, MemoryError):
        raise
    except BaseException as e:  # noqa: BLE001 - a broken directory surfaces as any of a dozen types (a Rust panic too)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DataError(
            f"{path}: not a loadable tokenizer directory ({type(e).__name__}: {why})"
        ) from None
    if not probe:  # an empty vocabulary (or one of special tokens only): every text is no tokens
        raise DataError(
            f"{path}: the tokenizer encodes text to no tokens (its vocabulary has {len(tok)} "
            "entries); not a usable tokenizer"
        )
    return tok


TOKENIZER_JSON = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


def load_tools(path: str) -> list | None:
    """``data.tools``: a JSON file holding a list of tool schemas (None when unset)."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tools = json.load(f)
    except OSError as e:
        raise DataError(f"data.tools: cannot read {path} ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"data.tools: {path} is not JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"data.tools: {path} must hold a JSON list of tool schemas (objects)")
    return tools


class Encoder:
    """Turns records of one kind into (ids, mask). Picklable: the tokenizer loads lazily."""

    def __init__(
        self,
        kind: str,
        tokenizer: str = "",
        *,
        chat_loss: str = "assistant",
        tools: str = "",
        template_kwargs: dict | None = None,
    ):
        if kind not in KINDS:
            raise DataError(f"unknown data kind {kind!r}; valid: {', '.join(KINDS)}")
        if chat_loss not in ("assistant", "all"):
            raise DataError(f"chat_loss must be 'assistant' or 'all', got {chat_loss!r}")
        self.kind, self.tokenizer_path, self.chat_loss = kind, tokenizer, chat_loss
        self.tools_path, self.tools = tools, load_tools(tools) if kind == "chat" else None
        self.template_kwargs = dict(template_kwargs or {})
        self._tok = self._chat = None
        if kind != "tokens":
            self._tok = load_tokenizer(tokenizer)  # fail now, not in a worker
            if kind == "chat" and not getattr(self._tok, "chat_template", None):
                raise DataError(
                    f"{tokenizer}: the tokenizer has no chat template (chat_template.jinja or "
                    "tokenizer_config.json 'chat_template')"
                )

    def __getstate__(self):
        return {**self.__dict__, "_tok": None, "_chat": None}

    @property
    def tok(self):
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer_path)
        return self._tok

    def describe(self) -> dict:
        d = {"kind": self.kind}
        if self.kind != "tokens":
            d.update(
                tokenizer=os.path.abspath(self.tokenizer_path),
                eos_id=self.tok.eos_token_id,
                pad_id=self.tok.pad_token_id,
                vocab_size=len(self.tok),
            )
        if self.kind == "chat":
            d["chat_loss"] = self.chat_loss
            if self.tools_path:
                d["tools"] = os.path.abspath(self.tools_path)
            if self.template_kwargs:
                d["chat_template_kwargs"] = self.template_kwargs
        return d

    def documents(self, rec) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
        """([(ids, mask)], notes to count) of one record: one document, or for chat data rendered
        per turn one per assistant turn."""
        if not isinstance(rec, dict):
            raise BadRecord(f"expected a JSON object, got {type(rec).__name__}")
        if self.kind == "chat":
            if self._chat is None:
                from bumblebee.data.chat import ChatRenderer

                self._chat = ChatRenderer(
                    self.tok, self.chat_loss, self.tools, self.template_kwargs
                )
            return self._chat.documents(rec)
        return [getattr(self, f"_{self.kind}")(rec)], []

    def encode(self, rec) -> tuple[list[int], list[int]]:
        """The one document of a record (a record rendered per turn: its last turn's)."""
        return self.documents(rec)[0][-1]

    @staticmethod
    def _tokens(rec: dict) -> tuple[list[int], list[int]]:
        if "input_ids" not in rec:
            raise BadRecord("missing field 'input_ids'")
        ids, mask = rec["input_ids"], rec.get("loss_mask")
        if (
            not isinstance(ids, list)
            or not ids
            or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32 for i in ids
            )
        ):
            raise BadRecord("'input_ids' must be a non-empty list of non-negative integers")
        if mask is None:
            mask = [1] * len(ids)
        if (
            not isinstance(mask, list)
            or len(mask) != len(ids)
            or not all(m in (0, 1) for m in mask)
        ):
            raise BadRecord("'loss_mask' must be a list of 0/1 of the same length as 'input_ids'")
        return ids, [int(m) for m in mask]

    def _text(self, rec: dict) -> tuple[list[int], list[int]]:
        if "text" not in rec:
            raise BadRecord("missing field 'text'")
        text = rec["text"]
        if not isinstance(text, str) or not text.strip():
            raise BadRecord("'text' must be a non-empty string")
        ids = list(self.tok(text, add_special_tokens=True)["input_ids"])
        if not ids:
            raise BadRecord("the text encodes to no tokens")
        eos = self.tok.eos_token_id
        if eos is not None and ids[-1] != eos:
            ids.append(eos)
        return ids, [1] * len(ids)

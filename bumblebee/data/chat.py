"""Chat records -> documents of (token ids, loss mask) through the tokenizer's own chat template.

Messages go to the template unchanged: ``tool_calls``, ``reasoning_content``,
list-of-parts ``content`` (``[{"type": "text", "text": ...}]``), ``tool`` turns
and any other key the template reads; only keys whose value is null are dropped
(as transformers does). Tool schemas come from the record's ``tools`` field (a
list, or a JSON string of one) or else from ``data.tools``; ``data.chat_template_kwargs``
(e.g. ``{enable_thinking = false}``) reach the template as variables.

Layouts: OpenAI-style ``{"messages": [{"role", "content", ...}]}`` and ShareGPT
``{"conversations": [{"from", "value"}]}`` (``human``/``gpt``/``system``/
``function_call``/``observation``/``tool`` mapped to roles).

Which tokens are targets (``chat_loss = "assistant"``), in order of preference:

1. the template marks them with ``{% generation %} ... {% endgeneration %}``: exactly
   the tokens transformers' ``return_assistant_tokens_mask`` marks;
2. otherwise each assistant turn i is the text it adds:
   ``render(msgs[:i], add_generation_prompt=True)`` .. ``render(msgs[:i+1])``, located in
   the rendering of the whole conversation (its content, tool calls, reasoning and the
   end-of-turn marker, never the role header). A token is a target when its first
   character lies in such a span;
3. a template that rewrites history (Qwen3's thinking templates drop the ``<think>``
   block of every assistant turn before the last user message) makes those prefixes
   differ from the whole rendering: the record is then rendered **per turn**, one
   document per assistant turn i (``render(msgs[:i+1])``, targets only turn i), so every
   turn is trained in the context the model sees when it generates it. This costs
   tokens (earlier turns repeat) and is counted (``notes``).
"""

from __future__ import annotations

import json
import re

import numpy as np

from bumblebee.data.errors import BadRecord, DataError

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "function_response": "tool",
    "tool": "tool",
}
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
PER_TURN = "rendered per turn (the chat template rewrites earlier turns)"
UNRENDERED_CALLS = "tool calls the chat template does not render"


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def messages_of(rec: dict) -> list[dict]:
    """The record's conversation as chat-template messages (ShareGPT mapped), checked but unchanged."""
    if "messages" in rec:
        msgs = rec["messages"]
    elif "conversations" in rec:
        msgs = rec["conversations"]
        if (
            isinstance(msgs, list)
            and msgs
            and all(isinstance(m, dict) and "from" in m for m in msgs)
        ):
            out = []
            for i, m in enumerate(msgs):
                if m["from"] not in SHAREGPT_ROLES:
                    raise BadRecord(
                        f"message {i}: unknown ShareGPT speaker {m['from']!r} (known: "
                        f"{', '.join(SHAREGPT_ROLES)})"
                    )
                rest = {k: v for k, v in m.items() if k not in ("from", "value")}
                out.append({"role": SHAREGPT_ROLES[m["from"]], "content": m.get("value"), **rest})
            msgs = out
    else:
        raise BadRecord("missing field 'messages' (or ShareGPT 'conversations')")
    if not isinstance(msgs, list) or not msgs:
        raise BadRecord("empty conversation ('messages' must be a non-empty list)")
    for i, m in enumerate(msgs):
        content = m.get("content") if isinstance(m, dict) else None
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not (
                content is None
                or isinstance(content, str)
                or (isinstance(content, list) and all(isinstance(p, dict) for p in content))
            )
        ):
            raise BadRecord(
                f"message {i}: expected {{'role': str, 'content': str, a list of parts or null, ...}}"
            )
    return [{k: v for k, v in m.items() if v is not None} for m in msgs]


def tools_of(rec: dict, default: list | None) -> list | None:
    tools = rec.get("tools", default)
    if isinstance(tools, str):  # some datasets store the schemas as a JSON string
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as e:
            raise BadRecord(f"'tools' is a string but not JSON ({e.msg})") from None
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise BadRecord("'tools' must be a list of tool schemas (objects)")
    return tools or None


def _unrendered_calls(msgs: list[dict], full: str) -> bool:
    """A tool call whose function name appears nowhere in the rendering: the template ignores
    ``tool_calls`` and the turn would be trained without its call (counted, not refused)."""
    for m in msgs:
        for call in m.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            name = fn.get("name") if isinstance(fn, dict) else None
            if isinstance(name, str) and name and name not in full:
                return True
    return False


def _template_text(tok) -> str:
    """The tokenizer's chat template as text ("" for none); a template that is not text, or a
    set of named templates without a "default", is a ``DataError`` (the template is input)."""
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):
        if "default" not in template:
            raise DataError(
                f"the tokenizer has named chat templates {sorted(map(str, template))} and none is "
                "called 'default'; name one 'default' in its tokenizer_config.json"
            )
        template = template["default"]
    if template is not None and not isinstance(template, str):
        raise DataError(
            f"the tokenizer's chat_template must be a string, got {type(template).__name__}"
        )
    return template or ""


class ChatRenderer:
    """Applies one tokenizer's chat template to records (module docstring)."""

    def __init__(self, tok, chat_loss: str, tools: list | None, template_kwargs: dict):
        self.tok, self.chat_loss, self.tools, self.kwargs = tok, chat_loss, tools, template_kwargs
        self.generation = bool(GENERATION.search(_template_text(tok)))

    def documents(self, rec: dict) -> tuple[list[tuple[list[int], list[int]]], list[str]]:
        """([(ids, mask)], notes to count) for one record."""
        msgs, tools = messages_of(rec), tools_of(rec, self.tools)
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if self.chat_loss == "assistant" and not turns:
            raise BadRecord("no assistant message: nothing to train on")
        full = self._render(msgs, tools)
        notes = [UNRENDERED_CALLS] if _unrendered_calls(msgs, full) else []
        if self.chat_loss == "all":
            ids = self._tokens(full)[0]
            return [(ids, [1] * len(ids))], notes
        if self.generation:
            out = self._call(
                msgs, tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return [self._checked(list(out["input_ids"]), list(out["assistant_masks"]))], notes
        ids, starts = self._tokens(full)
        mask = np.zeros(len(ids), dtype=np.int64)
        for i in turns:
            span = self._span(msgs, tools, i, full)
            if span is None:
                return [self._turn(msgs, tools, j) for j in turns], notes + [PER_TURN]
            mask[(starts >= span[0]) & (starts < span[1])] = 1
        return [self._checked(ids, mask.tolist())], notes

    def _call(self, msgs, tools, **kw):
        try:
            return self.tok.apply_chat_template(msgs, tools=tools, **kw, **self.kwargs)
        except Exception as e:  # a template's raise_exception() or a jinja error: this record
            if type(e).__name__ == "SecurityError":  # jinja2.sandbox: the template, not the record
                raise DataError(
                    f"the chat template tried something Jinja's sandbox refuses ({_first_line(e)}); "
                    "templates are rendered sandboxed because they come from elsewhere"
                ) from None
            raise BadRecord(f"chat template failed: {_first_line(e)}") from None

    def _render(self, msgs, tools, gen: bool = False) -> str:
        return self._call(msgs, tools, tokenize=False, add_generation_prompt=gen)

    def _tokens(self, text: str) -> tuple[list[int], np.ndarray]:
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        if not enc["input_ids"]:
            raise BadRecord("the conversation renders to no tokens")
        return list(enc["input_ids"]), np.array(
            [s for s, _ in enc["offset_mapping"]], dtype=np.int64
        )

    @staticmethod
    def _checked(ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        if not any(mask[1:]):
            raise BadRecord("no assistant tokens: the template marks nothing to train on")
        return ids, [int(m) for m in mask]

    def _prefix(self, msgs, tools, i: int) -> str:
        try:
            return self._render(msgs[:i], tools, gen=True) if i else ""
        except BadRecord:  # some templates cannot render an empty / system-only prefix
            return ""

    def _span(self, msgs, tools, i: int, full: str) -> tuple[int, int] | None:
        """Characters of ``full`` that assistant turn i adds, or None when the template renders the
        conversation up to turn i differently from the start of the whole (history rewritten)."""
        upto, pre = self._render(msgs[: i + 1], tools), self._prefix(msgs, tools, i)
        if not (full.startswith(upto) and upto.startswith(pre)):
            return None
        return len(pre), len(upto)

    def _turn(self, msgs, tools, i: int) -> tuple[list[int], list[int]]:
        """The per-turn document of assistant turn i: the conversation up to it, only turn i a target."""
        upto, pre = self._render(msgs[: i + 1], tools), self._prefix(msgs, tools, i)
        if not upto.startswith(pre):
            raise BadRecord(
                f"the chat template does not render message {i} after the generation prompt of "
                "the turns before it (a template keyword such as enable_thinking changes that prompt); "
                "assistant spans cannot be located (use chat_loss = 'all')"
            )
        ids, starts = self._tokens(upto)
        return self._checked(
            ids, ((starts >= len(pre)) & (starts < len(upto))).astype(np.int64).tolist()
        )

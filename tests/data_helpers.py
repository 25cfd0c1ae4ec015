"""Test data for the data layer: a tiny byte-level BPE tokenizer built and saved locally with the
``tokenizers`` library (nothing downloaded), chat templates (plain ChatML; ChatML with tools, tool
calls, reasoning and list-of-parts content; a Qwen3-style one that rewrites history; one with
``{% generation %}`` markers), and generated conversations."""

from __future__ import annotations

import random

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# what the field's templates do, in miniature: a tools block in the system turn, list-of-parts content
# joined, reasoning in <think>, each tool call as <tool_call>{json}</tool_call>, tool results as "tool"
_BODY = (
    "{%- macro text(c) %}{% if c is string %}{{ c }}{% elif c %}{% for p in c %}{% if p.type == 'text' %}"
    "{{ p.text }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
)
_CALLS = (
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': "
    "c.function.arguments} | tojson }}</tool_call>{% endfor %}"
)
TOOL_TEMPLATE = (
    _BODY + "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ text(m.content) }}" + _CALLS + "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-style: <think> kept only for assistant turns after the last user message (history rewritten);
# enable_thinking = false puts an empty think block in the generation prompt
QWEN3_TEMPLATE = (
    _BODY + "{%- set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 > ns.last %}<think>{{ m.reasoning_content or '' }}"
    "</think>\n{% endif %}{{ text(m.content) }}" + _CALLS + "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think></think>\n{% endif %}{% endif %}"
)
# {% generation %} around the assistant content only (not its <|im_end|>): what is trained differs from
# the prefix rule's span, so a test can tell which one was used
GENERATION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
    "{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = "the quick brown fox jumps over a lazy dog while seven bees hum near red flowers".split()


def make_tokenizer(
    path, vocab_size: int = 300, template: str = CHAT_TEMPLATE, bos: bool = False
) -> str:
    """A byte-level BPE tokenizer (ids 0-2 special: endoftext, im_start, im_end) saved to ``path``
    with chat template ``template``; ``bos``: <|im_start|> doubles as its BOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20 + ["user assistant system"] * 5, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        **({"bos_token": "<|im_start|>"} if bos else {}),
    )
    fast.chat_template = template
    fast.save_pretrained(str(path))
    return str(path)


def sentence(rng: random.Random, lo: int = 2, hi: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversation(rng: random.Random, turns: int = 2, system: bool = True) -> dict:
    msgs = [{"role": "system", "content": sentence(rng)}] if system else []
    for _ in range(turns):
        msgs += [
            {"role": "user", "content": sentence(rng)},
            {"role": "assistant", "content": sentence(rng)},
        ]
    return {"messages": msgs}


def write_jsonl_docs(path, rows, vocab: int = 256, seed: int = 0) -> str:
    """A pre-tokenized JSONL file: one random document per length in ``rows`` (lists of document
    lengths, one list per packed row), token ids in [0, vocab)."""
    import json

    import torch

    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for row in rows:
            for n in row:
                f.write(
                    json.dumps({"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()})
                    + "\n"
                )
    return str(path)

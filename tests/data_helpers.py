"""Test data for the data layer: a tiny byte-level BPE tokenizer built and saved locally with the
``tokenizers`` library (nothing downloaded), a ChatML template, and generated conversations."""

from __future__ import annotations

import random

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = "the quick brown fox jumps over a lazy dog while seven bees hum near red flowers".split()


def make_tokenizer(path, vocab_size: int = 300) -> str:
    """A byte-level BPE tokenizer (ids 0-2 special: endoftext, im_start, im_end) saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20 + ["user assistant system"] * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return str(path)


def sentence(rng: random.Random, lo: int = 2, hi: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversation(rng: random.Random, turns: int = 2, system: bool = True) -> dict:
    msgs = [{"role": "system", "content": sentence(rng)}] if system else []
    for _ in range(turns):
        msgs += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]
    return {"messages": msgs}

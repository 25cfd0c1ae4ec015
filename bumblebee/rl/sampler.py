"""A small batched sampler with a KV cache: the rollout side of the built-in GRPO run.

Real RL runs generate with an inference engine and push weights to it
(``Engine.named_weights``); this sampler plays that role for ``bumblebee rl`` and
its tests. It holds its own full, unsharded copy of the policy (``load_weights``
copies the Engine's gathered tensors in), and decodes a batch of prompts, each
repeated ``group_size`` times (GRPO's group), token by token:

- prompts of different lengths are left-padded; each row's positions start at 0 at
  its first real token, and the attention mask hides the padding;
- prefill runs the padded prompts once and fills the per-layer K/V cache
  ``[rows, kv heads, prompt + max_new, head dim]``; every decode step then runs one
  token per row against the cache (O(T) per step instead of O(T^2));
- next tokens are drawn from ``softmax(logits / temperature)`` with an explicit
  ``torch.Generator`` (``temperature = 0``: greedy); a row stops at ``eos_id``.

Every forward is the model's own (``CausalLM.forward_cached`` with a ``KVCache``,
models/kv_cache.py); a unit test checks the cached logits against the model's full
forward. Full-attention families only: the hybrid family would need Gated DeltaNet's
recurrent state in the cache.

Legend: R rows (prompts x group), P padded prompt length, S cache length, N query heads,
K kv heads, D head dim, H hidden, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bumblebee.models.base import CausalLM, persistent_buffers


@dataclass
class Rollouts:
    prompts: list[list[int]]  # one per row (each prompt repeated group_size times, consecutively)
    completions: list[list[int]]  # generated tokens per row, up to and including eos
    logprobs: list[list[float]]  # sampler's log-prob of each generated token (at the temperature)
    finished: list[bool]  # the row emitted eos within max_new_tokens


class Sampler:
    def __init__(self, model: CausalLM):
        try:
            model.new_kv_cache(1, 1)
        except NotImplementedError as e:
            raise ValueError(f"the built-in sampler cannot decode this model: {e}") from None
        self.model = model.eval()
        self.arch = model.arch

    @torch.no_grad()
    def load_weights(self, named_tensors) -> None:
        """Copy (bumblebee name, full tensor) pairs, e.g. ``Engine.named_weights(hf_names=False)``."""
        params = dict(self.model.named_parameters()) | dict(persistent_buffers(self.model))
        seen = set()
        for name, t in named_tensors:
            params[name].copy_(t)
            seen.add(name)
        if seen != params.keys():
            raise ValueError(f"load_weights: missing {sorted(params.keys() - seen)[:3]}")

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        group_size: int = 1,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        eos_id: int,
        pad_id: int = 0,
        generator: torch.Generator | None = None,
    ) -> Rollouts:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs non-empty prompts")
        if (
            not (math.isfinite(temperature) and temperature >= 0)
            or max_new_tokens < 1
            or group_size < 1
        ):
            raise ValueError(
                f"need a finite temperature >= 0, max_new_tokens >= 1 and group_size >= 1, got "
                f"temperature={temperature}, max_new_tokens={max_new_tokens}, group_size={group_size}"
            )
        rows = [p for p in prompts for _ in range(group_size)]
        dev = self.model.lm_head_weight.device
        R, P = len(rows), max(len(p) for p in rows)
        S = P + max_new_tokens
        pad_R = torch.tensor([P - len(p) for p in rows], device=dev)
        ids = torch.full((R, P), pad_id, dtype=torch.long, device=dev)
        for r, p in enumerate(rows):
            ids[r, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        slot_S = torch.arange(S, device=dev)
        valid_RS = slot_S[None] >= pad_R[:, None]  # cache slots holding real tokens
        cache = self.model.new_kv_cache(R, S)
        # prefill: causal over slots, padding hidden (a padding query sees itself only)
        causal_PP = slot_S[:P, None] >= slot_S[None, :P]
        mask = (causal_PP[None] & valid_RS[:, None, :P]) | torch.eye(
            P, dtype=torch.bool, device=dev
        )[None]
        pos = (slot_S[None, :P] - pad_R[:, None]).clamp(min=0)
        logits_RV = self.model.forward_cached(ids, pos, cache, 0, mask[:, None])[:, -1]
        out = torch.full((R, max_new_tokens), pad_id, dtype=torch.long, device=dev)
        logp_out = torch.zeros(R, max_new_tokens, device=dev)
        done_R = torch.zeros(R, dtype=torch.bool, device=dev)
        n_R = torch.zeros(R, dtype=torch.long, device=dev)
        for i in range(max_new_tokens):
            logp_RV = torch.log_softmax(logits_RV / max(temperature, 1e-8), dim=-1)
            if temperature == 0:
                tok_R = logits_RV.argmax(dim=-1)
            else:
                tok_R = torch.multinomial(logp_RV.exp(), 1, generator=generator).squeeze(1)
            live_R = ~done_R
            out[live_R, i] = tok_R[live_R]
            logp_out[live_R, i] = logp_RV.gather(1, tok_R[:, None]).squeeze(1)[live_R]
            n_R += live_R.long()
            done_R |= tok_R == eos_id
            if bool(done_R.all()) or i == max_new_tokens - 1:
                break
            step_mask = valid_RS[:, None, None, : P + i + 1]
            pos = (P + i - pad_R)[:, None]
            logits_RV = self.model.forward_cached(tok_R[:, None], pos, cache, P + i, step_mask)[
                :, -1
            ]
        n = n_R.tolist()
        return Rollouts(
            prompts=rows,
            completions=[out[r, : n[r]].tolist() for r in range(R)],
            logprobs=[logp_out[r, : n[r]].tolist() for r in range(R)],
            finished=[bool(d) for d in done_R.tolist()],
        )

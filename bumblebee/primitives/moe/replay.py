"""Routing replay: record the experts a forward chose, or run a forward with given experts.

MoE RL trains a policy on tokens a rollout engine sampled; if the trainer's router picks
other experts than the engine did for the same token (numerics, changed weights after a
step), the log-probabilities disagree and training can collapse. Replay removes that
source: the trainer runs with the rollout's (or a recorded pass's) expert choices.

One ``RoutingScope`` per forward, entered by the model around its layers
(``CausalLM.routed_hidden_states(..., routing=scope)``):

- ``replay_BTLK``: given expert ids per token per MoE layer ([B, T, L, K], L = the model's MoE
  layers in order, tokens laid out like ``input_ids``; under CP this rank's zigzag share,
  sharded like ``input_ids``). Each MoE block takes its layer's ids instead of selecting:
  the router still computes its probabilities, the combine weights of the given experts come
  from them (so the gate weights of the replayed experts receive gradients), and the balance
  statistics count the given assignments.
- ``record``: if not None, a dict the MoE blocks fill with ``moe_index -> idx_BTK`` (the ids
  they used); ``RoutingScope.recorded()`` stacks them as [B, T, L, K].

The scope is found through a context variable (dynamic scope of one forward, never
configuration), and the recompute policies re-enter the scope a checkpointed forward ran
under, so the recompute forward of a layer (full recompute, in backward) routes exactly as
the original forward did. Expert parallelism (alltoall, chunked) and CP dispatch from the
ids they are given, so replay holds for them unchanged.

Legend: B rows, T tokens, L MoE layers, K experts per token.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch

_SCOPE = contextvars.ContextVar("bumblebee_routing_scope", default=None)


@dataclass
class RoutingScope:
    replay_BTLK: torch.Tensor | None = None
    record: dict | None = field(default=None)

    def given(self, moe_index: int, B: int, T: int) -> torch.Tensor | None:
        """Layer ``moe_index``'s given ids as [B*T, K] (None: select as usual)."""
        if self.replay_BTLK is None:
            return None
        r = self.replay_BTLK
        if r.dim() != 4 or tuple(r.shape[:2]) != (B, T) or moe_index >= r.shape[2]:
            raise ValueError(
                f"routing replay ids must be [B, T, L, K] = [{B}, {T}, >{moe_index}, K] like the "
                f"input ids, got {list(r.shape)}"
            )
        return r[:, :, moe_index].reshape(B * T, -1).long()

    def note(self, moe_index: int, idx_TK: torch.Tensor, B: int, T: int) -> None:
        if self.record is not None:
            self.record[moe_index] = idx_TK.detach().reshape(B, T, -1)

    def recorded(self) -> torch.Tensor:
        """The recorded ids [B, T, L, K] in MoE layer order."""
        assert self.record, "nothing recorded: pass record={} and run a forward"
        return torch.stack([self.record[i] for i in sorted(self.record)], dim=2)


def current() -> RoutingScope | None:
    return _SCOPE.get()


@contextlib.contextmanager
def entered(scope: RoutingScope | None):
    """Run the enclosed forward under ``scope`` (None: plain routing)."""
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def check_routing(routing_BTLK: torch.Tensor, layers: int, top_k: int, experts: int) -> None:
    """A replayed routing's one-line ``ValueError`` / ``TypeError`` at the API boundary: integer
    ids, one [L, K] block per token for the model's ``layers`` MoE layers and ``top_k`` experts,
    every id in [0, experts). A wrong K or L would otherwise train on other experts silently."""
    if routing_BTLK.dtype.is_floating_point or routing_BTLK.dtype == torch.bool:
        raise TypeError(f"routing must hold integer expert ids, got {routing_BTLK.dtype}")
    L, K = routing_BTLK.shape[2:]
    if (L, K) != (layers, top_k):
        raise ValueError(
            f"routing has {L} MoE layers x {K} experts per token; this model has {layers} MoE "
            f"layers with top-{top_k} routing ([rows, tokens, {layers}, {top_k}])"
        )
    if routing_BTLK.numel():
        lo, hi = int(routing_BTLK.min()), int(routing_BTLK.max())
        if lo < 0 or hi >= experts:
            raise ValueError(f"routing holds expert ids in [{lo}, {hi}]; valid: 0..{experts - 1}")

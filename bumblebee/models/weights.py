"""How a model's parameters start (the ``WeightInit`` part of ``CausalLM``, models/base.py).

Every value is a function of (seed, tensor name, position) only (primitives/init.py), so an
expert slice, an FSDP2 shard or a pipeline stage gets exactly its part of the full tensors and
every layout of a seed trains the same model, also one built on the meta device and split
before it got memory (``build_model(..., device="meta")``, then ``materialize``). A mixin: it
reads the model's parameters, ``groups`` and ``is_expert_param``, and holds no state.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from bumblebee.primitives import init
from bumblebee.primitives.sharding.common import row_extent


class WeightInit:
    """HF-style: normal(0, std) for matrices, the family's ``init_vectors`` for the rest."""

    def init_vectors(self, std: float) -> dict:
        """Fill rules (primitives/init.py) for what is not a matrix: parameter or buffer name ->
        ``fill``; may also override a matrix's rule. Default: ones for every 1-D parameter (RMSNorm
        weights). Buffers without a rule keep their constructor values (zeros after ``materialize``)."""
        return {name: init.const(1.0) for name, p in self.named_parameters() if p.dim() == 1}

    def init_rules(self, std: float) -> dict:
        """How every parameter starts: name -> ``fill(block, generator)``. HF-style: normal(0, std)
        for matrices, then the family's ``init_vectors``."""
        rules = {name: init.normal(std) for name, p in self.named_parameters() if p.dim() > 1}
        rules.update(self.init_vectors(std))
        from bumblebee.models.lora import lora_init_rules

        rules.update(lora_init_rules(self.named_parameters(), init))
        return rules

    @torch.no_grad()
    def reset_parameters(
        self, std: float = 0.02, seed: int | None = None, only=None, on_device: bool = False
    ) -> None:
        """Initialize in place, identically for every layout of ``seed``: each value is a function
        of (seed, tensor name, position) only (primitives/init.py), so an expert slice, an FSDP2
        shard or a pipeline stage gets exactly its part of the full tensors, generated one block
        at a time. ``seed=None`` draws one from torch's global generator. Nothing to do on meta.
        ``only(name) -> bool``: the parameters to fill (the adapters of a model loaded from HF).
        ``on_device``: draw on each tensor's device (init.fill_rows)."""
        if any(p.is_meta or is_fake(p) for p in self.parameters()):  # shapes only (or fakes)
            return
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        rules = self.init_rules(std)
        ep, r = self.groups.ep_size, self.groups.ep_rank
        for name, p in self.named_parameters():
            if only is not None and not only(name):
                continue
            if name not in rules:
                raise NotImplementedError(
                    f"{type(self).__name__}: no init rule for {name} (init_vectors)"
                )
            shape, lo, part = row_extent(p, self.is_expert_param(name), r, ep)
            init.fill_rows(part, shape, lo, rules[name], seed, name, on_device=on_device)
        for name, b in self.named_buffers():
            if name in rules and only is None:
                init.fill_rows(b, tuple(b.shape), 0, rules[name], seed, name, on_device=on_device)

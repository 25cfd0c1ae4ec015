"""LoRA adapters out of the Engine as a PEFT adapter directory (``Engine.export_peft``).

The merged weights (rollout sync, HF export) come from ``rl/weights.py``; this writes the factors
themselves, gathered over FSDP2 shards and expert-parallel ranks, through
``models/lora.write_peft_adapter`` (safetensors + JSON; ``peft`` is not imported).
"""

from __future__ import annotations

from bumblebee.models.lora import is_lora_name, write_peft_adapter
from bumblebee.rl.weights import _gather, gathered


class EngineAdapters:
    """Mixin of ``rl.engine.Engine``: export_peft."""

    def export_peft(self, out_dir: str) -> None:
        """Write the LoRA adapters as a PEFT adapter directory (adapter_config.json +
        adapter_model.safetensors, models/lora.py) from rank 0; ``peft`` loads it onto the
        ``transformers`` model of the base checkpoint. Collective."""
        lora = self._lora
        if lora is None:
            raise ValueError("export_peft needs LoRA adapters (model.lora.rank > 0)")
        from bumblebee.models import family_of

        family = family_of(self.arch)
        out = family.hf_name_out
        if self.ctx.pp_group is None:  # the factors only, never the frozen base
            factors = (
                (n, _gather(self.model, n, p, self.ctx, None))
                for n, p in self.model.named_parameters()
                if is_lora_name(n)
            )
        else:  # every stage's tensors, in the stages' order
            factors = ((n, t) for n, t in gathered(self.model, self.ctx, None) if is_lora_name(n))
        if self.ctx.rank == 0:
            write_peft_adapter(
                out_dir,
                lora,
                factors,
                (lambda n: out(self.arch, n)) if out else None,
                self.cfg.model.hf_path,
            )
        else:
            for _ in factors:
                pass
        self._barrier()

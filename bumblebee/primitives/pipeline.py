"""Pipeline-parallel schedules (slot ``pipeline``): gpipe (the reference), 1f1b, interleaved_1f1b.

Each implementation is one schedule of ``torch.distributed.pipelining``; this
file adds only what the runtime needs to choose and check it: whether it runs
several (virtual) stages per rank, the constraints it puts on the number of
micro-batches, and its ideal bubble fraction. The runtime builds the stages
(``runtime/pipeline.py``) and calls ``build``.

Ideal bubble (idle fraction of a rank's step, all stages equally fast, backward
any multiple of forward), P ranks, m micro-batches, v stages per rank:

    gpipe, 1f1b:       (P - 1) / (m + P - 1)
    interleaved_1f1b:  (P - 1) / (v m + P - 1)

GPipe (Huang et al., 2019) runs every forward, then every backward: all m
micro-batches' activations are alive at once. 1F1B (PipeDream-Flush, Narayanan
et al., 2021) alternates one forward and one backward in the steady state, so a
rank holds at most P micro-batches' activations; same bubble. Interleaved 1F1B
(Narayanan et al., SC'21) gives each rank v smaller stages (layers round-robin:
stage s on rank s mod P), dividing the bubble by about v for v times as many
point-to-point transfers.

Every schedule uses ``scale_grads=False``: the loss each micro-batch hands to
the schedule is already its share of the global mean (summed token losses /
global token count), so gradients must not be divided again.
"""

from __future__ import annotations

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from bumblebee.registry import register


class _Schedule:
    interleaved = False  # True: v >= 2 stages per rank
    schedule_class: type

    @classmethod
    def check(cls, pp: int, microbatches: int, virtual: int) -> str | None:
        """Why (pp, microbatches, virtual stages per rank) cannot run, or None."""
        if cls.interleaved and virtual < 2:
            return "needs primitives.pp_virtual_stages >= 2 (stages per rank)"
        if not cls.interleaved and virtual != 1:
            return "runs one stage per rank: set primitives.pp_virtual_stages = 1 (or use interleaved_1f1b)"
        return None

    @classmethod
    def bubble(cls, pp: int, microbatches: int, virtual: int = 1) -> float:
        """Ideal bubble fraction (see the module docstring)."""
        v = virtual if cls.interleaved else 1
        return (pp - 1) / (v * microbatches + pp - 1)

    @classmethod
    def build(cls, stages: list, microbatches: int, loss_fn):
        """The torch schedule running this rank's ``stages`` (PipelineStage objects)."""
        if cls.interleaved:
            return cls.schedule_class(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
        (stage,) = stages
        return cls.schedule_class(stage, microbatches, loss_fn=loss_fn, scale_grads=False)


@register(
    "pipeline", "gpipe", reference=True, summary="all forwards, then all backwards (fill-drain)"
)
class GPipe(_Schedule):
    schedule_class = ScheduleGPipe


@register(
    "pipeline",
    "1f1b",
    summary="one forward, one backward in the steady state (<= P micro-batches alive)",
)
class OneFOneB(_Schedule):
    schedule_class = Schedule1F1B

    @classmethod
    def check(cls, pp: int, microbatches: int, virtual: int) -> str | None:
        if microbatches < pp:
            return f"needs at least pp = {pp} micro-batches per step, got {microbatches}"
        return super().check(pp, microbatches, virtual)


@register(
    "pipeline", "interleaved_1f1b", summary="1F1B over v virtual stages per rank (bubble / v)"
)
class Interleaved1F1B(_Schedule):
    schedule_class = ScheduleInterleaved1F1B
    interleaved = True

    @classmethod
    def check(cls, pp: int, microbatches: int, virtual: int) -> str | None:
        rounds = max(1, microbatches // pp)  # torch's flexible rounds of pp micro-batches
        if microbatches % rounds:
            return (
                f"needs a micro-batch count that is a multiple of max(1, m // pp) = {rounds}, "
                f"got {microbatches}"
            )
        return super().check(pp, microbatches, virtual)

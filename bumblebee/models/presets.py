"""Named model presets, stored as Hugging Face ``config.json`` dictionaries.

Real-size presets carry the public dimensions of the released Hugging Face configs (used by the
planner and by dry runs); the ``tiny`` presets are what tests and the default
run train on a CPU. A preset is plain data so that every layer (models, plan)
can read it without building anything.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping


class _Presets(Mapping):
    """family name -> {preset name: HF config dict}, read from the family table (each family keeps
    its presets in its own folder)."""

    def _families(self) -> dict:
        from bumblebee.models.family import FAMILIES

        return FAMILIES

    def __getitem__(self, family: str) -> dict[str, dict]:
        return self._families()[family].presets

    def __iter__(self) -> Iterator[str]:
        return iter(self._families())

    def __len__(self) -> int:
        return len(self._families())


PRESETS: Mapping[str, dict[str, dict]] = _Presets()


def preset(family: str, name: str) -> dict:
    """The HF config dict of a preset (a copy)."""
    import copy

    return copy.deepcopy(PRESETS[family][name])

"""Performance accounting: peak memory of a step (CPU and CUDA)."""

from bumblebee.perf.memory import CATEGORIES, MemoryTracker  # noqa: F401

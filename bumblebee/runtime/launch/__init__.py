"""Launching a run: the launcher and torchrun, failures, signals and interrupts, the out-dir
lock and the checks before launch."""

"""Checkpoints: save and resume (crash-safe, any layout), integrity, verify, HF export, and an
earlier run's record set aside."""

"""Adapters that plug bumblebee into other frameworks (each an optional extra, imported only by
its user): ``bumblebee.integrations.verl`` registers the RL Engine as a verl training backend."""

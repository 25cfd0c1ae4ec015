"""``bumblebee pair``: the A/B tool (configs, the paired run, the verdict table)."""

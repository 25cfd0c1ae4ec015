"""The training protocol: launch, device mesh, step loop, optimizer, checkpoints, metrics."""

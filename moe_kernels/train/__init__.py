"""Training: the trainer, data, checkpoints, metrics and the `moe-train` CLI."""

"""Where a run's metrics go beyond the service: ``wandb_recorder`` (Weights & Biases)."""

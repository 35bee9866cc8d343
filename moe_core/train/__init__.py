"""The training loop, its schedules, checkpoints and metrics."""

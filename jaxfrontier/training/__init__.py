"""Training: state and optimizer, the step and the loop, metrics, checkpoints, export."""

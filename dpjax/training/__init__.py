"""The training engine: a run's plan, its DP step, the loop, checkpoints,
sizing and compiled cost. No TensorFlow: it receives numpy arrays."""

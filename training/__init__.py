"""One training run: config schema, runtime, optimizer, checkpoints, metrics, the loop."""

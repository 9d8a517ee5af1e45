"""Training and sampling plumbing: config schema, runtime, optimizer, checkpoints, metrics, the loop."""

"""The estimate of a training step's memory behind bench.py memory and docs/gpu.md's table of what fits."""

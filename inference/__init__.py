"""Using a trained model: loading it and sampling (sampling.py), evaluating (eval_run.py), and serving it through
OpenAI's API with continuous batching (engine.py, server.py, serve_run.py)."""

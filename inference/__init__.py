"""Using a trained model: loading it (load.py), sampling (sampling.py, sample_text.py), evaluating (eval_run.py),
and serving it through OpenAI's API with continuous batching (engine.py, server.py, serve_run.py)."""

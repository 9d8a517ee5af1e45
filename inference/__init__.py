"""Using a trained model: loading it and sampling (sampling.py), evaluating (eval_run.py), and serving it through
OpenAI's API, requests taking turns on the model a slice at a time (engine.py, server.py)."""

"""Evaluation beyond the training loop's val loss: sliding-window perplexity and HellaSwag."""

"""Data: text sources, tokenizers, token files and batches."""

"""The GPT model: configuration, attention and the transformer."""

from model.attention import causal_mask, masked_attention  # noqa: F401
from model.gpt import ATTN_IMPLS, GPT, GPTConfig, ModelConfig  # noqa: F401

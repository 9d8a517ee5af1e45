"""The GPT model: configuration, attention and the transformer."""

from model.attention import CausalSelfAttention, causal_mask, masked_attention
from model.config import ATTN_IMPLS, GPTConfig
from model.gpt import GPT

__all__ = ["ATTN_IMPLS", "GPT", "GPTConfig", "CausalSelfAttention", "causal_mask", "masked_attention"]

"""The GPT model: configuration, attention and the transformer."""

from model.attention import CausalSelfAttention, causal_mask, masked_attention
from model.gpt import ACTIVATIONS, ATTN_IMPLS, GPT, POS_EMBS, GPTConfig, parameter_count

__all__ = [
    "ACTIVATIONS",
    "ATTN_IMPLS",
    "POS_EMBS",
    "GPT",
    "GPTConfig",
    "CausalSelfAttention",
    "causal_mask",
    "masked_attention",
    "parameter_count",
]

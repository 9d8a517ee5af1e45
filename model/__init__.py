"""The GPT model: configuration, attention and the transformer."""

from model.attention import CausalSelfAttention, causal_mask, masked_attention
from model.config import ACTIVATIONS, ATTN_IMPLS, POS_EMBS, GPTConfig
from model.gpt import GPT

__all__ = [
    "ACTIVATIONS",
    "ATTN_IMPLS",
    "POS_EMBS",
    "GPT",
    "GPTConfig",
    "CausalSelfAttention",
    "causal_mask",
    "masked_attention",
]

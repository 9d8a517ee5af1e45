"""The model's shape: everything needed to rebuild a GPT from a checkpoint.

These fields are also train.py's `model.*` keys (training/schema.py derives them from here, less vocab_size,
which comes from the data): each key's allowed values are declared once, below.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import check_fields, option
from common.errors import ConfigError

ATTN_IMPLS = ("flash", "math")
# gelu: exact (erf); gelu_tanh: the tanh approximation OpenAI's GPT-2 weights were trained with (HF's gelu_new);
# relu2: ReLU(x)², as in modded-nanogpt, cheaper than GELU's erf on CPU.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu2")
POS_EMBS = ("learned", "rope")  # rope: rotary embeddings on queries and keys instead of a learned table
_SIZES = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")


@dataclass
class GPTConfig:
    vocab_size: int = option(50257, at_least=1)
    block_size: int = option(1024, at_least=1)  # the context: positions the model sees at once
    n_layer: int = option(12, at_least=1)
    n_head: int = option(12, at_least=1)
    n_embd: int = option(768, at_least=1)  # width; a multiple of n_head
    dropout: float = option(0.0, at_least=0.0, below=1.0)
    bias: bool = True  # biases in the linear layers and LayerNorms
    attn_impl: str = option("flash", choices=ATTN_IMPLS)  # flash (fused SDPA) | math (the textbook formula)
    activation: str = option("gelu", choices=ACTIVATIONS)
    pos_emb: str = option("learned", choices=POS_EMBS)

    def __post_init__(self) -> None:
        """Raises ConfigError (a ValueError) naming the field."""
        for name in _SIZES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        check_fields(self)
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; pick n_embd as a multiple of n_head"
            )
        if self.pos_emb == "rope" and (self.n_embd // self.n_head) % 2:
            raise ConfigError(f"pos_emb=rope needs an even head size; n_embd/n_head is {self.n_embd // self.n_head}")

"""The model's shape: everything needed to rebuild a GPT from a checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

ATTN_IMPLS = ("flash", "math")
# gelu: exact (erf); gelu_tanh: the tanh approximation OpenAI's GPT-2 weights were trained with (HF's gelu_new);
# relu2: ReLU(x)², as in modded-nanogpt, cheaper than GELU's erf on CPU.
ACTIVATIONS = ("gelu", "gelu_tanh", "relu2")
POS_EMBS = ("learned", "rope")  # rope: rotary embeddings on queries and keys instead of a learned table


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    attn_impl: str = "flash"
    activation: str = "gelu"
    pos_emb: str = "learned"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; pick n_embd as a multiple of n_head"
            )
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl={self.attn_impl!r} is unknown; use one of {', '.join(ATTN_IMPLS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is unknown; use one of {', '.join(ACTIVATIONS)}")
        if self.pos_emb not in POS_EMBS:
            raise ValueError(f"pos_emb={self.pos_emb!r} is unknown; use one of {', '.join(POS_EMBS)}")
        if self.pos_emb == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"pos_emb=rope needs an even head size; n_embd/n_head is {self.n_embd // self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

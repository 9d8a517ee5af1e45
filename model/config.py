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
NORMS = ("layernorm", "rmsnorm")  # rmsnorm: scale only, no mean subtracted (cheaper; modded-nanogpt's)
WINDOWED, FULL = "S", "L"  # window_pattern's letters: a sliding-window layer, a full causal one
BIGRAM_ROWS = 65521  # the largest prime below 2**16: vocabularies up to 255 tokens get exact bigrams
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
    # Sliding-window attention: query i sees keys i-attn_window+1 .. i (null: every earlier key, causal as GPT-2).
    attn_window: int | None = option(None, at_least=1)
    # Which layers use attn_window: S (windowed) or L (full), first layer first. A pattern shorter than n_layer
    # is repeated and its last layer made L; one of exactly n_layer letters is used as written ("SSSS": every
    # layer windowed, so with rope generation can roll past block_size). Null means "S": all but the last layer.
    # While attn_window is null no layer is windowed, whatever the pattern: attn_window=null switches windows off.
    window_pattern: str | None = None
    # Modern options (modded-nanogpt's), all off by default: off, the model is GPT-2's. docs/speedrun.md measures them.
    norm: str = option("layernorm", choices=NORMS)  # the blocks' and the final norm
    qk_norm: bool = False  # RMS-normalise each head's queries and keys before their scores
    untied_head: bool = False  # an output head of its own, initialised to zero, instead of wte's transpose
    zero_init_proj: bool = False  # the blocks' output projections start at zero: every block starts as identity
    logit_softcap: float | None = option(None, above=0.0)  # logits = cap * tanh(logits / cap); null: none
    x0_mix: bool = False  # each block's input mixes in the embeddings: a*x + b*x0, learned a, b from 1, 0
    value_residual: bool = False  # layers after the first mix in its values: v = a*v + b*v_first, a, b from 0.5
    value_embeds: bool = False  # each layer adds a token embedding of its own to its values
    bigram_embed: bool = False  # add an embedding of (previous token, token); exact for small vocabularies, else hashed

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
        self._check_window_pattern()

    def _check_window_pattern(self) -> None:
        pattern = self.window_pattern
        if pattern is None:
            return
        if not pattern or set(pattern) - {WINDOWED, FULL}:
            raise ConfigError(f"window_pattern={pattern} may only hold the letters S (windowed) and L (full)")
        if WINDOWED not in pattern and self.attn_window is not None:
            raise ConfigError(f"window_pattern={pattern} windows no layer; add an S or set attn_window=null")
        if len(pattern) > self.n_layer:
            raise ConfigError(f"window_pattern={pattern} has more letters than n_layer={self.n_layer}")

    def layer_windows(self) -> list[int | None]:
        """Each layer's attention window, first layer first (None: full causal attention)."""
        if self.attn_window is None:
            return [None] * self.n_layer
        pattern = self.window_pattern or WINDOWED
        if len(pattern) < self.n_layer:
            pattern = (pattern * self.n_layer)[: self.n_layer - 1] + FULL
        return [self.attn_window if letter == WINDOWED else None for letter in pattern]

    @property
    def rolls(self) -> bool:
        """Every layer windowed and positions relative (rope): no position depends on where the sequence began,
        so the model runs on sequences of any length and a KV cache can roll past block_size. Only for a window
        within block_size: a wider one would look further back than training ever showed it."""
        windowed = self.attn_window is not None and self.attn_window <= self.block_size
        return windowed and self.pos_emb == "rope" and None not in self.layer_windows()

    @property
    def receptive_field(self) -> int | None:
        """How many tokens, itself included, can change one position's logits; None: all earlier ones."""
        windows = self.layer_windows()
        if None in windows:
            return None
        return 1 + sum(w - 1 for w in windows) + int(self.bigram_embed)  # a bigram: the token before too

    @property
    def bigram_rows(self) -> int:
        """bigram_embed's table: a row per (previous token or none, token) while that fits BIGRAM_ROWS, else
        BIGRAM_ROWS rows that the pairs share by hashing (a prime modulus spreads them)."""
        return min(self.vocab_size * (self.vocab_size + 1), BIGRAM_ROWS)


def parameter_count(config: GPTConfig) -> int:
    """The parameters GPT(config) holds, without building it."""
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    bias = config.bias
    norm = C * (2 if config.norm == "layernorm" and bias else 1)
    block = 2 * norm + 3 * C * C + 3 * C * bias + C * C + C * bias + 8 * C * C + 5 * C * bias
    block += 2 * config.x0_mix + (V * C if config.value_embeds else 0)
    total = L * block + V * C + norm  # blocks, the token table (tied to the head), the final norm
    total += (L - 1) * 2 * config.value_residual  # each later layer's value mix
    total += config.block_size * C if config.pos_emb == "learned" else 0
    total += V * C if config.untied_head else 0
    total += config.bigram_rows * C if config.bigram_embed else 0
    return total

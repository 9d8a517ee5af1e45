"""A decoder-only transformer, GPT-2's by default, options swapping in modded-nanogpt's parts; and its decoding loop.
model/checkpoint.py owns ckpt.pt."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from common.config import check_fields, option
from common.errors import ConfigError
from model.attention import CausalSelfAttention, KVCache

Generators = Sequence[torch.Generator | None] | None  # one random stream per row (row_generators)

ATTN_IMPLS = ("flash", "math")
# gelu: exact; gelu_tanh: GPT-2's tanh approximation (HF's gelu_new); relu2: ReLU(x)² (modded-nanogpt), cheap on CPU
ACTIVATIONS = ("gelu", "gelu_tanh", "relu2")
POS_EMBS = ("learned", "rope")  # rope: rotary embeddings on queries and keys instead of a learned table
NORMS = ("layernorm", "rmsnorm")  # rmsnorm: scale only, no mean subtracted (cheaper; modded-nanogpt's)
WINDOWED, FULL = "S", "L"  # window_pattern's letters: a sliding-window layer, a full causal one
MAX_LAYERS, MAX_WIDTH, MAX_CONTEXT, MAX_VOCAB = 1024, 65536, 2**20, 2**24  # far past GPT-2 XL, short of absurd
BIGRAM_ROWS = 65521  # the largest prime below 2**16: vocabularies up to 255 tokens get exact bigrams
PREFILL_CHUNK = 1024  # tokens of a rolling model's prompt run through the cache at a time (GPT.prefill)


@dataclass
class ModelConfig:
    """The model's shape and options: train.py's `model.*` keys, the baby model's by default (configs/model/baby.yaml).
    GPTConfig adds the vocabulary, which the data sets."""

    KEYS: ClassVar[str] = "model."  # how a message names a key
    # The token table's rows: the vocabulary rounded up to a multiple of this, which GPU kernels run faster on (64:
    # GPT-2's 50257 becomes 50304, as nanoGPT pads it; a char model pays ~1 % a step on a CPU). The extra rows' ids
    # are no tokens: never a target, a logit or a sample.
    vocab_multiple: int = option(64, at_least=1, at_most=1024)
    block_size: int = option(64, at_least=1, at_most=MAX_CONTEXT)  # the context: positions the model sees at once
    n_layer: int = option(4, at_least=1, at_most=MAX_LAYERS)  # transformer blocks
    n_head: int = option(4, at_least=1, at_most=MAX_WIDTH)  # attention heads per block
    n_embd: int = option(128, at_least=1, at_most=MAX_WIDTH)  # width; a multiple of n_head
    dropout: float = option(0.0, at_least=0.0, below=1.0)  # on embeddings, attention weights and residual branches
    bias: bool = True  # biases in the linear layers and LayerNorms
    attn_impl: str = option("flash", choices=ATTN_IMPLS)  # flash (fused SDPA) | math (the textbook formula)
    activation: str = option("gelu", choices=ACTIVATIONS)  # the MLP's: gelu | gelu_tanh (GPT-2's) | relu2 (ReLU²)
    pos_emb: str = option("learned", choices=POS_EMBS)  # learned (a position table) | rope (rotary, on q and k)
    # query i sees keys i-attn_window+1 .. i; null: all earlier
    attn_window: int | None = option(None, at_least=1, at_most=MAX_CONTEXT)
    # Which layers use attn_window: S (windowed) or L (full), first layer first. A pattern shorter than n_layer is
    # repeated and its last layer made L; one of n_layer letters is used as written ("SSSS": every layer windowed, so
    # with rope generation can roll past block_size). Null: "S", all but the last layer. attn_window=null: no windows.
    window_pattern: str | None = None
    # Modern options (modded-nanogpt's), all off by default: off, the model is GPT-2's. docs/speedrun.md measures them.
    norm: str = option("layernorm", choices=NORMS)  # the blocks' and the final norm
    qk_norm: bool = False  # RMS-normalise each head's queries and keys before their scores
    logit_softcap: float | None = option(None, above=0.0)  # logits = cap * tanh(logits / cap); null: none
    x0_mix: bool = False  # each block's input mixes in the embeddings: a*x + b*x0, learned a, b from 1, 0
    value_residual: bool = False  # layers after the first mix in its values: v = a*v + b*v_first, a, b from 0.5
    bigram_embed: bool = False  # add an embedding of (previous token, token); exact for small vocabularies, else hashed

    def __post_init__(self) -> None:
        check_fields(self, self.KEYS)
        if self.n_embd % self.n_head:
            raise ConfigError(f"{self.KEYS}n_embd={self.n_embd} is not divisible by n_head={self.n_head}; use a "
                              "multiple of it")
        if self.pos_emb == "rope" and (self.n_embd // self.n_head) % 2:
            raise ConfigError(f"{self.KEYS}pos_emb=rope needs an even head size; n_embd/n_head is "
                              f"{self.n_embd // self.n_head}")
        if self.window_pattern is not None:
            self._check_window_pattern()

    def _check_window_pattern(self) -> None:
        keys, pattern = self.KEYS, self.window_pattern
        if not pattern or set(pattern) - {WINDOWED, FULL}:
            raise ConfigError(f"{keys}window_pattern={pattern} may only hold the letters S (windowed) and L (full)")
        if WINDOWED not in pattern and self.attn_window is not None:
            raise ConfigError(f"{keys}window_pattern={pattern} windows no layer; add an S or set attn_window=null")
        if len(pattern) > self.n_layer:
            raise ConfigError(f"{keys}window_pattern={pattern} has more letters than n_layer={self.n_layer}")

    def with_vocabulary(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(vocab_size=vocab_size, **dataclasses.asdict(self))


@dataclass
class GPTConfig(ModelConfig):
    """All a checkpoint needs to rebuild the model: its shape and options, and the tokenizer's vocabulary."""

    KEYS: ClassVar[str] = ""
    vocab_multiple: int = option(1, at_least=1, at_most=1024)  # a checkpoint saved without the key: unpadded
    vocab_size: int = option(50257, at_least=1, at_most=MAX_VOCAB)  # the tokenizer's tokens

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
        """No position depends on where the sequence began: the model runs on any length, its KV cache rolling."""
        windows = self.layer_windows()
        return self.pos_emb == "rope" and None not in windows and max(windows) <= self.block_size

    @property
    def receptive_field(self) -> int | None:
        """How many tokens, itself included, can change a position's logits (a bigram reaches one more); None: all."""
        windows = self.layer_windows()
        return None if None in windows else 1 + sum(w - 1 for w in windows) + int(self.bigram_embed)


class BigramEmbedding(nn.Module):
    """A row per (previous token, token) pair, so pair statistics needn't be learnt through attention. Row
    vocab_size * vocab_size + token: no previous token; past BIGRAM_ROWS rows, pairs share rows (a prime modulus)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.vocab_size = config.vocab_size
        self.table = nn.Embedding(min(config.vocab_size * (config.vocab_size + 1), BIGRAM_ROWS), config.n_embd)

    def forward(self, idx: Tensor, previous: Tensor | None) -> Tensor:
        """Embeddings (B, T, n_embd) of idx (B, T); previous (B, 1): the token before idx[:, 0], if any."""
        before = torch.full_like(idx[:, :1], self.vocab_size) if previous is None else previous
        pairs = torch.cat((before, idx[:, :-1]), dim=1) * self.vocab_size + idx
        return self.table(pairs % self.table.num_embeddings)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.relu2 = config.activation == "relu2"
        self.gelu = "tanh" if config.activation == "gelu_tanh" else "none"  # GELU's exact form or its approximation

    def forward(self, x: Tensor) -> Tensor:
        h = self.c_fc(x)
        h = F.relu(h).square() if self.relu2 else F.gelu(h, approximate=self.gelu)
        return F.dropout(self.c_proj(h), self.dropout, self.training)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)), x0_mix first mixing in the embeddings x0. value_residual's values
    pass as arguments and results: FSDP2 copies arguments, and writes break compile under activation checkpointing."""

    def __init__(self, config: GPTConfig, layer_index: int) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer_index)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)
        self.x0_mix = nn.Parameter(torch.tensor([1.0, 0.0])) if config.x0_mix else None  # from the plain residual

    def forward(self, x: Tensor, x0: Tensor, first_values: Tensor | None = None,
                cache: KVCache | None = None) -> tuple[Tensor, Tensor | None]:
        if self.x0_mix is not None:
            x = self.x0_mix[0] * x + self.x0_mix[1] * x0
        attended, values = self.attn(self.ln_1(x), first_values, cache)
        x = x + attended
        return x + self.mlp(self.ln_2(x)), values


class GPT(nn.Module):
    """hidden() runs the transformer, logits() the head on it; with a KVCache, the tokens follow the cached ones."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd) if config.pos_emb == "learned" else None,
            h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
            ln_f=make_norm(config),
            bigram=BigramEmbedding(config) if config.bigram_embed else None,
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        for module in self.modules():  # GPT-2 init: weights from N(0, 0.02), biases zero
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: the residual stream's variance doesn't grow with depth
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        rows = -config.vocab_size % config.vocab_multiple  # vocab_multiple's padding: zero rows no token has, added
        if rows:  # after every random draw, so that a padded model starts as the unpadded one does
            table = nn.Parameter(F.pad(self.lm_head.weight.detach(), (0, 0, 0, rows)))
            self.lm_head.weight = self.transformer.wte.weight = table
            self.lm_head.out_features = self.transformer.wte.num_embeddings = table.size(0)
        self.activation_checkpointing = False  # training: each block keeps only its input and runs again in backward

    def num_params(self, non_embedding: bool = True) -> int:
        """By default less the tables only looked up (no FLOPs): positions and bigrams."""
        tables = (self.transformer.wpe, self.transformer.bigram) if non_embedding else ()
        looked_up = sum(p.numel() for table in tables if table is not None for p in table.parameters())
        return sum(p.numel() for p in self.parameters()) - looked_up

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward and backward), as in the PaLM paper's appendix B."""
        c = self.config
        spans = (c.block_size if w is None else min(w, c.block_size) for w in c.layer_windows())
        return 6 * self.num_params() + 12 * c.n_embd * sum(spans)

    def hidden(self, idx: Tensor, cache: KVCache | None = None) -> Tensor:
        """Final hidden states (B, T, n_embd) of the tokens idx (B, T)."""
        T, parts = idx.size(1), self.transformer
        start = 0 if cache is None else cache.length  # the position of idx's first token
        if start + T > self.config.block_size and not self.config.rolls:
            raise ValueError(f"sequence length {start + T} exceeds block_size={self.config.block_size}; crop the input")
        x = parts.wte(idx)
        if parts.bigram is not None:
            x = x + parts.bigram(idx, None if cache is None else cache.last_token)
        if parts.wpe is not None:  # with rope, positions enter through the attention instead
            x = x + parts.wpe(torch.arange(start, start + T, device=idx.device))
        x = x0 = F.dropout(x, self.config.dropout, self.training)  # x0: what x0_mix mixes into every block's input
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        first_values = None  # value_residual: the first layer's values, which the later layers mix in
        for block in parts.h:
            args = (x, x0, first_values, cache)
            x, first_values = checkpoint(block, *args, use_reentrant=False) if recompute else block(*args)
        if cache is not None:  # every layer has stored the new tokens
            cache.length, cache.last_token = cache.length + T, idx[:, -1:]
        return parts.ln_f(x)

    def logits(self, hidden: Tensor) -> Tensor:
        """The next-token logits (..., vocab_size); the padded rows' (vocab_multiple) are cut off: no token's."""
        logits = self.lm_head(hidden)[..., : self.config.vocab_size]
        cap = self.config.logit_softcap  # every logit within (-cap, cap): none runs away early in training
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def forward(self, idx: Tensor, targets: Tensor | None = None,
                cache: KVCache | None = None) -> tuple[Tensor, Tensor | None]:
        """Logits (B, T, vocab_size) for every position of idx, and the mean cross-entropy if targets."""
        logits = self.logits(self.hidden(idx, cache))
        if targets is None:
            return logits, None
        # in float32 on every device: CUDA's autocast would run the log-softmax over the vocabulary in bfloat16
        return logits, F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=-1)

    @torch.no_grad()
    def attention_weights(self, idx: Tensor) -> Tensor:
        """Every layer's and head's softmax weights (n_layer, B, n_head, T, T), through the math path whatever
        attn_impl is: row i is query i's distribution over the keys it may see."""
        with self.capturing() as weights:
            self.hidden(idx)
        return torch.stack(weights)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[Tensor]]:
        """While inside, every forward runs the math path and each layer appends its softmax weights to the list."""
        weights: list[Tensor] = []
        for block in self.transformer.h:
            block.attn.captured = weights  # each layer appends its own, in order
        try:
            yield weights
        finally:
            for block in self.transformer.h:
                block.attn.captured = None

    def prefill(self, idx: Tensor, cache: KVCache) -> Tensor:
        """hidden() of the new tokens through the cache, a rolling model's PREFILL_CHUNK at a time (bounded memory)."""
        for chunk in idx.split(PREFILL_CHUNK if self.config.rolls else idx.size(1), dim=1):
            hidden = self.hidden(chunk, cache)
        return hidden

    @torch.inference_mode()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 use_cache: bool = True, *, top_p: float | None = None, min_p: float | None = None) -> Tensor:
        """idx (B, T) followed by max_new_tokens sampled tokens: nanoGPT's generate, on generate_tokens."""
        steps = self.generate_tokens(idx, max_new_tokens, Decoding(temperature, top_k, top_p, min_p), use_cache)
        return torch.cat([idx, *steps], dim=1)

    @torch.inference_mode()
    def generate_tokens(self, idx: Tensor, max_new_tokens: int, decoding: Decoding, use_cache: bool = True,
                        generators: Generators = None) -> Iterator[Tensor]:
        """Each next token (B, 1) as drawn: through the cache, or past block_size the last block_size tokens again."""
        config, rolls = self.config, self.config.rolls
        context = max(config.block_size, config.receptive_field or 0) if rolls else config.block_size
        cache = KVCache(config) if use_cache else None
        for _ in range(max_new_tokens):
            if cache is not None and (rolls or idx.size(1) <= context):
                hidden = self.prefill(idx[:, cache.length :], cache)
            else:  # all the tokens that can still reach the next one
                hidden = self.hidden(idx[:, -context:])
            next_id = decoding.next_token(self.logits(hidden[:, -1]), generators)
            idx = torch.cat((idx, next_id), dim=1)
            yield next_id


DEFAULT_TEMPERATURE = 0.8  # sample.py's and the wandb sample table's draws (serving follows OpenAI's defaults)
DEFAULT_TOP_K = 200
TINY = torch.finfo(torch.float32).tiny  # a temperature below it is greedy: the logits are divided in float32


@dataclass(frozen=True)
class Decoding:
    """The next token from the logits: temperature, the cut-offs (the most likely token always stays), a draw; in
    float32, as half precision is too coarse for top_p's sums. A generator per row keeps rows independent."""

    temperature: float = 1.0  # 0: greedy (argmax); below 1 sharper, above 1 flatter
    top_k: int | None = None  # keep the k most likely tokens
    top_p: float | None = None  # keep the fewest most likely tokens whose probabilities add up to p (nucleus)
    min_p: float | None = None  # keep tokens at least min_p times as likely as the most likely one

    @property
    def greedy(self) -> bool:
        return self.temperature < TINY or self.top_k == 1

    def next_token(self, logits: Tensor, generators: Generators = None) -> Tensor:
        """(B, V) logits -> (B, 1) token ids."""
        logits = logits.float()
        if self.temperature < TINY:
            return logits.argmax(dim=-1, keepdim=True)
        # the largest logit made 0 first: a tiny temperature sends the others to -inf, not the largest to inf
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(self.cut(logits / self.temperature), dim=-1)
        if generators is None:
            return torch.multinomial(probs, num_samples=1)
        return torch.stack([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)])

    def cut(self, logits: Tensor) -> Tensor:
        if self.top_k is not None and self.top_k < logits.size(-1):
            kth = torch.topk(logits, self.top_k).values[:, [-1]]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:  # nucleus: a token is dropped once the likelier reach top_p
            ordered, order = torch.sort(logits, dim=-1, descending=True)
            mass = ordered.softmax(dim=-1).cumsum(dim=-1)  # the likeliest is always kept: none come before it
            outside = torch.cat((torch.zeros_like(mass[:, :1], dtype=torch.bool), mass[:, :-1] >= self.top_p), dim=-1)
            logits = logits.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
        if self.min_p is not None:
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < self.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
        return logits


def row_generators(seed: int | None, count: int, device: torch.device | str = "cpu") -> list[torch.Generator] | None:
    """Row i's random stream seeded with seed + i, as sample i of sample.py and choice i of a request; None: torch's."""
    return None if seed is None else [torch.Generator(device=device).manual_seed(seed + i) for i in range(count)]

"""A decoder-only transformer (GPT-2 style): pre-LayerNorm blocks, learned positions, tied head; GPTConfig's
options swap in modded-nanogpt's parts (RMSNorm, rope, QK-norm, an untied head, shortcuts, a bigram table)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.attention import CausalSelfAttention
from model.batch_cache import BatchKVCache
from model.config import GPTConfig
from model.decoding import Decoding
from model.kv_cache import KVCache
from model.shortcuts import BigramEmbedding, Shortcuts

PREFILL_CHUNK = 1024  # tokens a rolling model's prompt runs through the cache at a time (GPT.prefill)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.activation = config.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Functional activation and dropout: a module call costs more than the op itself when decoding one token.
        h = self.c_fc(x)
        if self.activation == "gelu":
            h = F.gelu(h)
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        else:
            h = F.relu(h).square()
        return F.dropout(self.c_proj(h), self.dropout, self.training)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_index: int) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer_index)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)
        # x0_mix: the block's input is a*x + b*x0, learned; from 1, 0 (the plain residual stream)
        self.x0_mix = nn.Parameter(torch.tensor([1.0, 0.0])) if config.x0_mix else None

    def forward(
        self,
        x: torch.Tensor,
        shortcuts: Shortcuts,
        first_values: torch.Tensor | None = None,
        cache: KVCache | BatchKVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream after this block, and the values value_residual's later layers read (from the
        first layer of such a model; else None)."""
        if self.x0_mix is not None:
            x = self.x0_mix[0] * x + self.x0_mix[1] * shortcuts.x0
        attended, values = self.attn(self.ln_1(x), shortcuts, first_values, cache)
        x = x + attended
        return x + self.mlp(self.ln_2(x)), values


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd) if config.pos_emb == "learned" else None,
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=make_norm(config),
                bigram=BigramEmbedding(config.vocab_size, config.bigram_rows, config.n_embd)
                if config.bigram_embed
                else None,
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if not config.untied_head:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections so the residual stream's variance doesn't grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                if config.zero_init_proj:
                    nn.init.zeros_(p)
                else:
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        if config.untied_head:  # the first predictions are uniform, the loss exactly ln(vocab_size)
            nn.init.zeros_(self.lm_head.weight)
        # train.activation_checkpointing: in training, each block keeps only its input for backward and runs its
        # forward again there (a run's setting, not the model's shape: checkpoints don't record it)
        self.activation_checkpointing = False

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default less the tables that are only looked up, which cost no FLOPs: positions,
        bigrams, value embeddings, and the token table unless it is the (tied) head."""
        n = sum(p.numel() for p in self.parameters())
        if not non_embedding:
            return n
        t = self.transformer
        tables = [t.wpe, None if t.bigram is None else t.bigram.table, *(block.attn.value_embed for block in t.h)]
        if self.config.untied_head:
            tables.append(t.wte)
        return n - sum(table.weight.numel() for table in tables if table is not None)

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), as in the PaLM paper's appendix B; a windowed layer's
        attention counts the keys its window spans instead of the whole block."""
        c = self.config
        spans = (c.block_size if w is None else min(w, c.block_size) for w in c.layer_windows())
        return 6 * self.num_params() + 12 * c.n_embd * sum(spans)

    def hidden(self, idx: torch.Tensor, cache: KVCache | BatchKVCache | None = None) -> torch.Tensor:
        """Final hidden states (B, T, C) of the new tokens `idx`, after those already in `cache` (a BatchKVCache:
        each row after its own)."""
        n_past = 0 if cache is None else cache.length  # a BatchKVCache's longest row
        T = idx.size(1)
        if n_past + T > self.config.block_size and not self.config.rolls:
            raise ValueError(
                f"sequence length {n_past + T} exceeds block_size={self.config.block_size}; "
                "crop the input to the last block_size tokens"
            )
        x = self.transformer.wte(idx)
        if self.transformer.bigram is not None:
            x = x + self.transformer.bigram(idx, None if cache is None else cache.last_token)
        if self.transformer.wpe is not None:  # with rope, positions enter through the attention instead
            start = 0 if cache is None else cache.position  # an int, or each row's (B, 1)
            x = x + self.transformer.wpe(torch.arange(T, device=idx.device) + start)
        x = F.dropout(x, self.config.dropout, self.training)
        shortcuts = Shortcuts(x0=x, idx=idx)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        first_values = None  # value_residual: the first layer returns its values, the later ones mix them in
        for block in self.transformer.h:
            args = (x, shortcuts, first_values, cache)
            # non-reentrant recomputation: works under compile, DDP and FSDP2, and keeps dropout's random draws
            x, values = checkpoint(block, *args, use_reentrant=False) if recompute else block(*args)
            if values is not None:
                first_values = values
        if cache is not None:
            cache.advance(idx)
        return self.transformer.ln_f(x)

    def prefill(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Final hidden states of the last of the new tokens `idx` (B, T) run through the cache: a rolling model's
        PREFILL_CHUNK at a time, so a prompt of any length costs memory bounded by the chunk and the window (run
        at once, 100k characters on window_cpu's shape with 3 samples peaked at 3.6 GB)."""
        chunks = idx.split(PREFILL_CHUNK, dim=1) if self.config.rolls else (idx,)
        for chunk in chunks[:-1]:
            self.hidden(chunk, cache)
        return self.hidden(chunks[-1], cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head on final hidden states, soft-capped if logit_softcap: cap * tanh(logits / cap) keeps
        every logit within (-cap, cap), so none can run away early in training."""
        logits = self.lm_head(hidden)
        cap = self.config.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab_size) for every position of idx, and the mean cross-entropy if targets."""
        logits = self.logits(self.hidden(idx, cache))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def attention_weights(self, idx: torch.Tensor) -> torch.Tensor:
        """Softmax weights of every layer and head, (n_layer, B, n_head, T, T), through the math path
        of these same weights whatever attn_impl is: row i is query i's distribution over keys 0..i (or, in a
        windowed layer, i - attn_window + 1 .. i)."""
        attentions = [block.attn for block in self.transformer.h]
        weights: list[torch.Tensor] = []
        for attn in attentions:
            attn.captured = weights  # each layer appends its own, in order
        try:
            self.hidden(idx)
        finally:
            for attn in attentions:
                attn.captured = None
        return torch.stack(weights)

    @torch.inference_mode()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool = True,
        *,
        top_p: float | None = None,
        min_p: float | None = None,
    ) -> torch.Tensor:
        """`idx` (B, T) followed by `max_new_tokens` sampled tokens (generate_tokens). Decoding
        (model/decoding.py): temperature=0 is greedy; top_k, top_p and min_p cut the draw."""
        steps = self.generate_tokens(idx, max_new_tokens, Decoding(temperature, top_k, top_p, min_p), use_cache)
        return torch.cat([idx, *steps], dim=1)

    @torch.inference_mode()
    def generate_tokens(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        decoding: Decoding,
        use_cache: bool = True,
        generators: list[torch.Generator | None] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Each next token (B, 1) after `idx` (B, T) as soon as it is drawn, each step conditioned on all the
        model can see: a caller can show text as it comes, or stop early by no longer asking.

        With the cache the prompt is run once, then each step runs only the newest token. Once the sequence
        outgrows block_size, every step recomputes the cropped window, exactly as use_cache=False does:
        positions can't slide past a full layer. A rolling model (config.rolls: every layer windowed, rope)
        has no such limit: its cache keeps rolling, and without a cache each step recomputes the last
        receptive_field tokens (or block_size, if more), all that can reach the next token. generators: one per
        row, for draws that depend on the row alone (Decoding.next_token).
        """
        config = self.config
        rolls = config.rolls  # derived from the layer windows: once, not every step
        context = max(config.block_size, config.receptive_field or 0) if rolls else config.block_size
        cache = KVCache(config) if use_cache else None
        for _ in range(max_new_tokens):
            if cache is not None and (rolls or idx.size(1) <= context):
                hidden = self.prefill(idx[:, cache.length :], cache)
            else:
                hidden = self.hidden(idx[:, -context:])
            next_id = decoding.next_token(self.logits(hidden[:, -1, :]), generators)
            idx = torch.cat((idx, next_id), dim=1)
            yield next_id

"""Convert our GPT to and from HF's GPT2LMHeadModel; transformers (pip install ".[hf]") is imported only inside them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from common.errors import UserError
from model.gpt import GPT, GPTConfig

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel

PRETRAINED = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# gelu_new is OpenAI's tanh approximation written out, gelu_pytorch_tanh the same in one kernel.
_ACTIVATION_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
_GPT2_EOT = 50256  # <|endoftext|> in GPT-2's BPE: the start and end token of HF's generate()
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks older transformers versions kept in state_dict
SETTINGS = ("dropout", "attn_impl", "attn_window", "window_pattern")  # not fixed by the weights: as given, else default
_GPT2_OPTIONS = {  # GPT-2's values: others don't export
    "norm": "layernorm",
    "qk_norm": False,
    "logit_softcap": None,
    "x0_mix": False,
    "value_residual": False,
    "bigram_embed": False,
}
_TOKEN_TABLES = ("transformer.wte.weight", "lm_head.weight")  # one tied matrix: its padded rows don't export


class PretrainedError(UserError):
    """transformers missing, weights that can't be loaded, or a model the other format can't express."""


def load_pretrained(name_or_dir: str, *, block_size: int | None = None, **settings: Any) -> GPT:
    """A PRETRAINED name (HF downloads it once) or save_pretrained directory, as our GPT; other args as gpt_from_hf."""
    is_dir = Path(name_or_dir).is_dir()
    if name_or_dir not in PRETRAINED and not is_dir:
        raise PretrainedError(
            f"unknown pretrained model {name_or_dir!r}: use one of {', '.join(PRETRAINED)}, "
            "or a directory written by save_pretrained"
        )
    _require_transformers()
    from transformers import GPT2LMHeadModel

    try:
        with _quiet_hub():
            hf_model, info = GPT2LMHeadModel.from_pretrained(name_or_dir, output_loading_info=True)
    except Exception as err:  # no network, not in HF's cache, no weights, a corrupt config.json or weights file
        how = (
            "pass a directory written by save_pretrained"
            if is_dir
            else "Hugging Face needs network to download it the first time; offline, pass a local directory "
            "written by save_pretrained"
        )
        raise PretrainedError(f"can't load {name_or_dir!r} ({_first_line(err)}); {how}") from None
    missing = sorted(info["missing_keys"])
    if missing:  # from_pretrained leaves them randomly initialised and only warns
        raise PretrainedError(f"{name_or_dir!r} holds no weights for {missing[0]}: it is not a GPT-2 model")
    return gpt_from_hf(hf_model, block_size=block_size, **settings)


@contextlib.contextmanager
def _quiet_hub() -> Iterator[None]:
    """Offline, huggingface_hub logs a line per retry before it gives up: the one error line says it all."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "transformers")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def gpt_from_hf(hf_model: GPT2LMHeadModel, *, block_size: int | None = None, **settings: Any) -> GPT:
    """Our GPT computing hf_model's logits. block_size < n_positions keeps the first position embeddings (nanoGPT's
    crop_block_size), to finetune on shorter windows; settings: any of SETTINGS, which the weights leave open."""
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise TypeError(f"gpt_from_hf() takes no setting {sorted(unknown)}: the weights fix it")
    hf = hf_model.config
    _check_expressible(hf_model)
    if block_size is None:
        block_size = hf.n_positions
    elif block_size > hf.n_positions:
        raise PretrainedError(
            f"block_size={block_size} exceeds the {hf.n_positions} positions the weights have; "
            f"use block_size <= {hf.n_positions}"
        )
    config = GPTConfig(
        vocab_size=hf.vocab_size,
        block_size=block_size,
        n_layer=hf.n_layer,
        n_head=hf.n_head,
        n_embd=hf.n_embd,
        bias=True,
        activation=_ACTIVATION_FROM_HF[hf.activation_function],
        **settings,
    )
    model = GPT(config)
    ours = model.state_dict()
    theirs, conv1d = _hf_weights(hf_model)
    _check_same_keys(ours.keys(), theirs.keys())
    with torch.no_grad():
        for key, target in ours.items():
            value = theirs[key].t() if key in conv1d else theirs[key]  # Conv1D stores (in, out), Linear (out, in)
            if key == "transformer.wpe.weight":
                value = value[:block_size]
            _copy(key, target, value)
    return model.train(hf_model.training)


def hf_from_gpt(model: GPT) -> GPT2LMHeadModel:
    """The GPT2LMHeadModel computing model's logits, for HF's tools; bias=False exports as zero biases, and the token
    table its vocab_size rows, without the padding."""
    config = model.config
    if config.attn_window is not None:
        raise PretrainedError(
            f"attn_window={config.attn_window} can't be exported: GPT-2 attends to every earlier token "
            "(attn_window=null)"
        )
    if config.pos_emb != "learned":
        raise PretrainedError(
            f"pos_emb={config.pos_emb!r} can't be exported: GPT-2 has a learned position table only (pos_emb=learned)"
        )
    for name, gpt2s in _GPT2_OPTIONS.items():
        if getattr(config, name) != gpt2s:
            raise PretrainedError(
                f"{name}={getattr(config, name)!r} can't be exported: GPT-2 has no such option ({name}={gpt2s!r})"
            )
    if config.activation not in _ACTIVATION_TO_HF:
        raise PretrainedError(
            f"activation={config.activation!r} can't be exported: GPT-2 supports {', '.join(_ACTIVATION_TO_HF)}"
        )
    _require_transformers()
    from transformers import GPT2Config, GPT2LMHeadModel

    eot = _GPT2_EOT if config.vocab_size > _GPT2_EOT else None  # GPT-2's BPE; else no such token
    hf_model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=config.vocab_size,
            n_positions=config.block_size,
            n_layer=config.n_layer,
            n_head=config.n_head,
            n_embd=config.n_embd,
            activation_function=_ACTIVATION_TO_HF[config.activation],
            layer_norm_epsilon=model.transformer.ln_f.eps,
            resid_pdrop=config.dropout,
            embd_pdrop=config.dropout,
            attn_pdrop=config.dropout,
            tie_word_embeddings=True,
            bos_token_id=eot,
            eos_token_id=eot,
        )
    )
    ours = {k: v[: config.vocab_size] if k in _TOKEN_TABLES else v for k, v in model.state_dict().items()}
    theirs, conv1d = _hf_weights(hf_model)
    zero_biases = set() if config.bias else {k for k in theirs if k.endswith(".bias")}
    _check_same_keys(ours.keys() | zero_biases, theirs.keys())
    with torch.no_grad():
        for key, target in theirs.items():
            if key in zero_biases:
                target.zero_()
            else:
                _copy(key, target, ours[key].t() if key in conv1d else ours[key])
    return hf_model.train(model.training)


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise PretrainedError(
            f'GPT-2 weights need Hugging Face transformers ({err}); install it with pip install ".[hf]"'
        ) from None


def _check_expressible(hf_model: GPT2LMHeadModel) -> None:
    """Refuse, by key, what our GPT computes differently (not reorder_and_upcast_attn: it only changes rounding)."""
    hf = hf_model.config
    layer_norm_eps = nn.LayerNorm(1).eps  # model/gpt.py's LayerNorms keep torch's default
    refusals = [
        (
            hf.activation_function not in _ACTIVATION_FROM_HF,
            f"activation_function={hf.activation_function!r}: supported are {', '.join(_ACTIVATION_FROM_HF)}",
        ),
        (
            hf.layer_norm_epsilon != layer_norm_eps,
            f"layer_norm_epsilon={hf.layer_norm_epsilon}: ours is {layer_norm_eps}",
        ),
        (
            hf.n_inner not in (None, 4 * hf.n_embd),
            f"n_inner={hf.n_inner}: our MLP is 4 * n_embd = {4 * hf.n_embd} wide",
        ),
        (not hf.scale_attn_weights, "scale_attn_weights=False: our attention always divides by sqrt(head size)"),
        (hf.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=True: our attention has no such scale"),
        (hf.add_cross_attention, "add_cross_attention=True: our GPT is decoder-only"),
        (
            not torch.equal(hf_model.lm_head.weight, hf_model.transformer.wte.weight),
            "lm_head.weight differs from transformer.wte.weight (tie_word_embeddings=False): our GPT ties them",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise PretrainedError(f"this GPT-2 can't be converted: {why}")


def _check_same_keys(ours: AbstractSet[str], theirs: AbstractSet[str]) -> None:
    unmatched = sorted(ours ^ theirs)
    if unmatched:
        raise PretrainedError(f"{unmatched[0]} is in only one of the two models; they can't be converted")


def _hf_weights(hf_model: GPT2LMHeadModel) -> tuple[dict[str, torch.Tensor], set[str]]:
    """HF's state less its mask buffers, and the keys of its Conv1D ((in, out)) weights, found by type, not name."""
    from transformers.pytorch_utils import Conv1D

    state = {k: v for k, v in hf_model.state_dict().items() if not k.endswith(_HF_BUFFERS)}
    conv1d = {f"{name}.weight" for name, module in hf_model.named_modules() if isinstance(module, Conv1D)}
    return state, conv1d


def _copy(key: str, target: torch.Tensor, value: torch.Tensor) -> None:
    if target.shape != value.shape:  # copy_ would broadcast some mismatches silently
        raise PretrainedError(f"{key} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
    target.copy_(value)  # casts: HF may load half-precision weights


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__

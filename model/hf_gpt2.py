"""Our GPT to and from HF's GPT2LMHeadModel: OpenAI's weights in (init_from=gpt2), HF's tools out (export_hf.py)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from common.errors import UserError, first_line
from model.gpt import GPT, GPTConfig

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel

PRETRAINED = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# gelu_new is OpenAI's tanh approximation written out, gelu_pytorch_tanh the same in one kernel.
_ACTIVATION_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_ACTIVATION_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
SETTINGS = ("dropout", "attn_impl", "attn_window", "window_pattern")  # not fixed by the weights: as given, else default
# The keys an export writes (or leaves out, as vocab_multiple's padding); every other must keep its default, GPT-2's
_EXPORTED = {"vocab_size", "vocab_multiple", "block_size", "n_layer", "n_head", "n_embd", "bias", "activation",
             "dropout", "attn_impl", "window_pattern"}
_TOKEN_TABLES = ("transformer.wte.weight", "lm_head.weight")  # one tied matrix: its padded rows don't export


class PretrainedError(UserError):
    """transformers missing, weights that can't be loaded, or a model the other format can't express."""


def load_pretrained(name_or_dir: str, *, block_size: int | None = None, **settings: Any) -> GPT:
    """A PRETRAINED name (HF downloads it once) or save_pretrained directory, as our GPT; other args as gpt_from_hf."""
    if name_or_dir not in PRETRAINED and not Path(name_or_dir).is_dir():
        raise PretrainedError(f"unknown pretrained model {name_or_dir!r}: use one of {', '.join(PRETRAINED)}, or a "
                              "directory written by save_pretrained")
    transformers = _transformers()
    was = logging.root.manager.disable  # the caller's, put back after
    logging.disable(logging.WARNING)  # offline, huggingface_hub logs a line per retry: the one error line says it all
    try:
        hf_model, info = transformers.GPT2LMHeadModel.from_pretrained(name_or_dir, output_loading_info=True)
    except Exception as err:  # no network, not in HF's cache, no weights, a corrupt config.json or weights file
        raise PretrainedError(f"can't load {name_or_dir!r} ({first_line(err)}); Hugging Face needs the network "
                              "to download a model the first time, else pass a directory written by "
                              "save_pretrained") from None
    finally:
        logging.disable(was)
    missing = sorted(info["missing_keys"])
    if missing:  # from_pretrained leaves them randomly initialised and only warns
        raise PretrainedError(f"{name_or_dir!r} holds no weights for {missing[0]}: it is not a GPT-2 model")
    return gpt_from_hf(hf_model, block_size=block_size, **settings)


def gpt_from_hf(hf_model: GPT2LMHeadModel, *, block_size: int | None = None, **settings: Any) -> GPT:
    """Our GPT computing hf_model's logits. block_size < n_positions keeps the first position embeddings (nanoGPT's
    crop_block_size), to finetune on shorter windows; settings: any of SETTINGS, which the weights leave open."""
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise TypeError(f"gpt_from_hf() takes no setting {sorted(unknown)}: the weights fix it")
    hf = hf_model.config
    eps = nn.LayerNorm(1).eps  # model/gpt.py's LayerNorms keep torch's default
    refusals = [  # what our GPT would compute otherwise from these weights (not reorder_and_upcast_attn: rounding only)
        (hf.activation_function not in _ACTIVATION_FROM_HF,
         f"activation_function={hf.activation_function!r}: supported are {', '.join(_ACTIVATION_FROM_HF)}"),
        (hf.layer_norm_epsilon != eps, f"layer_norm_epsilon={hf.layer_norm_epsilon}: ours is {eps}"),
        (not hf.scale_attn_weights, "scale_attn_weights=False: our attention always divides by sqrt(head size)"),
        (hf.scale_attn_by_inverse_layer_idx, "scale_attn_by_inverse_layer_idx=True: our attention has no such scale"),
        (not torch.equal(hf_model.lm_head.weight, hf_model.transformer.wte.weight),
         "lm_head.weight differs from transformer.wte.weight (tie_word_embeddings=False): our GPT ties them"),
    ]
    for refused, why in refusals:
        if refused:
            raise PretrainedError(f"this GPT-2 can't be converted: {why}")
    block_size = hf.n_positions if block_size is None else block_size
    if block_size > hf.n_positions:
        raise PretrainedError(f"block_size={block_size} exceeds the {hf.n_positions} positions the weights have; use "
                              f"block_size <= {hf.n_positions}")
    model = GPT(GPTConfig(vocab_size=hf.vocab_size, block_size=block_size, n_layer=hf.n_layer, n_head=hf.n_head,
                          n_embd=hf.n_embd, bias=True, activation=_ACTIVATION_FROM_HF[hf.activation_function],
                          **settings))
    theirs, conv1d = _hf_weights(hf_model)
    theirs["transformer.wpe.weight"] = theirs["transformer.wpe.weight"][:block_size]
    _copy_weights(model.state_dict(), theirs, conv1d)
    return model.train(hf_model.training)


def hf_from_gpt(model: GPT) -> GPT2LMHeadModel:
    """The GPT2LMHeadModel computing model's logits, for HF's tools; bias=False exports as zero biases, and the token
    table as its vocab_size rows, without the padding."""
    config = model.config
    for key in dataclasses.fields(config):
        value = getattr(config, key.name)
        if key.name not in _EXPORTED and value != key.default:
            raise PretrainedError(f"{key.name}={value!r} can't be exported: GPT-2 has {key.name}={key.default!r}")
    if config.activation not in _ACTIVATION_TO_HF:
        raise PretrainedError(f"activation={config.activation!r} can't be exported: GPT-2 supports "
                              f"{', '.join(_ACTIVATION_TO_HF)}")
    transformers = _transformers()
    eot = 50256 if config.vocab_size > 50256 else None  # <|endoftext|> in GPT-2's BPE, HF generate()'s start and end
    hf_model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.block_size, n_layer=config.n_layer, n_head=config.n_head,
        n_embd=config.n_embd, activation_function=_ACTIVATION_TO_HF[config.activation],
        layer_norm_epsilon=model.transformer.ln_f.eps, resid_pdrop=config.dropout, embd_pdrop=config.dropout,
        attn_pdrop=config.dropout, tie_word_embeddings=True, bos_token_id=eot, eos_token_id=eot))
    ours = {k: v[: config.vocab_size] if k in _TOKEN_TABLES else v for k, v in model.state_dict().items()}
    theirs, conv1d = _hf_weights(hf_model)
    if not config.bias:  # GPT-2 has biases everywhere: ours are zero
        ours.update({k: torch.zeros_like(v) for k, v in theirs.items() if k.endswith(".bias")})
    _copy_weights(theirs, ours, conv1d)
    return hf_model.train(model.training)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise PretrainedError(f'GPT-2 weights need Hugging Face transformers ({err}); install it with pip install '
                              '".[hf]"') from None
    return transformers


def _hf_weights(hf_model: GPT2LMHeadModel) -> tuple[dict[str, torch.Tensor], set[str]]:
    """HF's state less the causal masks older versions kept in it, and the keys of its Conv1D ((in, out)) weights."""
    from transformers.pytorch_utils import Conv1D

    state = {k: v for k, v in hf_model.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    conv1d = {f"{name}.weight" for name, module in hf_model.named_modules() if isinstance(module, Conv1D)}
    return state, conv1d


def _copy_weights(targets: dict[str, torch.Tensor], sources: dict[str, torch.Tensor], conv1d: set[str]) -> None:
    """Each source into its target, Conv1D's (in, out) weights transposed to Linear's (out, in) or back."""
    unmatched = sorted(targets.keys() ^ sources.keys())
    if unmatched:
        raise PretrainedError(f"{unmatched[0]} is in only one of the two models; they can't be converted")
    with torch.no_grad():
        for key, target in targets.items():
            value = sources[key].t() if key in conv1d else sources[key]
            if target.shape != value.shape:  # copy_ would broadcast some mismatches silently
                raise PretrainedError(f"{key} has shape {tuple(value.shape)}, expected {tuple(target.shape)}")
            target.copy_(value)  # casts: HF may load half-precision weights

"""Config typed and checked once: every bad value is one ConfigError naming the key, the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from common.config import check_overrides, typed_config
from common.errors import ConfigError
from conftest import compose_config
from sample import SampleConfig
from train import TrainRunConfig
from training.resume import CONFIG_GROUPS

SCHEMAS = {"config": (TrainRunConfig, CONFIG_GROUPS), "sample": (SampleConfig, ())}


def refusal(config: str, overrides: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What a command line gets: check_overrides' line before Hydra runs (a key's name, type and range), else the typed
    config's refusal of the composed config (the rules between keys); "" if neither refuses."""
    schema, groups = SCHEMAS[config]
    overrides = ["out_dir=RUN", *overrides] if config == "sample" else overrides
    try:
        check_overrides(overrides, schema, groups)
        typed_config(compose_config(overrides, config_name=config), schema)
    except SystemExit as exit:
        assert exit.code == 2
        return capsys.readouterr().err.removeprefix("error: ").rstrip("\n")
    except ConfigError as err:
        return str(err)
    return ""


# Every rule of a key's name, type and value, in the words a user reads: (the command's config, overrides, message).
RULES = [
    ("sample", ["temperature=-1"], "temperature=-1.0 must be >= 0.0; 0 means greedy decoding (the most likely token)"),
    ("sample", ["top_p=1.01"], "top_p=1.01 must be <= 1.0; null means no cut-off"),
    ("sample", ["top_k=0"], "top_k=0 must be >= 1; null means no cut-off"),
    ("sample", ["max_new_tokens=0"], "max_new_tokens=0 must be >= 1"),
    ("sample", ["max_new_tokens=10000000000"], "max_new_tokens=10000000000 must be <= 1000000"),  # days of sampling
    ("sample", ["top_p=0.0"], "top_p=0.0 must be > 0.0; null means no cut-off"),
    ("sample", ["min_p=2.0"], "min_p=2.0 must be <= 1.0; null means no cut-off"),
    ("sample", ["seed=-5"], "seed=-5 must be >= 0"),
    ("sample", ["seed=99999999999999999999"], "seed=99999999999999999999 must be <= 9223372036854775807"),
    ("sample", ["dtype=fp8"], "dtype=fp8 is unknown; use one of auto, float32, bfloat16, float16"),
    ("sample", ["+temp=0.5"], "temp is not a key of this config; did you mean temperature?"),  # + adds no key
    ("config", ["+train.foo=1"], "train.foo is not a key of this config; see the keys with --cfg job"),
    ("config", ["train.lerning_rate=1"], "train.lerning_rate is not a key of this config; did you mean "
                                         "train.learning_rate?"),
    ("config", ["train.lr=1e-3"], "train.lr is not a key of this config; did you mean train.learning_rate or "
                                  "train.lr_decay_iters?"),  # other tools' abbreviation: a key's initials
    ("config", ["modle.n_layer=2"], "modle is not a key of this config; did you mean model?"),
    ("config", ["model.n_layers=2"], "model.n_layers is not a key of this config; did you mean model.n_layer?"),
    ("config", ["model.vocab_size=100"], "model.vocab_size is not a key of this config; did you mean "
                                         "model.block_size?"),  # the data's, never the user's
    ("config", ["model.KEYS=x"], "model.KEYS is not a key of this config; see the keys with --cfg job"),  # a constant
    ("config", ["train.max_iters=abc"], "train.max_iters=abc is not an integer"),
    ("config", ["model.attn_window=wide"], "model.attn_window=wide is not an integer or null"),
    ("config", ["train.compile=maybe"], "train.compile=maybe is not true or false or null"),
    ("config", ["wandb.tags=x"], "wandb.tags=x is not a list such as [a,b]"),
    ("config", ["seed=null"], "seed=null is not an integer"),
    ("config", ["data.val_fraction=1.5"], "data.val_fraction=1.5 must be < 1.0"),
    ("config", ["train.learning_rate='-1e-3'"], "train.learning_rate=-0.001 must be > 0.0"),  # the number it becomes
    ("config", ["train.learning_rate=nan"], "train.learning_rate=nan must be a finite number"),
    ("config", ["model.n_layer=0"], "model.n_layer=0 must be >= 1"),
    ("config", ["model.n_layer=1000000"], "model.n_layer=1000000 must be <= 1024"),
    ("config", ["model.block_size=1099511627776"], "model.block_size=1099511627776 must be <= 1048576"),
    ("config", ["model.attn_impl=fast"], "model.attn_impl=fast is unknown; use one of flash, math"),
    ("config", ["model.activation=swish"], "model.activation=swish is unknown; use one of gelu, gelu_tanh, relu2"),
    ("config", ["model.pos_emb=alibi"], "model.pos_emb=alibi is unknown; use one of learned, rope"),
    ("config", ["model.norm=batchnorm"], "model.norm=batchnorm is unknown; use one of layernorm, rmsnorm"),
    ("config", ["model.dropout=1.0"], "model.dropout=1.0 must be < 1.0"),
    ("config", ["model.logit_softcap=0.0"], "model.logit_softcap=0.0 must be > 0.0"),
    ("config", ["model.attn_window=0"], "model.attn_window=0 must be >= 1"),
    ("config", ["train.batch_size=0"], "train.batch_size=0 must be >= 1"),
    ("config", ["train.dtype=fp8"], "train.dtype=fp8 is unknown; use one of auto, float32, bfloat16, float16"),
    ("config", ["train.parallel=zero"], "train.parallel=zero is unknown; use one of ddp, fsdp"),
    ("config", ["train.on_nonfinite=ignore"], "train.on_nonfinite=ignore is unknown; use one of stop, skip"),
    ("config", ["train.optimizer=sgd"], "train.optimizer=sgd is unknown; use one of adamw, muon"),
    ("config", ["train.beta2=1.0"], "train.beta2=1.0 must be < 1.0"),
    ("config", ["train.muon_lr=0"], "train.muon_lr=0.0 must be > 0.0"),
    ("config", ["train.muon_momentum=1.0"], "train.muon_momentum=1.0 must be < 1.0"),
    ("config", ["train.muon_momentum_warmup=-1"], "train.muon_momentum_warmup=-1 must be >= 0"),
    ("config", ["train.muon_ns_steps=0"], "train.muon_ns_steps=0 must be >= 1"),
    ("config", ["train.eval_from=-1"], "train.eval_from=-1 must be >= 0"),
    ("config", ["train.lr_schedule=linear"], "train.lr_schedule=linear is unknown; use one of cosine, wsd"),
    ("config", ["train.cooldown_frac=0"], "train.cooldown_frac=0.0 must be > 0.0"),
    ("config", ["train.cooldown_frac=1.5"], "train.cooldown_frac=1.5 must be <= 1.0"),
    ("config", ["wandb.mode=on"], "wandb.mode=on is unknown; use one of online, offline, disabled"),
    ("config", ["train.learning_rate.x=1"], "train.learning_rate is a value, not a group of keys, so "
                                            "train.learning_rate.x is not a key"),
    ("config", ["train={max_iterz:2}"], "train.max_iterz is not a key of this config; did you mean train.max_iters?"),
    ("config", ["train=5"], "train=5: train is a group of keys; set one as train.KEY=VALUE"),
    ("config", ["model.n_embd=30", "model.n_head=4"], "model.n_embd=30 is not divisible by n_head=4; use a multiple "
                                                      "of it"),
    ("config", ["model.pos_emb=rope", "model.n_embd=36", "model.n_head=4"], "model.pos_emb=rope needs an even head "
                                                                            "size; n_embd/n_head is 9"),
    ("config", ["model.attn_window=4", "model.window_pattern=SXL"], "model.window_pattern=SXL may only hold the "
                                                                    "letters S (windowed) and L (full)"),
    ("config", ["model.n_layer=3", "model.attn_window=4", "model.window_pattern=SSSS"], "model.window_pattern=SSSS has "
                                                                                       "more letters than n_layer=3"),
    ("config", ["model.attn_window=4", "model.window_pattern=LL"], "model.window_pattern=LL windows no layer; add an "
                                                                   "S or set attn_window=null"),
]


@pytest.mark.parametrize(("config", "overrides", "message"), RULES)
def test_every_rule_of_a_key_is_one_line_naming_it(config: str, overrides: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert refusal(config, overrides, capsys) == message
    try:  # the typed config holds the same rule, for train() called from Python and a saved config.yaml
        composed = compose_config(["out_dir=RUN", *overrides] if config == "sample" else overrides, config_name=config)
    except ConfigCompositionException:  # an unknown key or a value of another type: Hydra refuses to compose it
        return
    with pytest.raises(ConfigError) as refused:
        typed_config(composed, SCHEMAS[config][0])
    assert str(refused.value) == message


def test_sample_needs_a_run_or_pretrained_weights() -> None:
    with pytest.raises(ConfigError, match="out_dir is required"):
        typed_config(compose_config([], config_name="sample"), SampleConfig)
    assert typed_config(compose_config(["init_from=gpt2"], config_name="sample"), SampleConfig).out_dir is None
    config = typed_config(compose_config(["out_dir=RUN", "top_k=null"], config_name="sample"), SampleConfig)
    assert isinstance(config, SampleConfig) and config.top_k is None


def test_a_run_config_is_typed_all_the_way_down_and_resolved_from_hydra_or_python() -> None:
    """train(TrainRunConfig(...)) works without Hydra: the default out_dir's ${now:} is resolved."""
    config = typed_config(compose_config(["experiment=speedrun_cpu"]), TrainRunConfig)
    assert type(config.model).__name__ == "ModelConfig" and config.model.pos_emb == "rope"
    assert config.train.target_val_loss == 1.89 and "${" not in config.out_dir
    config = typed_config(TrainRunConfig(), TrainRunConfig)
    assert config.out_dir.startswith("outputs/") and "${" not in config.out_dir
    assert config.model.n_layer == 4  # the schema's own defaults: the baby model


def test_a_saved_config_yaml_types_like_the_composed_one(tmp_path: Path) -> None:
    """config.yaml is plain YAML (torchrun's resume test trains from one): it gets the schema on the way in."""
    composed = compose_config(["experiment=speedrun_cpu", "out_dir=run"])
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(composed))
    assert typed_config(OmegaConf.load(path), TrainRunConfig) == typed_config(composed, TrainRunConfig)
    with pytest.raises(ConfigError, match="train.eval_iters=0 must be >= 1"):
        typed_config(OmegaConf.merge(OmegaConf.load(path), {"train": {"eval_iters": 0}}), TrainRunConfig)

"""Config typed and checked once: every bad value is one ConfigError naming the key, the value and what is allowed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from common.config import typed_config
from common.errors import ConfigError
from conftest import compose_config
from sample import SampleConfig
from train import TrainRunConfig


@pytest.mark.parametrize(
    ("override", "schema", "message"),
    [
        ("temperature=-1", SampleConfig, "temperature=-1.0 must be >= 0.0; 0 means greedy decoding (the most likely "
                                         "token)"),
        ("top_p=1.01", SampleConfig, "top_p=1.01 must be <= 1.0; null means no cut-off"),
        ("top_k=0", SampleConfig, "top_k=0 must be >= 1; null means no cut-off"),
        ("num_samples=0", SampleConfig, "num_samples=0 must be >= 1"),
        ("max_new_tokens=0", SampleConfig, "max_new_tokens=0 must be >= 1"),
        ("attn_impl=fast", SampleConfig, "attn_impl=fast is unknown; use one of flash, math"),
        ("dtype=fp8", SampleConfig, "dtype=fp8 is unknown; use one of auto, float32, bfloat16, float16"),
        # a key added with + must exist like any other
        ("+temp=0.5", SampleConfig, "temp is not a key of this config; did you mean temperature?"),
        ("+train.learning_rat=1", TrainRunConfig, "train.learning_rat is not a key of this config; did you mean "
                                                  "train.learning_rate?"),
        ("+model.attn_windw=4", TrainRunConfig, "model.attn_windw is not a key of this config; did you mean "
                                                "model.attn_window?"),
        ("+train.foo=1", TrainRunConfig, "train.foo is not a key of this config; see the keys with --cfg job"),
    ],
)
def test_a_bad_value_or_an_unknown_key_is_one_config_error(override: str, schema: type, message: str) -> None:
    overrides, name = (["out_dir=RUN", override], "sample") if schema is SampleConfig else ([override], "config")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        typed_config(compose_config(overrides, config_name=name), schema)


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

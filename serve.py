"""Serve a trained model through OpenAI's completions API, with continuous batching, and a live page.

    python serve.py out_dir=RUN                  # http://127.0.0.1:8000: the API at /v1, the page at /
    python serve.py out_dir=RUN ckpt=best port=8001
    python serve.py init_from=gpt2 api_key=KEY   # every request needs Authorization: Bearer KEY
    python serve.py out_dir=RUN host=0.0.0.0     # listen beyond this machine (set an api_key)

Any OpenAI client works: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY or anything").completions
.create(model=..., prompt="ROMEO:", max_tokens=100, temperature=0). Greedy text equals sample.py's at
temperature=0, and a request's seed S gives choice i the draws of sample.py's sample i with seed=S.
"""

import sys

import hydra
from omegaconf import DictConfig

from common.cli import check_overrides, exit_on_user_error
from common.config import typed_config
from training.schema import ServeConfig, register_schemas

register_schemas()


@hydra.main(version_base="1.3", config_path="configs", config_name="serve")
def main(dict_cfg: DictConfig) -> None:
    with exit_on_user_error():
        from inference.serve_run import serve  # FastAPI and uvicorn: pip install ".[serve]"

        serve(typed_config(dict_cfg, ServeConfig))


if __name__ == "__main__":
    check_overrides(sys.argv[1:], ServeConfig)
    main()

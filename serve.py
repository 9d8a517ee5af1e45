"""Serve a model through OpenAI's completions API, requests taking turns, and a live page; usage() lists the keys set
most. Greedy text equals sample.py's at temperature=0; seed S gives choice i sample.py's sample i at seed=S."""

from omegaconf import DictConfig

from common.config import run_hydra, typed_config
from inference.sampling import ServeConfig, register_schemas

register_schemas()


def usage() -> str:
    return """Serve a model through OpenAI's completions API, with a live page at /. Settings are key=value.

Keys set most:
  out_dir=RUN             a train.py run directory (or init_from=gpt2 for OpenAI's GPT-2)
  host=ADDR port=N        where to listen (default 127.0.0.1:8000; port=0: any free port)
  api_key=KEY             requests then need Authorization: Bearer KEY (or set $GPT_LAB_API_KEY)
  max_request_tokens=N    the most tokens a request may generate, max_tokens x choices (default 4096)

Examples:
  python serve.py out_dir=runs/cpu
  python serve.py out_dir=runs/cpu ckpt=best port=8001 api_key=secret

Every key: docs/reference.md (python serve.py --cfg job shows them); the API: docs/serving.md. Hydra's own
flags: --hydra-help."""


def main(dict_cfg: DictConfig) -> None:
    from inference.server import serve  # FastAPI and uvicorn: pip install ".[serve]"

    serve(typed_config(dict_cfg, ServeConfig))


if __name__ == "__main__":
    run_hydra(main, "serve", ServeConfig, usage=usage)

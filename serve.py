"""Serve a model through OpenAI's completions API, requests taking turns, and a live page; usage() lists the keys set
most. Greedy text equals sample.py's at temperature=0; seed S gives choice i sample.py's sample i at seed=S."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from common.config import keys_help, option, run_hydra, typed_config
from inference.sampling import ModelChoice


@dataclass
class ServeConfig(ModelChoice):
    """serve.py's keys (configs/serve.yaml): where it listens, the model's device, and the limits of its work."""

    host: str = "127.0.0.1"  # loopback: only this machine; 0.0.0.0 listens on every interface
    port: int = option(8000, at_least=0, at_most=65535)  # 0: any free port (printed when ready)
    api_key: str | None = None  # every request then needs Authorization: Bearer KEY; null: $GPT_LAB_API_KEY, if set
    allow_no_api_key: bool = False  # else a host beyond loopback needs api_key: anyone reaching the port may use it
    model_id: str | None = None  # the id /v1/models lists and requests name; null: the run directory's name
    max_queue: int = option(64, at_least=0)  # requests under way besides one (taking turns); past it: 503, Retry-After
    max_choices: int = option(16, at_least=1)  # prompts x n in one request, generated a prompt's n at a time
    max_request_tokens: int = option(4096, at_least=1)  # max_tokens x choices: the tokens one request generates
    max_prompt_tokens: int = option(8192, at_least=1)  # all the prompts' tokens of one request
    timeout_s: float = option(300.0, above=0.0)  # a request running longer, its wait included, is cancelled: 504
    shutdown_s: float = option(5.0, at_least=0.0)  # on Ctrl-C or SIGTERM, requests in flight get this long; then 503
    max_body_bytes: int = option(1_000_000, at_least=1)  # a larger request body: 413
    max_connections: int = option(1000, at_least=1)  # connections and requests at once (uvicorn's limit_concurrency)
    threads: int | None = option(None, at_least=1)  # torch's CPU threads; null: a core less, left to the HTTP side


ConfigStore.instance().store(name="serve_schema", node=ServeConfig)


def usage() -> str:
    return f"""Serve a model through OpenAI's completions API, with a live page at /. Settings are key=value.

Keys set most, at their defaults:
{keys_help(ServeConfig, ("out_dir", "init_from", "host", "port", "api_key", "max_request_tokens"))}

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

"""serve.py's work: load the model, start the engine, and serve the API on a socket bound before anything else,
so a port in use is one line and the printed URL is the real one (port=0 picks a free port)."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import uvicorn

from common.errors import ConfigError
from common.runtime import make_runtime
from data.corpus import default_num_proc
from inference.connections import Refusals, guarded_protocol, usable_connections
from inference.engine import Engine
from inference.sampling import load_model
from inference.schema import ServeConfig
from inference.server import Service, create_app

GIL_SWITCH_INTERVAL_S = 0.02
SHUTDOWN_MARGIN_S = 1.0  # after shutdown_s: for the requests' error events to go out
LOOPBACK = "this machine only"
API_KEY_ENV = "GPT_LAB_API_KEY"  # the api_key when the config leaves it null, so it needn't be on a command line


def build_service(cfg: ServeConfig) -> Service:
    runtime = make_runtime(cfg.device, cfg.dtype)
    if runtime.device.type == "cpu":  # by default a core less, left to the event loop and the clients
        torch.set_num_threads(cfg.threads or default_num_proc())
    loaded = load_model(cfg.out_dir, cfg.init_from, cfg.ckpt, cfg.attn_impl)
    model = loaded.model.to(runtime.device).eval()
    engine = Engine(model, loaded.tokenizer, runtime, cfg.max_batch)
    model_id = cfg.model_id or (cfg.init_from if cfg.out_dir is None else Path(cfg.out_dir).resolve().name)
    return Service(engine, loaded.tokenizer, model_id, cfg)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY (no Nagle delay for each chunk) only on sockets naming it
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if isinstance(err, socket.gaierror) or err.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"host={host} is not an address of this machine ({err.strerror}); use 127.0.0.1 "
                              "(this machine only) or one of its network addresses") from None
        raise ConfigError(f"can't listen on host={host} port={port} ({err.strerror}); pick another port") from None
    sock.listen(2048)
    return sock


def loopback_names(host: str) -> set[str]:
    """The Host headers a loopback server answers (api.HostCheck)."""
    return {"localhost", "127.0.0.1", "[::1]", host if ":" not in host else f"[{host}]"}


def check_exposure(sock: socket.socket, cfg: ServeConfig, api_key: str | None) -> str:
    """Where the server listens, in words; beyond loopback without an API key only with allow_no_api_key."""
    address = ipaddress.ip_address(sock.getsockname()[0])
    if address.is_loopback:
        return LOOPBACK
    where = "every interface" if address.is_unspecified else f"the network address {address}"
    if api_key is None and not cfg.allow_no_api_key:
        raise ConfigError(f"host={cfg.host} listens on {where} with no API key, so anyone who reaches the port "
                          f"can use the model; set api_key=KEY (or ${API_KEY_ENV}), or allow_no_api_key=true")
    return where


def serve(cfg: ServeConfig) -> None:
    """Until Ctrl-C or SIGTERM, then the requests in flight get shutdown_s to end (Stopping)."""
    api_key = cfg.api_key or os.environ.get(API_KEY_ENV) or None
    service = build_service(cfg)
    sock = bind(cfg.host, cfg.port)
    try:
        where = check_exposure(sock, cfg, api_key)
    except ConfigError:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    device = service.engine.runtime.device
    if device.type == "cpu":
        device = f"cpu ({torch.get_num_threads()} threads)"
    auth = "an API key" if api_key else "no API key"

    def ready() -> None:
        print(f"serving {service.model_id} on {device} at {url} (OpenAI API at {url}/v1, page at {url}/; "
              f"{where}, {auth}; Ctrl-C stops)", file=sys.stderr, flush=True)

    logging.getLogger("serve").setLevel(logging.WARNING)  # its refusals too (Refusals), not only its errors
    torch.set_grad_enabled(False)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # the engine drops the GIL each torch op: let the loop keep it longer
    app = create_app(service, api_key, on_ready=ready, hosts=loopback_names(cfg.host) if where == LOOPBACK else None)
    # uvicorn cancels what still runs SHUTDOWN_MARGIN_S after the requests' own end, which says so to each client
    grace = math.ceil(cfg.shutdown_s + SHUTDOWN_MARGIN_S)
    refusals = Refusals()
    http = guarded_protocol(usable_connections(cfg.max_connections), cfg.header_timeout_s, refusals)
    config = uvicorn.Config(app, log_level=logging.WARNING, timeout_graceful_shutdown=grace, lifespan="on",
                            http=http, ws="none")
    logging.getLogger("uvicorn.error").addFilter(refusals.filter)
    Stopping(config, service, refusals).run(sockets=[sock])


class Stopping(uvicorn.Server):
    """uvicorn's server that on Ctrl-C or SIGTERM gives requests in flight shutdown_s, then ends each with an error."""

    def __init__(self, config: uvicorn.Config, service: Service, refusals: Refusals) -> None:
        super().__init__(config)
        self.service, self.refusals = service, refusals

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.get_running_loop().set_exception_handler(self.refusals.loop_errors)  # one line per kind
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:  # the event loop's thread (a signal handler)
        if self.service.stop_by == math.inf:
            self.service.stop_by = time.monotonic() + self.service.limits.shutdown_s  # asyncio's clock
        super().handle_exit(sig, frame)

"""TEST DOUBLE of SGLang's ``ServerArgs`` and ``prepare_server_args`` (see ../../README.md): the options areal's
recipe passes, plus ``--api-key``."""

import argparse
from dataclasses import dataclass


@dataclass
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    dtype: str = "auto"
    tp_size: int = 1
    mem_fraction_static: float = 0.8
    api_key: str | None = None
    admin_api_key: str | None = None


def prepare_server_args(argv):
    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float, default=0.8)
    parser.add_argument("--api-key", default=None)
    return ServerArgs(**vars(parser.parse_args(argv)))

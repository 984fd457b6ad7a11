"""TEST DOUBLE of SGLang's HTTP server module (see ../../../README.md): a module-level ``app`` that
``launch_server`` fills with the protocol double's routes and serves."""

import importlib.util
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse

app = FastAPI()
DOUBLE = Path(__file__).resolve().parents[4] / "sglang_server_double.py"


def _protocol_double():
    spec = importlib.util.spec_from_file_location("sglang_server_double", DOUBLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_server(server_args):
    import uvicorn

    inner = _protocol_double().build_app(tp=server_args.tp_size, model_path=server_args.model_path,
                                         dtype=server_args.dtype)
    key = server_args.api_key

    @app.middleware("http")
    async def key_check(request, call_next):  # what SGLang does when it is given an api_key
        if not key or request.method == "OPTIONS" or request.url.path.startswith(("/health", "/metrics")):
            return await call_next(request)
        if request.headers.get("Authorization") != f"Bearer {key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    app.mount("/", inner)
    uvicorn.run(app, host=server_args.host, port=server_args.port, log_level="warning")

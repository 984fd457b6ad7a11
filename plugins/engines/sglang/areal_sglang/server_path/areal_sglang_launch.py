"""SGLang's own ``python -m sglang.launch_server``, behind the run's guard, with the run's secret kept off argv.

SGLang takes its key as ``--api-key SECRET``, which every local user can read in ``ps`` or
``/proc/PID/cmdline``. This module runs SGLang's launcher as its ``__main__`` with the same arguments, after
two changes made in this process only:

- the server's parsed arguments get the run's secret (``AREAL_RUN_TOKEN`` from the environment, which only the
  same user can read) as ``api_key`` (and ``admin_api_key`` where the release has one), so SGLang's own check
  asks every route but ``/health`` and ``/metrics`` for ``Authorization: Bearer <secret>``;
- areal's :class:`RunGuard` (the bound host, no request from a web page, bodies capped, the secret, weights
  from disk only from under the run folder) is put in front of SGLang's HTTP app, as it is in front of vLLM's
  (``areal_vllm_guard``).

The SGLang environment holds no areal package: the guard's module (stdlib only) is loaded from its file, named
in ``AREAL_SERVER_GUARD_FILE``; without it (a server started by hand) only SGLang's key check guards the server.
"""

import importlib.util
import logging
import os
import runpy
import sys

TOKEN_ENV = "AREAL_RUN_TOKEN"
log = logging.getLogger("areal.sglang.launch")


def _load_guard():
    path = os.environ.get("AREAL_SERVER_GUARD_FILE")
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("areal_server_guard", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _with_key(prepare, token):
    def prepare_with_key(argv):
        args = prepare(argv)
        if getattr(args, "api_key", None) not in (None, "", token):
            log.warning("the run's secret replaces the --api-key given in rollout.extra_args (areal's clients send "
                        "the run's secret)")
        args.api_key = token
        if hasattr(args, "admin_api_key"):  # releases with admin-only routes: the same secret opens them
            args.admin_api_key = token
        return args

    return prepare_with_key


def _guard_app(guard, token):
    """Put the guard in front of SGLang's module-level FastAPI app, before its launcher starts serving it."""
    from sglang.srt.entrypoints import http_server

    app = getattr(http_server, "app", None)
    if app is None or not hasattr(app, "add_middleware"):
        log.warning("this SGLang release has no module-level HTTP app to guard; only its key check guards it")
        return
    host = os.environ.get("AREAL_SERVER_HOST", "127.0.0.1")
    limit = int(os.environ.get("AREAL_SERVER_MAX_BODY_BYTES", guard.DEFAULT_MAX_BODY_BYTES))
    roots = tuple(filter(None, os.environ.get("AREAL_SERVER_LOAD_ROOTS", "").split(os.pathsep)))

    def check_load(path, body):
        """/update_weights_from_disk only from the run folder (a server started by hand: from anywhere)."""
        folder = body.get("model_path") if isinstance(body, dict) else None
        if not roots or folder is None or guard.may_load(str(folder), roots):
            return None
        return 403, (f"{folder} is not under the run folder ({', '.join(roots)}); this server loads weights only "
                     "from there")

    class RunGuard:  # Starlette builds middleware from the app and keyword arguments
        def __init__(self, inner):
            self.guarded = guard.RunGuard(inner, token=token, bound_host=host, max_body_bytes=limit,
                                          body_checks={"/update_weights_from_disk": check_load})

        async def __call__(self, scope, receive, send):
            await self.guarded(scope, receive, send)

    app.add_middleware(RunGuard)


def main() -> None:
    token = os.environ.get(TOKEN_ENV) or None
    if token is None:
        log.warning("no %s in the environment: any local process may drive this server", TOKEN_ENV)
    else:
        from sglang.srt import server_args

        server_args.prepare_server_args = _with_key(server_args.prepare_server_args, token)
    guard = _load_guard()
    if guard is not None:
        _guard_app(guard, token)
    # SGLang's launcher imports prepare_server_args when it runs, so it takes the function set above; its
    # arguments are this process's (run_module puts the module's own path before them)
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

"""The run's guard in front of a vLLM server (``--middleware areal_vllm_guard.RunGuard``).

vLLM's own key (``VLLM_API_KEY``) guards its ``/v1`` routes only; its ``/pause``, ``/resume`` and
``/collective_rpc`` routes, which weight updates use, stay open. This middleware puts areal's
:class:`areal_core.server_guard.RunGuard` in front of every route: the run's secret, the bound host, no request
from a web page, bodies capped; and weight reloads (``/collective_rpc`` with ``reload_weights``) only from the
run folder and the trainer's own buckets in ``/dev/shm``, as on the embedded server. vLLM builds a middleware
class from the app alone (``app.add_middleware(cls)``), so the settings come from the environment the plugin's
recipe gives the server. The vLLM environment holds no areal package: the guard's module (stdlib only) is loaded
from its file, named in ``AREAL_SERVER_GUARD_FILE``.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("areal_server_guard", os.environ["AREAL_SERVER_GUARD_FILE"])
_guard = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_guard)


# Where a weight load may come from: the run folder (AREAL_SERVER_LOAD_ROOTS, the recipe's) and the trainer's
# buckets in /dev/shm (areal_vllm.engine writes them under this prefix); a server started by hand without the
# variable loads from anywhere, as vLLM does.
LOAD_ROOTS = tuple(filter(None, os.environ.get("AREAL_SERVER_LOAD_ROOTS", "").split(os.pathsep)))
STAGE_ROOT, STAGE_PREFIXES = "/dev/shm", ("areal-vllm-weights-",)


def _weights_path(body):
    """The folder a /collective_rpc call asks vLLM's workers to reload weights from, if it is such a call."""
    if not isinstance(body, dict) or body.get("method") != "reload_weights":
        return None
    kwargs, args = body.get("kwargs") or {}, body.get("args") or []
    if isinstance(kwargs, dict) and kwargs.get("weights_path") is not None:
        return str(kwargs["weights_path"])
    # reload_weights(weights_iterator=None, weights_path=None, ...): the path is the second positional argument
    return str(args[1]) if isinstance(args, list) and len(args) > 1 and args[1] is not None else None


def check_rpc(path, body):
    folder = _weights_path(body)
    if folder is None or not LOAD_ROOTS:
        return None
    if _guard.may_load(folder, LOAD_ROOTS, STAGE_ROOT, STAGE_PREFIXES):
        return None
    return 403, (f"{folder} is neither under the run folder ({', '.join(LOAD_ROOTS)}) nor a weight bucket of this "
                 f"user's trainer in {STAGE_ROOT}; this server loads weights only from there")


class RunGuard:
    def __init__(self, app):
        self.guarded = _guard.RunGuard(app, token=_guard.run_token(),
                                       bound_host=os.environ.get("AREAL_SERVER_HOST", "127.0.0.1"),
                                       max_body_bytes=int(os.environ.get("AREAL_SERVER_MAX_BODY_BYTES",
                                                                         _guard.DEFAULT_MAX_BODY_BYTES)),
                                       body_checks={"/collective_rpc": check_rpc})

    async def __call__(self, scope, receive, send):
        await self.guarded(scope, receive, send)

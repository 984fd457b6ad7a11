"""What every remote HTTP inference engine shares, whatever server it talks to.

Two halves, both engine-neutral:

- :class:`ServerFleet` starts servers (``N`` from a recipe, each on a free
  port of 127.0.0.1 with its log kept under a folder) through the launcher's
  :class:`~areal_core.processes.supervisor.Supervisor`, waits for each with a
  timeout that quotes its last log lines, and stops them all; or it only
  records servers given by address (attach). Tests, benchmarks and elastic
  runs use it to bring servers up and down while a run is live.
- :class:`RemoteEngine` is the client side of one server: an ``httpx`` client
  with per-request timeouts and retries on connection errors, readiness with a
  timeout, health, the policy version, and errors that name the server and its
  last log lines. A backend (vLLM, SGLang) subclasses it and adds only its
  endpoints: how to generate, pause, resume and load weights.
- Tensor weight updates of any backend: :func:`layer_buckets` cuts the
  weights into size-bounded buckets of whole layers, :func:`send_pipelined`
  prepares bucket k+1 while bucket k is being sent.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Iterator, TypeVar

from areal_core.api.inference import InferenceEngine, ServerProcess, ServerTimeout
from areal_core.processes.supervisor import Managed, ProcessSpec, Supervisor, free_port
from areal_core.problems import Problem

Recipe = Callable[[int, int], ServerProcess]  # (index, port) -> how to start that server
T = TypeVar("T")
# Idle pooled connections are dropped after this many seconds, well before the servers we drive close them:
# vLLM's and SGLang's uvicorn close idle connections after 5 s, httpx's own default. With equal timeouts a
# request could go out on a connection the server was closing, and fail with ReadError although the server
# was healthy (a known httpx / uvicorn keep-alive race); a generate request is not retried, so the run failed.
KEEPALIVE_EXPIRY_S = 2.0
U = TypeVar("U")


def log_tail(path: str | Path | None, lines: int = 15) -> str:
    """The last ``lines`` lines of a server log, formatted for an error message ("" when unreadable)."""
    if not path:
        return ""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return f"\nlast lines of its log: {path}\n  " + "\n  ".join(text[-lines:]) if text else ""


def run_log_path(config: Any, index: int) -> Path | None:
    """Where the launcher keeps the log of rollout server ``index`` of a run (None when the config has no run)."""
    try:
        return Path(config.output_dir).expanduser() / config.experiment / config.trial / "logs" / f"rollout-{index}.log"
    except (AttributeError, TypeError):
        return None


def http_ready(port: int, path: str = "/health", host: str = "127.0.0.1") -> Callable[[], bool]:
    """A readiness check for :class:`ServerProcess`: True once ``GET path`` answers 200."""
    import httpx

    def ready() -> bool:
        try:
            return httpx.get(f"http://{host}:{port}{path}", timeout=2).status_code == 200
        except httpx.TransportError:  # not listening yet
            return False

    return ready


def version_supported(found: str, supported: str) -> bool:
    """Whether release ``found`` (a local label such as ``+cpu`` ignored) is in ``supported`` (PEP 440)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(found.split("+")[0]) in SpecifierSet(supported)
    except InvalidVersion:
        return False


def check_server_version(what: str, found: str, supported: str, fix: str) -> None:
    """Raise naming ``what``, the version ``found`` and the ``supported`` range (a PEP 440 specifier) when outside."""
    if not version_supported(found, supported):
        raise RuntimeError(f"the {what} reports version {found!r}; this plugin supports {supported}. Fix: {fix}")


@dataclass
class Server:
    """One server of a fleet: its address, and when the fleet started it, its process and log."""

    name: str
    address: str  # "127.0.0.1:8001"
    managed: Managed | None = None  # None: attached by address, not started here
    log_path: Path | None = None
    process: ServerProcess | None = None  # the recipe it was started from

    @property
    def alive(self) -> bool:
        return self.managed is None or self.managed.poll() is None


@dataclass
class ServerFleet:
    """Servers of one engine: launched here (``launch``) or attached by address (``attach``).

    Use as a context manager (or call :meth:`stop`): every server it started is
    stopped, its whole process group, when the block ends.
    """

    log_dir: Path
    servers: list[Server] = field(default_factory=list)
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self.log_dir = Path(self.log_dir)
        self._supervisor = Supervisor(self.log_dir)

    def launch(self, recipe: Recipe, count: int = 1, *, prefix: str = "server",
               threads: int | None = None, wait: bool = True) -> list[Server]:
        """Start ``count`` servers from ``recipe(index, port)`` on free ports; wait for each unless ``wait=False``."""
        if count < 1:
            raise ValueError(f"ServerFleet.launch: count must be >= 1, got {count}")
        started = []
        for _ in range(count):
            index = len(self.servers)
            port = free_port(self.host)
            process = recipe(index, port)
            name = f"{prefix}-{index}"
            managed = self._supervisor.start(ProcessSpec(name, process.argv, env=process.env, threads=threads))
            server = Server(name, f"{self.host}:{port}", managed, managed.log_path, process)
            self.servers.append(server)
            started.append(server)
        if wait:
            for server in started:
                self.wait_ready(server)
        return started

    def wait_ready(self, server: Server) -> None:
        """Wait for ``server`` to answer its readiness check; raises naming it and quoting its log."""
        if server.managed is None or server.process is None:
            raise ValueError(f"{server.name} at {server.address} was attached, not started here; its engine's "
                             "start() waits for it")
        process = server.process
        self._supervisor.wait_ready(server.managed, process.ready, process.startup_timeout_s, process.what)

    def attach(self, address: str, name: str | None = None) -> Server:
        """Record a server started elsewhere (``host:port``); it is never stopped by this fleet."""
        if not _is_address(address):
            raise ValueError(f"server address {address!r} is not host:port; give it as e.g. '127.0.0.1:8001'")
        server = Server(name or f"attached-{len(self.servers)}", address)
        self.servers.append(server)
        return server

    def kill(self, server: Server, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to a server this fleet started (its whole process group): how tests make one fail."""
        if server.managed is None:
            raise ValueError(f"{server.name} at {server.address} was attached, not started here; stop it where "
                             "it was started")
        try:
            os.killpg(server.managed.pid, sig)
        except ProcessLookupError:
            return
        server.managed.exited.wait(30)

    def stop(self) -> None:
        """Stop every server this fleet started; idempotent."""
        self._supervisor.stop_all()

    def __enter__(self) -> ServerFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def attach_addresses(options: Any) -> list[str]:
    """The running servers a run attaches to instead of starting them (``rollout.addresses``; [] = start them)."""
    return [str(a) for a in (getattr(options, "addresses", None) or [])]


def addresses_problem(backend: str, servers: int, addresses: Any) -> Problem | None:
    """The problem with ``rollout.addresses`` when it is given but does not name ``servers`` host:port pairs
    (one per ``d`` of the allocation), else None."""
    if not addresses:
        return None
    given = list(addresses) if isinstance(addresses, (list, tuple)) else [addresses]
    malformed = [a for a in given if not _is_address(str(a))]
    if malformed:
        return Problem(f"{backend}.addresses", f"{', '.join(map(repr, malformed))}: not host:port",
                       "give each running server as e.g. '127.0.0.1:8001'", key="rollout.addresses")
    if len(given) != servers:
        return Problem(f"{backend}.addresses", f"{len(given)} server(s) given, but the allocation places {servers} "
                       f"({backend}:d{servers})",
                       f"give {servers} address(es), or set d{len(given)} in the allocation",
                       key="rollout.addresses")
    return None


def rollout_addresses_problem(backend: str, config: Any, comp: Any) -> Problem | None:
    """:func:`addresses_problem` for the ``rollout.addresses`` of a run config (kept in ``config.rollout.extra``)
    and one allocated component of ``backend`` (its ``d`` servers)."""
    extra = getattr(getattr(config, "rollout", None), "extra", None) or {}
    return addresses_problem(backend, comp.parallel.d, extra.get("addresses"))


# Run by a server's interpreter: the version of the distribution providing a top-level module, without importing
# it (a vLLM import takes seconds); null when the module is not there, "" when no distribution claims it.
_VERSION_SCRIPT = """
import importlib.metadata as m, importlib.util, json, sys
name = sys.argv[1]
found = None
if importlib.util.find_spec(name) is not None:
    found = ""
    for dist in m.packages_distributions().get(name) or [name]:
        try:
            found = m.version(dist)
            break
        except m.PackageNotFoundError:
            pass
print(json.dumps(found))
"""


@functools.lru_cache(maxsize=32)
def _installed_version(python: str, module: str, mtime: float, timeout_s: float) -> str | None:
    """What ``python`` has of ``module`` (cached per interpreter file and its mtime: a planner validates the
    same config many times). Raises OSError / subprocess.TimeoutExpired / ValueError when it cannot tell."""
    import json

    done = subprocess.run([python, "-c", _VERSION_SCRIPT, module], capture_output=True, text=True,
                          timeout=timeout_s, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise ValueError(f"it exited {done.returncode}" + (f": {said[-1]}" if said else ""))
    return json.loads(done.stdout.strip().splitlines()[-1])


def server_python_problem(backend: str, config: Any, python: str, module: str, supported: str, fix: str,
                          timeout_s: float = 60.0) -> Problem | None:
    """The problem with the interpreter a run would start its ``backend`` servers with, judged before anything
    starts: missing, without ``module``, or with a release outside ``supported`` (a PEP 440 specifier), each of
    which the run would otherwise meet after it started the servers (a server that dies on import, or the
    engine's version check once the model is loaded). Judged only for a run whose allocation places ``backend``
    and whose servers start on this machine: the local launcher, and no ``rollout.addresses`` to attach to. For
    a plugin's ``areal_validate_config`` hook (not its plan rules, which judge a placement wherever it runs)."""
    from areal_core.config.allocation import AllocationParseError, parse_allocation

    try:
        placed = parse_allocation(str(getattr(config, "allocation", ""))).find(backend=backend)
    except AllocationParseError:
        return None  # the core reports the allocation itself
    launcher = getattr(getattr(config, "launcher", None), "name", "local")
    extra = getattr(getattr(config, "rollout", None), "extra", None) or {}
    if not placed or launcher != "local" or extra.get("addresses"):
        return None  # not this run's, another machine's interpreter, or servers already running
    key = "rollout.python"
    try:
        mtime = Path(python).stat().st_mtime
    except OSError:
        return Problem(f"{backend}.python", f"the interpreter for the {backend} servers, {python!r}, does not exist.",
                       fix, key=key)
    try:
        found = _installed_version(python, module, mtime, timeout_s)
    except subprocess.TimeoutExpired:
        return Problem(f"{backend}.python", f"{python} did not say which {module} it has within {timeout_s:g} s.",
                       fix, key=key)
    except (OSError, ValueError) as exc:
        return Problem(f"{backend}.python", f"could not ask {python} which {module} it has: {exc}.", fix, key=key)
    if found is None:
        return Problem(f"{backend}.python", f"{python}, which would run the {backend} servers, has no {module} "
                       "package.", fix, key=key)
    if version_supported(found, supported):
        return None
    return Problem(f"{backend}.python", f"{python} has {module} {found or '(of unknown version)'}; the {backend} "
                   f"plugin supports {supported}.", fix, key=key)


def _is_address(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit()


def _error_text(response: Any) -> str:
    """What a server said was wrong: FastAPI's ``detail`` or OpenAI's ``error.message`` when the body has one,
    else the body itself (cut at 800 characters)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        error = body.get("error")
        for said in (body.get("detail"), error.get("message") if isinstance(error, dict) else error,
                     body.get("message")):
            if isinstance(said, str) and said:
                return said[:800]
    return response.text[:800]


class NonFiniteLogprobs(RuntimeError):
    """A server answered a generation with a logprob that is null, NaN or +inf: the weights it holds compute no
    probability, and a sample carrying one must never reach training."""


def finite_logprobs(who: str, rid: str, token_ids: list[int], logprobs: list[Any], version: int) -> list[float]:
    """``logprobs`` as floats, or :class:`NonFiniteLogprobs` naming ``who`` (the server), the request, the first
    bad token and the weight version it holds. -inf (a token the model calls impossible, drawn anyway at
    temperature 0 ties) is kept: it is a probability."""
    import math

    out = []
    for i, value in enumerate(logprobs):
        number = None if value is None or isinstance(value, bool) else float(value)
        if number is None or math.isnan(number) or number == math.inf:
            token = token_ids[i] if i < len(token_ids) else "?"
            raise NonFiniteLogprobs(
                f"the {who} gave logprob {value!r} for token {i} (id {token}) of request {rid}: the weights it "
                f"serves (version {version}) compute no probability (NaN or inf in them, e.g. a training step that "
                "diverged). No sample of theirs is trained on; resume from the last checkpoint, with a lower "
                "learning rate or tighter gradient clipping")
        out.append(number)
    return out


class RemoteError(RuntimeError):
    """A server answered with an error status; the message names the server, the path and its log."""


STALL_CHECK_TIMEOUT_S = 5.0  # how long a stall check waits for the health endpoint


class RemoteEngine(InferenceEngine):
    """Client of one HTTP inference server; subclasses add the backend's endpoints.

    Subclasses set ``backend`` (a display name: "vLLM server") and
    ``health_path``, and implement :meth:`agenerate` (and what their
    capabilities promise) with :meth:`request`. The policy version is kept
    here: set by the weight updates, stamped on every token.
    """

    backend: str = "inference server"
    health_path: str = "/health"

    def __init__(self, context: Any, address: str, *, request_timeout_s: float = 600.0, retries: int = 2,
                 retry_delay_s: float = 0.5, startup_timeout_s: float = 300.0, log_path: str | Path | None = None,
                 version: int = 0, transport: Any = None) -> None:
        super().__init__(context)
        if not address or ":" not in address:
            raise ValueError(f"{type(self).__name__} needs its server's address as host:port, got {address!r}")
        self.address = address
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.retry_delay_s = retry_delay_s
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self._version = version
        self._transport = transport  # an httpx transport; tests pass a double of the server's protocol
        self._client: Any = None
        rollout = getattr(getattr(context, "config", None), "rollout", None)
        self.stall_warning_s = float(getattr(rollout, "stall_warning_s", 60.0))
        self._stalled_since: float | None = None  # set when a stall was reported, until the server answers again

    @classmethod
    def from_context(cls, context: Any, options: Any, **kwargs: Any) -> Any:
        """The engine for the server the launcher started (``context.extras["address"]``), with the
        request timeout of ``rollout``, retries and startup timeout of ``options``, the server's log."""
        index = context.extras.get("server_index", 0)
        address = context.extras.get("address")
        attached = attach_addresses(options)
        if not address and index < len(attached):
            address = attached[index]  # rollout.addresses: a server started elsewhere, not by the launcher
        if not address:
            raise ValueError(f"the {cls.backend} engine needs its server's address (context.extras['address']); "
                             "the launcher sets it after starting the server from server_process(), or give "
                             "running servers as rollout.addresses")
        rollout = getattr(context.config, "rollout", None)
        return cls(context, address, request_timeout_s=getattr(rollout, "request_timeout_s", 600.0),
                   retries=options.retries, startup_timeout_s=options.startup_timeout_s,
                   log_path=context.extras.get("log_path") or run_log_path(context.config, index), **kwargs)

    # -------------------------------------------------------------- plumbing
    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = version

    def describe(self) -> str:
        return f"{self.backend} at {self.address}"

    def _http(self) -> Any:
        import httpx

        if self._client is None:
            from areal_core.server_guard import auth_headers

            # The run's secret (areal_core.server_guard) on every call: servers the run started refuse calls
            # without it; one started without a secret ignores the header.
            self._client = httpx.AsyncClient(base_url=f"http://{self.address}", timeout=self.request_timeout_s,
                                             headers=auth_headers(),
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                                 keepalive_expiry=KEEPALIVE_EXPIRY_S),
                                             transport=self._transport)
        return self._client

    async def request(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                      timeout: float | None = None, retries: int | None = None) -> Any:
        """One HTTP call; the JSON answer (or text when not JSON).

        Connection errors are retried ``retries`` times (default ``self.retries``)
        ``retry_delay_s`` apart, then raised as ConnectionError naming the server;
        a timeout raises TimeoutError naming the wait; an error status raises
        RemoteError (ValueError for 400 and 422: the request itself was refused).
        Requests that must not run twice pass ``retries=0``.
        """
        import httpx

        timeout = self.request_timeout_s if timeout is None else timeout
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            watch = self._watch_for_a_stall(method, path, timeout)
            try:
                response = await self._http().request(method, path, json=json, params=params, timeout=timeout)
                break
            except httpx.TimeoutException:
                key = " (rollout.request_timeout_s)" if timeout == self.request_timeout_s else ""
                raise ServerTimeout(f"waited {timeout:.0f} s{key} for the {self.describe()} to answer {method} "
                                    f"{path}; it did not (stopped, swapping, stuck in a kernel, or overloaded). "
                                    f"Fix: see its log; if a call can legitimately take longer, raise "
                                    f"rollout.request_timeout_s{log_tail(self.log_path)}") from None
            except httpx.TransportError as exc:
                if attempt + 1 < attempts:
                    await asyncio.sleep(self.retry_delay_s)
                    continue
                raise ConnectionError(f"the {self.describe()} is unreachable during {method} {path} after "
                                      f"{attempts} attempt(s) ({type(exc).__name__}: {exc}); it has probably "
                                      f"stopped{log_tail(self.log_path)}") from None
            finally:
                if watch is not None:
                    watch.cancel()
        self._answered_again()
        if response.status_code in (400, 422):
            raise ValueError(f"the {self.describe()} refused {method} {path}: {_error_text(response)}")
        if response.status_code >= 300:
            raise RemoteError(f"the {self.describe()} answered {method} {path} with HTTP {response.status_code}: "
                              f"{response.text[:800]}{log_tail(self.log_path)}")
        try:
            return response.json()
        except ValueError:
            return response.text

    def _watch_for_a_stall(self, method: str, path: str, timeout: float) -> Any:
        """A timer that checks the server once a call has gone ``stall_warning_s`` (``rollout.stall_warning_s``)
        unanswered; None when the call's own timeout comes first."""
        if not 0 < self.stall_warning_s < timeout:
            return None
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        return loop.call_later(self.stall_warning_s,
                               lambda: loop.create_task(self._check_stall(method, path, began, timeout)))

    async def _check_stall(self, method: str, path: str, began: float, timeout: float) -> None:
        """Log once (until the server answers again) that it stalled: a call unanswered for ``stall_warning_s``
        while its health endpoint does not answer either. A long call on a server that answers its health is
        work, not a stall, and is not reported."""
        if self._stalled_since is not None or await self.health(timeout_s=STALL_CHECK_TIMEOUT_S):
            return
        if self._stalled_since is not None:
            return
        self._stalled_since = began
        waited = time.monotonic() - began
        print(f"areal: the {self.describe()} has not answered {method} {path} for {waited:.0f} s, nor its "
              f"{self.health_path} endpoint for {STALL_CHECK_TIMEOUT_S:.0f} s: it looks stalled (stopped, swapping, "
              f"or stuck in a kernel). The call is still waited for, up to rollout.request_timeout_s = "
              f"{timeout:.0f} s; its log: {self.log_path or 'unknown'}", flush=True)

    def _answered_again(self) -> None:
        if self._stalled_since is None:
            return
        print(f"areal: the {self.describe()} answers again, {time.monotonic() - self._stalled_since:.0f} s after "
              f"the call it had stalled on was sent", flush=True)
        self._stalled_since = None

    # -------------------------------------------------------------- lifecycle
    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Poll the health endpoint until it answers 200; TimeoutError names the server and quotes its log."""
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"waited {timeout_s:.0f} s for the {self.health_path} endpoint of the "
                                   f"{self.describe()} to answer 200{log_tail(self.log_path)}")
            await asyncio.sleep(0.5)

    async def start(self) -> None:
        await self.wait_ready()

    async def health(self, timeout_s: float = 5.0) -> bool:
        import httpx

        try:
            response = await self._http().get(self.health_path, timeout=timeout_s)
        except (httpx.TransportError, httpx.TimeoutException):
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


# ------------------------------------------------------------------ tensor weight updates
def layer_of(name: str) -> str:
    """The unit a bucket keeps whole: ``model.layers.<n>`` for a decoder layer's tensors, else the tensor."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("layers", "h", "blocks") and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2])
    return name


def layer_buckets(named_tensors: Iterable[tuple[str, Any]], limit_bytes: int) -> Iterator[dict[str, Any]]:
    """Group (name, tensor) pairs into buckets of about ``limit_bytes``, cutting only between layers.

    A layer bigger than the limit is a bucket of its own. Whole layers, because
    a server may load a fused module (q/k/v, gate/up) correctly only from all
    its tensors at once. The tensors of one layer must arrive together (as a
    state dict lists them); a tensor of a layer already sent raises ValueError.
    Tensors are detached, not copied or moved: the sender decides where they go.
    """
    bucket: dict[str, Any] = {}
    size, unit, done = 0, None, set()
    for name, tensor in named_tensors:
        layer = layer_of(name)
        if layer in done:
            raise ValueError(f"update_weights_from_tensors: tensor {name!r} arrived after the rest of {layer!r} was "
                             "sent; give each layer's tensors together (in state-dict order)")
        if layer != unit and unit is not None and size >= limit_bytes:
            done.update(layer_of(n) for n in bucket)
            yield bucket
            bucket, size = {}, 0
        unit = layer
        bucket[name] = tensor.detach()
        size += tensor.numel() * tensor.element_size()
    if bucket:
        yield bucket


async def send_pipelined(items: Iterable[T], prepare: Callable[[T], Awaitable[U]],
                         send: Callable[[U], Awaitable[None]]) -> int:
    """``send(await prepare(item))`` for every item in order, preparing item k+1 while item k is sent.

    At most one item is being sent and one prepared at a time, so memory holds
    two buckets, never the whole model. The first failure is raised; a send
    still running then is cancelled. Returns how many items were sent.
    """
    sending: asyncio.Future | None = None
    sent = 0
    try:
        for item in items:
            ready = await prepare(item)
            if sending is not None:
                await sending  # item k, sent while item k+1 was prepared
                sent += 1
            sending = asyncio.ensure_future(send(ready))
        if sending is not None:
            await sending
            sent += 1
    finally:
        if sending is not None and not sending.done():
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
    return sent

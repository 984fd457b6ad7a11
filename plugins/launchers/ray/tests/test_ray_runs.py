"""Real runs on a two-node Ray cluster made on this machine (``tests/cluster.py``): every node a separate raylet
with its own resources, inside a network namespace that has only loopback, so every listener is on 127.0.0.1.

Each node has one CPU, and each process of a run asks for one (``launcher.server_cpus`` / ``rank_cpus``), so Ray
must put the inference server and the train rank on different nodes: the weights take the cross-node path.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from areal_core.testing.processes import launched_pids, process_name, processes_mentioning, read_jsonl

sys.path.insert(0, str(Path(__file__).parent))
import cluster  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cluster.netns_available(),
                                 reason="needs unprivileged user + network namespaces (unshare -rn)")]

AREAL = str(Path(sys.executable).with_name("areal"))
PLACED = re.compile(r"^(rollout-\d+|actor-rank\d+) (?:is up on \S+, |started on )node (\S+)", re.M)  # the launcher's lines


def _has(group: str, name: str) -> bool:
    return any(ep.name == name for ep in metadata.entry_points(group=group))


needs_local_engine = pytest.mark.skipif(not _has("areal.engines.inference", "local"),
                                        reason="needs the embedded inference engine (areal-plugin-local)")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from areal_core.testing import tiny_model

    return tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture
def doubles(tmp_path):
    from areal_core.testing.rl_doubles import installed

    with installed(tmp_path) as (config, env):
        yield config, env


class ClusterRun:
    """`areal run` against a fresh two-node cluster, in the background."""

    def __init__(self, tmp_path: Path, config: Path, env: dict, trial: str, overrides: list[str],
                 nodes: list[dict] | None = None) -> None:
        self.run_dir = tmp_path / "runs" / "areal" / trial
        self.listeners = tmp_path / f"listeners-{trial}.json"
        self.argv = [AREAL, "run", str(config), f"output_dir={tmp_path / 'runs'}", f"trial={trial}",
                     "launcher.name=ray", *overrides]
        self.nodes = nodes or [{"num_cpus": 1}, {"num_cpus": 1}]
        self.proc = subprocess.Popen(cluster.command(self.nodes, self.listeners, self.argv), env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_for_steps(self, n: int, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while len(read_jsonl(self.run_dir / "samples.jsonl")) < n:
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {n} steps"
            time.sleep(0.1)

    def output(self, timeout_s: float = 400) -> str:
        out, _ = self.proc.communicate(timeout=timeout_s)
        return "\n".join(line for line in out.splitlines() if "network_util.cc" not in line)

    def nothing_left(self, timeout_s: float = 30) -> None:
        """No process of the run on any node (all nodes are on this machine), the cluster's included."""
        deadline = time.monotonic() + timeout_s
        while (left := processes_mentioning(str(self.run_dir))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, [Path(f"/proc/{p}/cmdline").read_bytes() for p in left if Path(f"/proc/{p}").exists()]

    def only_loopback(self) -> None:
        listening = json.loads(self.listeners.read_text())
        assert listening["all"] and not listening["not_loopback"], listening


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _actor_of(module: str, name: str, *markers: str) -> int:
    """The pid of the Ray actor (worker process) that runs the process named ``name``: the server's parent is
    the supervisor's trampoline, whose parent is the actor."""
    pid = next(p for p in launched_pids(module, *markers) if process_name(p) == name)
    return _parent(_parent(pid))


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                children.setdefault(_parent(int(proc.name)), []).append(int(proc.name))
            except (OSError, IndexError):
                continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _outsider_calls(server_pid: int, calls: list[tuple[str, str]]) -> subprocess.Popen:
    """Start a local process that is not the run's calling the server ``server_pid`` from inside the cluster's
    network namespace (where the server listens on 127.0.0.1), each (method, path) once; it prints the statuses
    as a JSON list. Started in the background, so the test's timing does not move."""
    argv = Path(f"/proc/{server_pid}/cmdline").read_bytes().decode().split("\0")
    port = argv[argv.index("--port") + 1]
    code = (f"import httpx; print([httpx.request(m, 'http://127.0.0.1:{port}' + p, timeout=30).status_code "
            f"for m, p in {calls!r}])")
    env = {k: v for k, v in os.environ.items() if k != "AREAL_RUN_TOKEN"}
    return subprocess.Popen(["nsenter", "-t", str(server_pid), "-n", sys.executable, "-c", code], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _steps(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "samples.jsonl")


@needs_local_engine
@pytest.mark.skipif(not _has("areal.engines.train", "fsdp"), reason="needs the fsdp train engine (areal-plugin-fsdp)")
def test_a_run_on_two_nodes_trains_the_same_items_as_the_local_launcher(tmp_path, doubles, model):
    """The embedded engine on one node and the fsdp trainer on the other: same steps and item ids per step as the
    `local` launcher with the same seed (eta 0: batch k is the k-th block), finite metrics and a real gradient,
    the weights over the cross-node path (a file in the shared run folder, not /dev/shm), every listener on
    127.0.0.1."""
    config, env = doubles
    overrides = ["rollout.backend=local", f"model.path={model}", "model.dtype=float32", "trainer.total_steps=4",
                 "rollout.max_head_offpolicyness=0", "rollout.weight_sync=tensors", "actor.backend=fsdp",
                 "algorithm.name=rl_pg_double", "actor.optimizer.lr=1e-3", "allocation=local:d1@cpu+fsdp:cpu"]
    local = subprocess.run([AREAL, "run", str(config), f"output_dir={tmp_path / 'runs'}", "trial=local",
                            *overrides], env=env, capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr
    run = ClusterRun(tmp_path, config, env, "ray", overrides)
    out = run.output()
    assert run.proc.returncode == 0, out
    ours, theirs = _steps(run.run_dir), _steps(tmp_path / "runs" / "areal" / "local")
    assert [r["step"] for r in ours] == [1, 2, 3, 4]
    assert [r["items"] for r in ours] == [r["items"] for r in theirs]
    metrics = read_jsonl(run.run_dir / "metrics.jsonl")
    assert len(metrics) == 4 and all(math.isfinite(v) for row in metrics for v in row.values()
                                     if isinstance(v, float))
    assert any(row["train/grad_norm"] > 0 for row in metrics)  # a group with equal rewards has no gradient
    assert all(row["weight_sync/servers_shared_storage_file"] == 1.0 for row in metrics), metrics[-1]
    placed = dict(PLACED.findall(out))
    assert placed["rollout-0"] != placed["actor-rank0"], out  # on two nodes
    # The cluster was started with Ray's defaults: its workers run niced past this test's own niceness (15 more,
    # at most 19), and the launcher says so. Compared to the test's own, so the suite may itself run under `nice`.
    # (At nice 19 already, Ray cannot nice them further and there is nothing to report.)
    own = os.getpriority(os.PRIO_PROCESS, 0)
    said = re.search(r"run at nice (\d+) \(Ray's worker niceness; `areal run` itself runs at nice (\d+)\)", out)
    assert (said and int(said[1]) > int(said[2]) == own) if own < 19 else not said, out
    trainer_log = (run.run_dir / "logs" / "actor-rank0.log").read_text()
    assert "shared_storage_file" in trainer_log
    run.only_loopback()
    run.nothing_left()


def _elastic_overrides(model: Path, steps: int, elastic: bool) -> list[str]:
    return ["rollout.backend=local", f"model.path={model}", "model.dtype=float32", f"trainer.total_steps={steps}",
            "rollout.max_head_offpolicyness=1", "actor.step_s=0.3", "rollout.batch_size=2",
            "allocation=local:d2@cpu+rl_train_double:cpu", "rollout.request_timeout_s=30",
            *([f"rollout.elastic.enabled=true", "rollout.elastic.interval_s=1", "rollout.elastic.failure_threshold=2",
               "rollout.elastic.cooldown_s=1"] if elastic else [])]


@needs_local_engine
def test_a_killed_server_actor_is_restarted_by_ray_and_the_run_finishes(tmp_path, doubles, model):
    config, env = doubles
    run = ClusterRun(tmp_path, config, env, "elastic", _elastic_overrides(model, 50, True),
                     nodes=[{"num_cpus": 2}, {"num_cpus": 1}])
    run.wait_for_steps(3)
    # the servers Ray placed obey only their run: the secret travelled to them in the actors' environment
    server = next(p for p in launched_pids("areal_local.server", str(model)) if process_name(p) == "rollout-0")
    # joining the cluster's network namespace (nsenter) needs root here; elsewhere that check is left out
    outsider = _outsider_calls(server, [("POST", "/pause"), ("POST", "/update_weights_from_disk"),
                                        ("GET", "/health")]) if os.geteuid() == 0 else None
    os.kill(_actor_of("areal_local.server", "rollout-1", str(model)), signal.SIGKILL)
    out = run.output()
    if outsider is not None:
        said, errors = outsider.communicate(timeout=120)
        assert outsider.returncode == 0 and json.loads(said) == [401, 401, 200], errors
    assert run.proc.returncode == 0, out
    assert "rollout-1 (inference server 1)" in out and "Ray restarts it" in out, out
    assert re.search(r"rollout-1 is back on \S+, node ", out), out
    events = [(e["event"], e["server"]) for e in read_jsonl(run.run_dir / "events.jsonl")]
    assert [e for e, _ in events] == ["left", "joined"], events  # dropped, then the restart joined routing
    steps = _steps(run.run_dir)
    assert [r["step"] for r in steps] == list(range(1, 51)), out
    items = [i for r in steps for i in r["items"]]
    assert len(items) == len(set(items)), "an item was trained twice"
    versions = [r["version"] for r in steps]
    assert versions == sorted(versions)
    run.nothing_left()


@needs_local_engine
def test_a_killed_server_actor_without_elastic_stops_the_run_naming_server_and_node(tmp_path, doubles, model):
    config, env = doubles
    run = ClusterRun(tmp_path, config, env, "plain", _elastic_overrides(model, 30, False),
                     nodes=[{"num_cpus": 2}, {"num_cpus": 1}])
    run.wait_for_steps(2)
    killed = time.monotonic()
    os.kill(_actor_of("areal_local.server", "rollout-1", str(model)), signal.SIGKILL)
    out = run.output()
    assert run.proc.returncode == 1, out
    assert time.monotonic() - killed < 60, "the run took longer than its documented timeouts to stop"
    assert "areal run failed: rollout-1 (inference server) on node " in out and "was lost" in out, out
    run.nothing_left()


def test_a_killed_train_rank_stops_the_run_with_its_log_lines(tmp_path, doubles):
    config, env = doubles
    run = ClusterRun(tmp_path, config, env, "rank", ["trainer.total_steps=40", "actor.step_s=0.3"])
    run.wait_for_steps(2)
    rank = next(p for p in launched_pids("areal_core.trainer", str(run.run_dir)) if process_name(p) == "actor-rank0")
    os.kill(rank, signal.SIGKILL)
    out = run.output()
    assert run.proc.returncode == 1, out
    assert "actor-rank0 (train rank 0) on node " in out and "killed by signal 9" in out, out
    assert "actor-rank0.log:" in out, out  # its last log lines are quoted
    run.nothing_left()


def test_a_node_with_another_plugin_version_is_refused_before_anything_starts(tmp_path, doubles):
    from areal_core.testing.distributions import install_fake_distribution

    config, env = doubles
    with install_fake_distribution(tmp_path / "other-site", "areal-plugin-ray", "9.9.9", {}, {}) as site:
        node_b = {"num_cpus": 1, "env_vars": {"PYTHONPATH": os.pathsep.join([str(site), env.get("PYTHONPATH", "")])}}
        run = ClusterRun(tmp_path, config, env, "mismatch", ["allocation=rl_infer_double:d2@cpu+rl_train_double:d2@cpu"],
                         nodes=[{"num_cpus": 1}, node_b])
        out = run.output()
    assert run.proc.returncode == 1, out
    mine = metadata.version("areal-plugin-ray")
    assert f"areal-plugin-ray is {mine} on the launcher's machine but 9.9.9 on node " in out, out
    assert "Nothing was launched" in out
    assert not (run.run_dir / "logs" / "actor-rank0.log").exists()
    run.nothing_left()


@needs_local_engine
def test_a_lost_node_stops_the_run_naming_the_process_and_its_node(tmp_path, doubles, model):
    """One node lost as a machine is: its raylet and every process under it (Ray's workers, so the actors, and
    what they started) SIGKILLed at once. The run stops naming the process that was there and its node, and
    nothing of the run is left on the node that remains."""
    config, env = doubles
    run = ClusterRun(tmp_path, config, env, "node", _elastic_overrides(model, 200, False),
                     nodes=[{"num_cpus": 2}, {"num_cpus": 1, "resources": {"areal-test-node-b": 1}}])
    run.wait_for_steps(2)
    [raylet] = [p for p in processes_mentioning("areal-test-node-b")
                if b"raylet" in Path(f"/proc/{p}/cmdline").read_bytes()]
    lost = time.monotonic()
    for pid in [raylet, *_descendants(raylet)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = run.output()
    assert run.proc.returncode == 1, out
    placed = dict(PLACED.findall(out))
    failed = out.split("areal run failed: ")[1].split()[0]
    assert "was lost" in out and f"on node {placed[failed]}" in out, out
    print(f"lost node reported after {time.monotonic() - lost:.1f} s")
    run.nothing_left()


def test_a_killed_launcher_leaves_nothing_running_on_the_cluster(tmp_path, doubles):
    """SIGKILL of `areal run` itself (the Ray driver) runs none of its cleanup; its actors belong to it, so Ray
    kills them, and their processes die with them."""
    config, env = doubles
    run = ClusterRun(tmp_path, config, env, "driver", ["trainer.total_steps=200", "actor.step_s=0.3",
                                                       "allocation=rl_infer_double:d2@cpu+rl_train_double:d2@cpu"])
    run.wait_for_steps(2)
    [driver] = [p for p in processes_mentioning("trial=driver") if Path(f"/proc/{p}/cmdline").read_bytes()
                .split(b"\0")[1].endswith(b"areal")]
    os.kill(driver, signal.SIGKILL)
    run.output()
    run.nothing_left()


def _raylets() -> int:
    count = 0
    for pid in processes_mentioning("raylet"):
        try:
            count += b"/raylet/raylet" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # it ended while we looked
            continue
    return count


def test_without_an_address_the_run_starts_ray_here_and_stops_it_at_the_end(tmp_path, doubles):
    config, env = doubles
    before = _raylets()
    proc = subprocess.run(cluster.netns([AREAL, "run", str(config), f"output_dir={tmp_path / 'runs'}", "trial=here",
                                         "launcher.name=ray", "launcher.num_cpus=2"]),
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    assert [r["step"] for r in _steps(tmp_path / "runs" / "areal" / "here")] == list(range(1, 7))
    # a Ray started by the run runs its processes at the run's own priority (normal, or the `nice` the suite runs at)
    assert "worker niceness" not in proc.stdout
    deadline = time.monotonic() + 30
    while _raylets() > before:
        assert time.monotonic() < deadline, "the Ray instance the run started outlived it"
        time.sleep(0.2)

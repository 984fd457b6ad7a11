"""The parity probe checks what the embedded server serves from then on: its derived copies (oneDNN-packed and
fused linears), even while they are still being rebuilt in the background after the load (the server settles
first, ``EngineLoop._add``). The real server, its rebuild made slow by slow_rebuild_server_double.py (each load
worker's share starts 3 s late), the real rollout controller's probe; the server's ``/health`` says whether the
probe ran on the copies."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from areal_core.api import Context
from areal_core.config.schema import RunConfig
from areal_core.processes import ProcessSpec, Supervisor, free_port
from areal_core.rollout import RolloutController
from areal_core.testing import scaled
from areal_core.testing.latency_engine import GroupWorkflowDouble
from areal_core.weight_check import PROBE_RID_PREFIX
from areal_local.engine import LocalEngine, LocalEngineConfig
from areal_local.models import tiny_model

DOUBLE = Path(__file__).with_name("slow_rebuild_server_double.py")
REBUILD_DELAY_S = scaled(3.0)  # longer than a load and the probe after it take: the probe finds the rebuild going on


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe-on-packed")
    config = RunConfig()
    config.model.path, config.model.dtype = str(tiny_model(root / "model", seed=0)), "float32"
    config.output_dir, config.experiment, config.trial = str(root / "runs"), "e", "t"
    supervisor = Supervisor(root / "runs" / "e" / "t" / "logs", term_timeout_s=5)
    port = free_port()
    recipe = LocalEngine.server_process(Context(config=config, options=LocalEngineConfig(max_batch=4)), 0, port)
    assert recipe.argv[recipe.argv.index("--rebuild") + 1] == "background"  # the default under test
    argv = [sys.executable, str(DOUBLE), str(REBUILD_DELAY_S),
            *recipe.argv[recipe.argv.index("areal_local.server") + 1:]]
    process = supervisor.start(ProcessSpec("rollout-0", argv, threads=1))
    supervisor.wait_ready(process, recipe.ready, scaled(120), recipe.what)
    yield config, port, tiny_model(root / "runs" / "e" / "t" / "other", seed=1)  # in the run folder: loadable
    supervisor.stop_all()


def test_the_probe_waits_for_the_rebuild_and_runs_on_the_copies_the_server_serves_from(server):
    config, port, other = server
    engine = LocalEngine.create(Context(config=config, extras={"address": f"127.0.0.1:{port}", "server_index": 0}))
    controller = RolloutController([engine], GroupWorkflowDouble(), batch_size=1, request_timeout_s=60).start()
    try:
        began = time.monotonic()
        controller.update_weights_from_disk(str(other), 1, probe=True)  # held for the probe until release()
        probed_s = time.monotonic() - began
        (answer,) = controller.probe_results.values()
        assert answer.output_ids and set(answer.output_versions) == {1}
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
        assert health["last_probe"] == {"rid": f"{PROBE_RID_PREFIX}1", "version": 1, "derived_live": True}, health
        # it waited for the slow rebuild (begun by the load): the probe cannot have come sooner
        assert probed_s >= REBUILD_DELAY_S, f"the probe came {probed_s:.2f} s after the update began"
        controller.release({})
    finally:
        controller.close()

"""Test doubles installed (as a fake distribution, by conftest.py) beside the core's RL doubles, so that a run
through the stand-in SLURM has real inference server processes to place.

- ``served_infer_double``: the core's latency engine double, plus a real server process per index
  (``python -m served_doubles HOST PORT INDEX``, a TCP "hello" naming itself and its node). Generation stays
  in the trainer; what is tested is the launcher's part: the server starts where the launcher put it, on the
  address it chose, and the trainer's engine finds that address and node in its environment. Each engine
  appends what it found to AREAL_TEST_SERVED_FILE. With AREAL_TEST_SERVER_EXIT=I:PATH, server I exits
  with status 3 once PATH exists (a server that crashes mid-run: PATH the run's metrics.jsonl, say).
- ``gpu_train_double``: the core's counter train engine double, declared for gpu too, so that allocations
  span nodes (no GPU is touched: the double trains a counter); with AREAL_TEST_FAIL_AT_STEP=N its N-th
  step raises (a trainer that crashes mid-run).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import socketserver
import sys
import threading
import time

from areal_core import hookimpl
from areal_core.api import ServerProcess
from areal_core.processes.nodes import NODE_ENV, rollout_node_env
from areal_core.parallelism import BackendSupport
from areal_core.testing.rl_doubles import CounterTrainEngineDouble, DiskLatencyEngineDouble


def hello(host: str, port: int) -> dict | None:
    """What the server at host:port says about itself; None while it does not answer."""
    try:
        with socket.create_connection((host, port), timeout=2) as conn:
            return json.loads(conn.makefile().readline())
    except (OSError, ValueError):
        return None


class ServedEngineDouble(DiskLatencyEngineDouble):
    @classmethod
    def server_process(cls, context, index, port):
        host = context.extras.get("host") or "127.0.0.1"
        argv = [sys.executable, "-m", "served_doubles", host, str(port), str(index)]
        return ServerProcess(argv, lambda: hello(host, port) is not None,
                             f"the hello of served double {index} on {host}:{port}", startup_timeout_s=60.0)

    @classmethod
    def create(cls, context):
        engine = super().create(context)
        engine.index = context.extras.get("server_index", 0)
        engine.address = context.extras.get("address")
        engine.same_node = context.extras.get("same_node")
        return engine

    async def start(self):
        if not self.address:
            raise RuntimeError(f"served double {self.index} has no address: no launcher started its server")
        host, port = self.address.rsplit(":", 1)
        said = await asyncio.to_thread(hello, host, int(port))
        if said is None:
            raise ConnectionError(f"served double {self.index}: nothing answers on {self.address}")
        record = os.environ.get("AREAL_TEST_SERVED_FILE")
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({"index": self.index, "address": self.address, "hello": said,
                                    "same_node": self.same_node, "trainer_node": os.environ.get(NODE_ENV),
                                    "server_node": os.environ.get(rollout_node_env(self.index))}) + "\n")


class CounterOnAnyDeviceDouble(CounterTrainEngineDouble):
    def train_batch(self, batch, loss_fn, temperature=1.0):
        fail_at = os.environ.get("AREAL_TEST_FAIL_AT_STEP")
        if fail_at and self.version + 1 == int(fail_at):
            raise RuntimeError(f"injected failure in step {fail_at} (AREAL_TEST_FAIL_AT_STEP)")
        return super().train_batch(batch, loss_fn, temperature)


@hookimpl
def areal_declare_backends():
    return [BackendSupport("served_infer_double", "inference", dims="dt", devices=("cpu", "gpu")),
            BackendSupport("gpu_train_double", "train", dims="d", devices=("cpu", "gpu"))]


ENTRY_POINTS = {
    "areal": {"slurm-test-doubles": "served_doubles"},
    "areal.engines.inference": {"served_infer_double": "served_doubles:ServedEngineDouble"},
    "areal.engines.train": {"gpu_train_double": "served_doubles:CounterOnAnyDeviceDouble"},
}


def serve(host: str, port: int, index: int) -> None:
    me = json.dumps({"index": index, "node": os.environ.get(NODE_ENV), "pid": os.getpid()}) + "\n"

    class Hello(socketserver.StreamRequestHandler):
        def handle(self):
            self.wfile.write(me.encode())

    crash = os.environ.get("AREAL_TEST_SERVER_EXIT", "")
    if crash and int(crash.split(":")[0]) == index:
        def exit_later():
            while not os.path.exists(crash.split(":", 1)[1]):
                time.sleep(0.1)
            print(f"served double {index}: exiting with status 3 (AREAL_TEST_SERVER_EXIT={crash})", flush=True)
            os._exit(3)

        threading.Thread(target=exit_later, daemon=True).start()
    socketserver.TCPServer.allow_reuse_address = True
    with socketserver.ThreadingTCPServer((host, port), Hello) as server:
        print(f"served double {index} listening on {host}:{port}", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

"""The integrity gate (``rollout.weight_check``) on the embedded engine's real server: its digests of what it
holds match the trainer's of what it sent after tensors through shared memory and a folder from disk, and with
a loader bug (faulty_server_double.py: the real server, one tensor permuted or a bucket skipped on load, as a
file the test writes says) it is caught at the first update, named with the tensors that differ, and leaves
routing. A server per test: with the file empty it is the real server unchanged."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from areal_core.api import Context
from areal_core.config.schema import RunConfig
from areal_core.processes import ProcessSpec, Supervisor, free_port
from areal_core.rollout import RolloutController
from areal_core.rollout.elastic import DOWN
from areal_core.testing import scaled
from areal_core.testing.latency_engine import GroupWorkflowDouble
from areal_core.weight_check import SentDigests, WeightCheckError, digest_folder, digest_named
from areal_local.engine import LocalEngine, LocalEngineConfig
from areal_local.models import tiny_model

DOUBLE = Path(__file__).with_name("faulty_server_double.py")
TENSOR = "model.layers.1.mlp.up_proj.weight"


class Servers:
    """An embedded server whose loader does what ``fault_file`` says (nothing when it is empty), on a tiny model."""

    def __init__(self, root: Path) -> None:
        run_dir = root / "runs" / "e" / "t"  # the server loads weights from its run folder only
        self.model = tiny_model(run_dir / "model", seed=0)
        self.other = tiny_model(run_dir / "other", seed=1)
        self.config = RunConfig()
        self.config.model.path, self.config.model.dtype = str(self.model), "float32"
        self.config.output_dir, self.config.experiment, self.config.trial = str(root / "runs"), "e", "t"
        self.fault_file = root / "fault.txt"
        self.supervisor = Supervisor(root / "runs" / "e" / "t" / "logs", term_timeout_s=5)
        self.ports = []
        port = free_port()
        recipe = LocalEngine.server_process(Context(config=self.config, options=LocalEngineConfig(max_batch=4)), 0,
                                            port)
        # the launcher's own command, started through the double
        argv = [sys.executable, str(DOUBLE), str(self.fault_file),
                *recipe.argv[recipe.argv.index("areal_local.server") + 1:]]
        process = self.supervisor.start(ProcessSpec("rollout-0", argv, threads=1))
        self.supervisor.wait_ready(process, recipe.ready, scaled(120), recipe.what)
        self.ports.append(port)

    def controller(self, holds: str = "generation") -> RolloutController:
        engines = [LocalEngine.create(Context(config=self.config, extras={"address": f"127.0.0.1:{port}",
                                                                          "server_index": i}))
                   for i, port in enumerate(self.ports)]
        return RolloutController(engines, GroupWorkflowDouble(), batch_size=1, request_timeout_s=60,
                                 weight_check_holds=holds).start()


@pytest.fixture
def servers(tmp_path_factory):
    """A server of its own for each test: each begins at version 0, and a server's versions only grow."""
    s = Servers(tmp_path_factory.mktemp("weight-check"))
    yield s
    s.supervisor.stop_all()


def test_digests_match_after_tensors_and_after_a_folder(servers):
    from safetensors.torch import load_file

    servers.fault_file.write_text("")
    named = list(load_file(str(servers.other / "model.safetensors")).items())
    with servers.controller() as controller:
        controller.update_weights_from_tensors(named, 1, sent=SentDigests(1, "on", digest_named(named)))
        controller.update_weights_from_disk(str(servers.model), 2, sent=SentDigests(2, "sample",
                                                                                   digest_folder(servers.model,
                                                                                                 "sample")))
        assert [e.version for e in controller.engines] == [2] and controller.fleet.weight_failures == []
        assert controller.fleet.digest_s < scaled(5)


@pytest.mark.parametrize("holds", ["generation", "training"])
@pytest.mark.parametrize("fault", [f"permute:{TENSOR}", "skip:model.layers.1."])
def test_a_loader_bug_at_a_later_update_is_caught_by_the_digests_taken_during_the_load(servers, fault, holds):
    """Once the gate has asked for the digests, the client names the mode in every later load and the server
    begins them with the load, on its digest thread (beside the rebuild of its derived copies): they must still
    see the bug, checked before generation resumes or beside it (``weight_check_holds``; then the trainer's wait
    for the check raises, as ``WeightHandOver.finish`` does)."""
    from safetensors.torch import load_file

    servers.fault_file.write_text("")
    first = list(load_file(str(servers.other / "model.safetensors")).items())
    second = list(load_file(str(servers.model / "model.safetensors")).items())
    with servers.controller(holds) as controller:
        controller.update_weights_from_tensors(first, 1, sent=SentDigests(1, "on", digest_named(first)))
        engine = controller.engines[0]
        controller.update_weights_from_tensors(second, 2, sent=SentDigests(2, "on", digest_named(second)))
        health = controller._call(engine.request("GET", "/health"), "the server's health")
        assert health["digested_during_load"] == "on" and controller.fleet.weight_failures == []
        servers.fault_file.write_text(fault)
        with pytest.raises(WeightCheckError) as error:
            controller.update_weights_from_tensors(first, 3, sent=SentDigests(3, "on", digest_named(first)))
            assert holds == "training"
            controller.settle_weight_check()
        assert "does not serve the weights of version 3" in str(error.value) and TENSOR in str(error.value)
    servers.fault_file.write_text("")


@pytest.mark.parametrize("fault", [f"permute:{TENSOR}", "skip:model.layers.1."])
def test_a_server_with_a_loader_bug_is_caught_at_the_first_update(servers, fault):
    from safetensors.torch import load_file

    servers.fault_file.write_text(fault)
    named = list(load_file(str(servers.other / "model.safetensors")).items())
    with servers.controller() as controller:
        with pytest.raises(WeightCheckError) as error:
            controller.update_weights_from_tensors(named, 1, sent=SentDigests(1, "on", digest_named(named)))
        assert f"inference server 127.0.0.1:{servers.ports[0]} does not serve the weights of version 1" \
            in str(error.value)
        assert TENSOR in str(error.value)
        assert [m.state for m in controller.members()] == [DOWN]  # out of routing
    servers.fault_file.write_text("")


def test_a_delta_is_applied_bit_for_bit_and_one_on_another_base_is_refused_then_the_full_weights_follow(servers):
    from safetensors.torch import load_file

    from areal_core.weight_delta import DeltaBaseMismatch, make_delta

    servers.fault_file.write_text("")
    v1 = list(load_file(str(servers.other / "model.safetensors")).items())
    v2 = [(name, t.clone()) for name, t in v1]
    for _, t in v2[::3]:  # a few elements of every third tensor change
        t.view(-1)[::97] += 0.5
    v3 = [(name, t + 1.0 if i == 0 else t.clone()) for i, (name, t) in enumerate(v2)]
    with servers.controller() as controller:
        controller.update_weights_from_tensors(v1, 1, sent=SentDigests(1, "on", digest_named(v1)))
        delta = make_delta(dict(v1), v2, 1, 2)
        assert delta.sparse and delta.nbytes < delta.full_nbytes / 5
        controller.update_weights_from_tensors(v2, 2, sent=SentDigests(2, "on", digest_named(v2)), delta=delta)
        assert controller.fleet.delta_bytes == delta.nbytes and controller.fleet.full_bytes == 0  # checked: equal
        engine = controller.engines[0]
        with pytest.raises(DeltaBaseMismatch, match="holds version 2; the delta is from 1"):
            controller._call(engine.update_weights_from_delta(delta, 3), "a stale delta")  # refused by the client
        engine.set_version(1)  # a client whose idea of the version is stale: the server refuses it
        with pytest.raises(DeltaBaseMismatch, match="HTTP 409.*the server holds version 2"):
            controller._call(engine.update_weights_from_delta(delta, 3), "a stale delta")
        controller.update_weights_from_tensors(v3, 3, sent=SentDigests(3, "on", digest_named(v3)),
                                               delta=make_delta(dict(v2), v3, 1, 3))  # its base is not held: full
        assert controller.fleet.delta_bytes == 0 and controller.fleet.full_bytes > 0
        assert engine.version == 3 and controller.fleet.weight_failures == []


def test_weights_that_compute_nan_are_refused_at_the_first_generation_not_trained_on(servers):
    """Finite garbage passes digests (both sides hold the same bytes) and NaN does too; the server then answers
    with null logprobs. The client refuses such an answer, naming the server, the token and the version: here the
    parity probe's generation, as any rollout's would be."""
    from safetensors.torch import load_file

    from areal_core.remote import NonFiniteLogprobs

    servers.fault_file.write_text("")
    named = [(n, t.clone().fill_(float("nan")) if n == TENSOR else t)
             for n, t in load_file(str(servers.other / "model.safetensors")).items()]
    with servers.controller() as controller:
        with pytest.raises(NonFiniteLogprobs) as error:
            controller.update_weights_from_tensors(named, 1, sent=SentDigests(1, "on", digest_named(named)),
                                                   probe=True)
        assert controller.fleet.weight_failures == []  # the digests agreed: NaN is what the trainer sent
    said = str(error.value)
    assert f"embedded engine 0 at 127.0.0.1:{servers.ports[0]} gave logprob None for token 0" in said
    assert "(version 1) compute no probability" in said and "resume from the last checkpoint" in said

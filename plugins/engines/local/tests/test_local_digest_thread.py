"""The embedded server's digests (the integrity gate, ``rollout.weight_check``) run on a thread of their own.

A load whose client named the digest mode answers once the new weights are in place, without waiting for their
digests, so the controller may resume generation at once (``rollout.weight_check_holds: training``) while the
server hashes them; ``GET /weight_digest`` answers when they are done, and the next load waits for them (they
read the weights it replaces). The real :class:`~areal_local.server.EngineLoop` and
:class:`~areal_local.generator.Generator` on a tiny model, driven command by command from the test thread as the
engine thread drives them; the digests are held on an event (a test hold) to see what waits for them.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_core.api.inference import SamplingParams
from areal_core.testing import scaled
from areal_core.weight_check import digest_named
from areal_local.generator import Generator
from areal_local.models import tiny_model
from areal_local.server import EngineLoop


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", tie_word_embeddings=False)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")


class HeldDigests:
    """An EngineLoop whose digests wait for :attr:`release` once begun (:attr:`began`); commands applied from
    the test thread (``_apply``, as the engine thread does)."""

    def __init__(self, model) -> None:
        self.gen = Generator(model, eos_token_ids=[])
        self.versions = {1: {n: t.clone() + 0.01 for n, t in model.state_dict().items()},
                         2: {n: t.clone() - 0.01 for n, t in model.state_dict().items()}}
        self.engine = EngineLoop(self.gen, self.load)
        self.loop = asyncio.new_event_loop()
        self.began, self.release = threading.Event(), threading.Event()
        digest = self.engine._digest_now

        def held(mode: str) -> dict:
            self.began.set()
            assert self.release.wait(scaled(30)), "the test never released the digests"
            return digest(mode)

        self.engine._digest_now = held

    def load(self, path: str, version: int, beside=None, adopt: bool = False) -> None:
        self.gen.load_state_dict(self.versions[version], beside=beside)

    def command(self, name: str, *args) -> asyncio.Future:
        future = self.loop.create_future()
        self.engine._apply(name, args, future, self.loop)
        return future

    def settle(self, future: asyncio.Future, timeout_s: float = 30) -> dict:
        return self.loop.run_until_complete(asyncio.wait_for(future, scaled(timeout_s)))


def test_a_load_answers_before_its_digests_generation_runs_meanwhile_and_the_next_load_waits_for_them(model):
    s = HeldDigests(model)
    # The client named the mode: the load begins the digests. The command returns (on this thread, as on the
    # engine thread) with them still held, and its answer is the new version.
    loaded = s.command("update", "/v1", 1, False, "on")
    assert s.began.wait(scaled(10)) and not s.release.is_set()
    assert s.settle(loaded, timeout_s=5)["version"] == 1

    answer = s.command("generate", "r", [5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0))
    while s.gen.num_running or s.gen.num_waiting:  # generation goes on on the new weights meanwhile
        for done in s.gen.step():
            s.engine._finish(done)
    assert s.settle(answer)["output_versions"] == [1, 1, 1]

    asked = s.command("digest", "on")
    s.loop.run_until_complete(asyncio.sleep(0.2))
    assert not asked.done()  # the digests are not taken yet: the answer waits for them, not the engine thread

    # The next load must not change the weights the digests read: it waits for them
    next_load = threading.Thread(target=lambda: s.engine._update("/v2", 2, lambda: s.load("/v2", 2)))
    next_load.start()
    next_load.join(0.3)
    assert next_load.is_alive() and s.engine.version == 1, "a load changed the weights while they were digested"
    s.release.set()
    next_load.join(scaled(30))
    assert not next_load.is_alive() and s.engine.version == 2
    held = s.settle(asked)
    assert held["version"] == 1 and held["digests"] == digest_named(s.versions[1].items(), "on")
    # asked again now: the digests of what the server holds now (version 2), not those of the last load's
    again = s.settle(s.command("digest", "on"))
    assert again["version"] == 2 and again["digests"] == digest_named(s.versions[2].items(), "on")

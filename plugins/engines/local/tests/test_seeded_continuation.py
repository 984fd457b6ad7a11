"""A seeded request continued after an interruption samples what it would have sampled uninterrupted.

An interruption (a pause, a weight update) stops a request with its tokens so far; it then continues from
prompt + output with the remaining budget and the same seed, re-added by the server (``EngineLoop._update``)
or re-submitted by the controller (``areal_core.rollout.interruptible``). Under the same weights the
continuation must reproduce the uninterrupted request token for token, which it only does when its random
draws continue the seed's stream rather than restart it (a restart reuses the draw of token i for token k+i).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_core.api.inference import SamplingParams
from areal_local.generator import Generator
from areal_local.models import tiny_model
from areal_local.server import EngineLoop

PROMPT = [100, 200, 300, 50, 60, 7, 8]
OTHER = [5, 6, 7]
N = 16
SETTINGS = {
    "plain": SamplingParams(max_new_tokens=N, temperature=1.0, seed=1234),
    "warped": SamplingParams(max_new_tokens=N, temperature=1.0, top_k=50, top_p=0.9, seed=77),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    # Weights ~ N(0, 0.2^2), as in test_generator: the default init mostly repeats the last token.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


def drain(gen: Generator) -> dict:
    results = {}
    for _ in range(200):
        if not (gen.num_running or gen.num_waiting):
            return results
        results.update((f.rid, f) for f in gen.step())
    raise AssertionError("generator did not drain")


def uninterrupted(model, sampling: SamplingParams):
    gen = Generator(model, eos_token_ids=[])
    gen.add("x", PROMPT, sampling)
    return drain(gen)["x"]


def assert_same(tokens, logprobs, full) -> None:
    assert tokens == full.output_ids  # position by position
    assert logprobs == pytest.approx(full.logprobs, abs=1e-5)  # a prefill instead of decode steps: rounding only


@pytest.fixture(scope="module", params=sorted(SETTINGS))
def case(request, model):
    sampling = SETTINGS[request.param]
    full = uninterrupted(model, sampling)
    assert len(full.output_ids) == N
    # The draws matter here: another seed samples other tokens.
    assert uninterrupted(model, replace(sampling, seed=sampling.seed + 1)).output_ids != full.output_ids
    return sampling, full


@pytest.mark.parametrize("k", [1, 2, 5, 11])
def test_a_continuation_resubmitted_with_the_remaining_budget_continues_the_seeds_stream(model, case, k):
    """The controller's continuation: prompt + the first k tokens, max_new_tokens N - k, the same seed (beside
    another seeded request, so rows and batch composition differ from the first run)."""
    sampling, full = case
    gen = Generator(model, eos_token_ids=[])
    gen.add("other", OTHER, replace(sampling, seed=5))
    gen.add("x", PROMPT + full.output_ids[:k], replace(sampling, max_new_tokens=N - k))
    rest = drain(gen)["x"]
    assert rest.stop_reason == "length"
    assert_same(full.output_ids[:k] + rest.output_ids, full.logprobs[:k] + rest.logprobs, full)


def test_an_aborted_request_continued_in_the_generator_samples_the_uninterrupted_tokens(model, case):
    sampling, full = case
    gen = Generator(model, eos_token_ids=[])
    gen.add("x", PROMPT, sampling)
    gen.step()
    gen.step()
    partial = gen.abort("x")
    assert partial.stop_reason == "abort" and len(partial.output_ids) == 3
    gen.add("x", PROMPT + partial.output_ids, replace(sampling, max_new_tokens=N - 3))
    rest = drain(gen)["x"]
    assert_same(partial.output_ids + rest.output_ids, partial.logprobs + rest.logprobs, full)


class Driver:
    """An EngineLoop driven from the test thread, step by step, as its own thread would drive it."""

    def __init__(self, model) -> None:
        self.gen = Generator(model, eos_token_ids=[])
        self.weights = {name: t.clone() for name, t in model.state_dict().items()}
        self.loaded: list[str] = []
        self.engine = EngineLoop(self.gen, self.load)
        self.loop = asyncio.new_event_loop()

    def load(self, path: str, version: int) -> None:  # the same weights again: only the interruption differs
        self.loaded.append(path)
        self.gen.load_state_dict(self.weights)

    def command(self, name: str, *args) -> asyncio.Future:
        future = self.loop.create_future()
        self.engine._apply(name, args, future, self.loop)
        return future

    def step(self, times: int = 1) -> None:
        for _ in range(times):
            for done in self.gen.step():
                self.engine._finish(done)

    def drain(self) -> None:
        while self.gen.num_running or self.gen.num_waiting:
            self.step()

    def answer(self, future: asyncio.Future) -> dict:
        return self.loop.run_until_complete(future)


def test_a_request_the_server_continues_across_a_weight_update_samples_the_uninterrupted_tokens(model, case):
    sampling, full = case
    driver = Driver(model)
    try:
        answer = driver.command("generate", "x", PROMPT, sampling)
        driver.step(3)  # 4 tokens: the prefill's and three decode steps'
        driver.answer(driver.command("update", "/same/weights", 1))  # aborts "x", re-adds it at version 1
        assert driver.loaded == ["/same/weights"]
        driver.drain()
        out = driver.answer(answer)
    finally:
        driver.loop.close()
    assert out["stop_reason"] == "length" and out["output_versions"] == [0] * 4 + [1] * (N - 4)
    assert_same(out["output_ids"], out["output_logprobs"], full)


def test_a_request_paused_then_resubmitted_after_resume_samples_the_uninterrupted_tokens(model, case):
    sampling, full = case
    driver = Driver(model)
    try:
        first = driver.command("generate", "x", PROMPT, sampling)
        driver.step(2)
        driver.answer(driver.command("pause"))
        partial = driver.answer(first)
        assert partial["stop_reason"] == "abort" and len(partial["output_ids"]) == 3
        driver.answer(driver.command("resume"))
        # What the controller sends next: prompt + output so far, the remaining budget, the same seed.
        second = driver.command("generate", "x", PROMPT + partial["output_ids"],
                                replace(sampling, max_new_tokens=N - 3))
        driver.drain()
        rest = driver.answer(second)
    finally:
        driver.loop.close()
    assert_same(partial["output_ids"] + rest["output_ids"], partial["output_logprobs"] + rest["output_logprobs"],
                full)

"""Workflow test doubles for the conformance kit's own tests: two good ones
(single- and multi-turn), the rest each breaking one rule. Installed as a
fake distribution by ``tests/test_conformance_kit.py``; never shipped.

Their "tokenizer" maps text to one id per character (ids below 5000 for
ASCII), and decodes an id to ``<id>``, so decoding then re-encoding a
model's output changes its ids, as a real tokenizer can.
"""

from __future__ import annotations

import asyncio

from areal_core.api import GenerationRequest, SamplingParams, Trajectory, Workflow


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


class ToyWorkflowDouble(Workflow):
    """A group of two samples per item; rejects items marked ``skip``."""

    async def arun_episode(self, engine, item):
        if item.get("skip"):
            return None
        prompt = encode(item["prompt"])
        requests = [GenerationRequest(prompt, SamplingParams(max_new_tokens=16)) for _ in range(2)]
        responses = await asyncio.gather(*(engine.agenerate(r) for r in requests))
        return [self.trajectory(prompt, r, item) for r in responses]

    def trajectory(self, prompt, response, item):
        out = response.output_ids
        return Trajectory(
            tokens=prompt + out,
            loss_mask=[0] * len(prompt) + [1] * len(out),
            logprobs=[0.0] * len(prompt) + list(response.output_logprobs),
            versions=[-1] * len(prompt) + list(response.output_versions),
            reward=self.reward(out, item),
        )

    def reward(self, out, item):
        return float(len(out) >= item.get("min_len", 1))


class ToyMultiTurnWorkflowDouble(Workflow):
    """Two turns with environment feedback between them, in one trajectory."""

    async def arun_episode(self, engine, item):
        tokens = encode(item["prompt"])
        mask, logprobs, versions = [0] * len(tokens), [0.0] * len(tokens), [-1] * len(tokens)
        for turn in range(2):
            if turn:
                feedback = encode(" try again\n")
                tokens, mask = tokens + feedback, mask + [0] * len(feedback)
                logprobs, versions = logprobs + [0.0] * len(feedback), versions + [-1] * len(feedback)
            r = await engine.agenerate(GenerationRequest(list(tokens), SamplingParams(max_new_tokens=8)))
            tokens, mask = tokens + r.output_ids, mask + [1] * len(r.output_ids)
            logprobs, versions = logprobs + r.output_logprobs, versions + r.output_versions
        return [Trajectory(tokens, mask, logprobs, versions, reward=0.5)]


class RetokenizingWorkflowDouble(ToyWorkflowDouble):
    """Broken: decodes the model's output to text and encodes it again."""

    def trajectory(self, prompt, response, item):
        out = encode(decode(response.output_ids))
        return Trajectory(prompt + out, [0] * len(prompt) + [1] * len(out),
                          [0.0] * len(prompt) + [-0.1] * len(out),
                          [-1] * len(prompt) + [response.output_versions[0]] * len(out), reward=1.0)


class MaskEverythingWorkflowDouble(ToyWorkflowDouble):
    """Broken: trains on the prompt too."""

    def trajectory(self, prompt, response, item):
        t = super().trajectory(prompt, response, item)
        t.loss_mask = [1] * len(t.tokens)
        return t


class ZeroVersionWorkflowDouble(ToyWorkflowDouble):
    """Broken: tags every engine token with version 0 instead of the engine's."""

    def trajectory(self, prompt, response, item):
        t = super().trajectory(prompt, response, item)
        t.versions = [-1] * len(prompt) + [0] * len(response.output_ids)
        return t


class NanRewardWorkflowDouble(ToyWorkflowDouble):
    """Broken: a reward of NaN."""

    def reward(self, out, item):
        return float("nan")


class IncompleteWorkflowDouble(Workflow):
    """Broken: never implements arun_episode."""

"""Conformance suite for workflows (entry-point group ``areal.workflows``)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import pytest

from areal_core.api.inference import GenerationResponse
from areal_core.api.workflow import Trajectory
from areal_core.testing.base import ComponentConformance, finite_number
from areal_core.testing.scripted_engine import DEFAULT_SCRIPT, ScriptedInferenceEngine


@dataclass
class Episode:
    """One ``arun_episode`` call and what the scripted engine emitted during it."""

    item: Any
    result: list[Trajectory] | None
    responses: list[GenerationResponse]


@dataclass(frozen=True)
class EngineSpan:
    """Positions ``start:end`` of a trajectory that repeat an engine output's first tokens."""

    start: int
    end: int
    candidates: tuple[GenerationResponse, ...]  # every response those tokens may come from


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def engine_spans(tokens: Sequence[int], responses: Sequence[GenerationResponse]) -> list[EngineSpan]:
    """Where the engine's outputs (or leading parts of them) appear verbatim in ``tokens``, left to right."""
    spans: list[EngineSpan] = []
    i = 0
    while i < len(tokens):
        n = max((_common_prefix(tokens[i:], r.output_ids) for r in responses), default=0)
        if n == 0:
            i += 1
            continue
        window = list(tokens[i:i + n])
        spans.append(EngineSpan(i, i + n, tuple(r for r in responses if r.output_ids[:n] == window)))
        i += n
    return spans


def _ranges(positions: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``3..5, 9``."""
    out, start = [], None
    for k, p in enumerate(positions):
        if start is None:
            start = p
        if k + 1 == len(positions) or positions[k + 1] != p + 1:
            out.append(f"{start}..{p}" if p != start else f"{p}")
            start = None
    return ", ".join(out)


class WorkflowConformance(ComponentConformance):
    """Runs episodes against :class:`ScriptedInferenceEngine` and checks the trajectories.

    Set on the subclass: ``component_name``; ``items``, dataset items the
    workflow understands (at least one must give trajectories); optionally
    ``script`` (the token ids the engine replays; keep them out of your
    prompts' ids so engine tokens can be told apart) and ``engine_version``.
    Override :meth:`make` when the workflow needs a tokenizer or a reward.
    """

    kind: ClassVar[str] = "workflow"
    items: ClassVar[list[Any]] = []
    script: ClassVar[Sequence[Sequence[int]]] = DEFAULT_SCRIPT
    engine_version: ClassVar[int] = 3

    # -- helpers ------------------------------------------------------------
    def make_engine(self) -> ScriptedInferenceEngine:
        return ScriptedInferenceEngine(self.script, version=self.engine_version)

    def episodes(self) -> list[Episode]:
        if not self.items:
            pytest.fail(f"{type(self).__name__}.items is empty: give the dataset items "
                        f"{self.component_name} runs episodes on")
        workflow = self.make(self.component_class())
        episodes = []
        for item in self.items:
            engine = self.make_engine()
            result = asyncio.run(workflow.arun_episode(engine, item))
            episodes.append(Episode(item, result, list(engine.responses)))
        return episodes

    def trajectories(self) -> list[tuple[str, Trajectory, Episode]]:
        """(label, trajectory, episode) for every trajectory of every item."""
        out = []
        for episode in self.episodes():
            result = episode.result
            if result is None:
                continue
            if not isinstance(result, list) or not all(isinstance(t, Trajectory) for t in result):
                pytest.fail(f"{self.component_name}.arun_episode returned {result!r} for item "
                            f"{episode.item!r}; it must return a list of Trajectory, or None to reject")
            out.extend((f"trajectory {k} of item {episode.item!r}", t, episode) for k, t in enumerate(result))
        if not out:
            pytest.fail(f"{self.component_name} rejected every item in {type(self).__name__}.items "
                        f"(returned None or []), so nothing could be checked; add items it accepts")
        return out

    # -- tests --------------------------------------------------------------
    def test_returns_none_or_a_list_of_trajectories(self) -> None:
        self.trajectories()

    def test_per_token_lists_agree(self) -> None:
        for label, t, _ in self.trajectories():
            n = len(t.tokens)
            lengths = {name: len(getattr(t, name)) for name in ("loss_mask", "logprobs", "versions")}
            assert all(v == n for v in lengths.values()), f"{label}: {n} tokens but {lengths}"
            assert set(t.loss_mask) <= {0, 1}, f"{label}: loss_mask holds {sorted(set(t.loss_mask))}, not 0 / 1"

    def test_loss_mask_is_one_exactly_on_engine_tokens(self) -> None:
        """Token-in / token-out: the engine's ids appear verbatim, and only they are trained on."""
        for label, t, episode in self.trajectories():
            engine_positions = {p for s in engine_spans(t.tokens, episode.responses) for p in range(s.start, s.end)}
            assert engine_positions, (
                f"{label} contains none of the token ids the engine returned "
                f"({[r.output_ids for r in episode.responses]}). Token-in / token-out: keep the ids "
                f"the engine returns; never decode and re-encode a model's output")
            trained = [p for p, m in enumerate(t.loss_mask) if m == 1 and p not in engine_positions]
            assert not trained, (
                f"{label}: positions {_ranges(trained)} (ids {[t.tokens[p] for p in trained][:12]}) have "
                f"loss_mask 1, but the engine never produced them (it produced "
                f"{[r.output_ids for r in episode.responses]}). Token-in / token-out: keep the ids the "
                f"engine returns; never decode and re-encode a model's output")
            untrained = [p for p in sorted(engine_positions) if t.loss_mask[p] != 1]
            assert not untrained, (
                f"{label}: positions {_ranges(untrained)} hold tokens the engine produced but have "
                f"loss_mask 0; loss_mask is 1 on policy tokens, 0 on prompt and tool tokens")

    def test_engine_tokens_keep_their_logprobs_and_versions(self) -> None:
        for label, t, episode in self.trajectories():
            spans = engine_spans(t.tokens, episode.responses)
            for s in spans:
                kept = t.logprobs[s.start:s.end]
                if not any(all(math.isclose(a, b, abs_tol=1e-6) for a, b in zip(kept, r.output_logprobs))
                           for r in s.candidates):
                    pytest.fail(f"{label}: logprobs at positions {s.start}..{s.end - 1} are {kept}, not the "
                                f"engine's {[list(r.output_logprobs[:s.end - s.start]) for r in s.candidates]}; "
                                f"keep the behaviour logprobs the engine returned")
                versions = t.versions[s.start:s.end]
                expected = list(s.candidates[0].output_versions[:s.end - s.start])
                assert versions == expected, (
                    f"{label}: versions at positions {s.start}..{s.end - 1} are {versions}; the engine "
                    f"(at version {self.engine_version}) tagged them {expected}")
            engine_positions = {p for s in spans for p in range(s.start, s.end)}
            other = [p for p, v in enumerate(t.versions) if p not in engine_positions and v != -1]
            assert not other, (
                f"{label}: positions {_ranges(other)} are not policy tokens but have versions "
                f"{sorted({t.versions[p] for p in other})}; use -1 where no policy produced the token")

    def test_rewards_are_finite(self) -> None:
        for label, t, _ in self.trajectories():
            finite_number(t.reward, f"{label}: reward")

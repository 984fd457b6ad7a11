"""Evaluation: a workflow run on validation items beside the training rollouts.

This part owns only the evaluation episodes. They share the engines (and
their interruptions at weight updates) with training episodes but not the
staleness accounting: nothing they produce is trained on, so they never pass
through :class:`~areal_core.rollout.admission.Admission`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from areal_core.api.inference import InferenceEngine
from areal_core.api.workflow import Workflow


async def run_evaluation(workflow: Workflow, engine: InferenceEngine, items: list[Any],
                         concurrency: int = 32) -> list[Any]:
    """One entry per item, in order: its trajectories, None when the workflow rejected it, or the exception it
    raised; at most ``concurrency`` episodes at once (on the controller's loop)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(item: Any) -> Any:
        async with gate:
            return await workflow.arun_episode(engine, item)

    return await asyncio.gather(*(one(item) for item in items), return_exceptions=True)

"""The ``reasoning_gym`` reward: the task's own verifier (``score_answer``) on the tagged answer."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from areal_core.api import Reward
from areal_core.config.schema import spec


@dataclass
class ReasoningGymRewardConfig:
    """Keys of ``reward`` when ``reward.name: reasoning_gym``."""

    tag: str = spec("answer", help="the answer is the text inside the last <tag></tag> of the completion")
    require_tag: bool = spec(True, help="false: a completion without the tag is scored as a whole")


@functools.lru_cache(maxsize=None)
def scorer(task: str) -> Callable[[str, dict], float]:
    """The task's ``score_answer`` (built once per task: some tasks load data files when built)."""
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(task)


class ReasoningGymReward(Reward):
    """Scores with the verifier of the task named in ``item["metadata"]["source_dataset"]``.

    The answer is the last ``<answer>...</answer>`` of the completion (tag and
    strictness are options). Returns ``{"reward", "answer"}``, plus
    ``"error"`` when the task's verifier raised (scored 0).
    """

    config_class = ReasoningGymRewardConfig

    def __call__(self, prompt: str, completion: str, item: Any) -> dict:
        from reasoning_gym.utils import extract_answer

        options = self.context.options or ReasoningGymRewardConfig()
        try:
            task = item["metadata"]["source_dataset"]
        except (KeyError, TypeError):
            raise ValueError(f"the reasoning_gym reward needs item['metadata']['source_dataset'] (item "
                             f"{item.get('id')!r} has none). Fix: use it with the reasoning_gym dataset") from None
        answer = extract_answer(completion, tag_name=options.tag)
        if answer is None and not options.require_tag:
            answer = completion.strip()
        if answer is None:
            return {"reward": 0.0, "answer": None}
        entry = {"question": item.get("question", ""), "answer": item["answer"], "metadata": item["metadata"]}
        try:
            score = float(scorer(task)(answer, entry))
        except Exception as exc:  # a verifier choking on odd model text scores 0, never stops the run
            return {"reward": 0.0, "answer": answer[:200], "error": f"{type(exc).__name__}: {exc}"[:300]}
        return {"reward": score, "answer": answer[:200]}

"""The ``reasoning_gym`` dataset: one reasoning-gym task generator, by name, split in two.

The validation split is the task's generator under one seed, the train
split the same generator under another (both derived from ``trainer.seed``);
train problems whose question is also a validation question are skipped, so
no validation problem is ever trained on. reasoning-gym builds entry ``k``
from its seed and ``k`` alone, so the order is the same after a restart;
the train split is reshuffled between passes, reproducibly.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterator

from areal_core.api import Dataset, pass_order, stable_seed
from areal_core.config.schema import spec


@dataclass
class ReasoningGymConfig:
    """Keys of ``dataset`` when ``dataset.name: reasoning_gym``."""

    task: str = spec("basic_arithmetic", help="a reasoning-gym dataset name: gsm_symbolic, basic_arithmetic, "
                                              "chain_sum, countdown, puzzle24, ... (about 100)")
    task_options: dict = spec(factory=dict, help="passed to the task's config as they are (e.g. min_terms)")
    size: int = spec(1000, ge=1, help="train problems drawn (fewer are yielded if some equal validation ones)")
    validation_size: int = spec(64, ge=0, help="held-out problems, never in the train split")
    system_prompt: str = spec("default", help="a name from reasoning_gym.utils.SYSTEM_PROMPTS (the 'default' "
                                              "one asks for <answer></answer>), other text as it is, or '' for none")
    chat: bool = spec(True, help="true: messages (chat template applied by the workflow); false: raw prompt "
                                 "(system prompt, a blank line, the question)")


def task_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def make_task(task: str, seed: int, size: int, options: dict) -> Any:
    """``reasoning_gym.create_dataset`` with errors that name the config key and the fix."""
    import reasoning_gym

    names = task_names()
    if task not in names:
        guess = next(iter(difflib.get_close_matches(task, names, n=1)), None)
        raise ValueError(f"dataset.task {task!r} is not a reasoning-gym task"
                         f"{f' (did you mean {guess!r}?)' if guess else ''}. Fix: pick one of: {', '.join(names)}")
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **options)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"reasoning-gym task {task!r} refused dataset.task_options {options!r}: "
                         f"{type(exc).__name__}: {exc}. Fix: use the fields of its config class "
                         f"(reasoning_gym.factory.DATASETS[{task!r}][1])") from None


def system_text(name_or_text: str) -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(name_or_text, name_or_text)


class ReasoningGymDataset(Dataset):
    """Items: ``id``, ``messages`` or ``prompt``, ``answer``, and ``question`` / ``metadata`` (what the
    ``reasoning_gym`` reward hands back to the task's own ``score_answer``)."""

    config_class = ReasoningGymConfig

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        o = self.options = self.context.options if self.context.options is not None else ReasoningGymConfig()
        self._split, self._passes = self.split, 0
        self._system = system_text(o.system_prompt)
        base = stable_seed("reasoning_gym", o.task, self.seed)
        self._validation = make_task(o.task, base, o.validation_size, dict(o.task_options)) \
            if o.validation_size else []
        self._held_out = {entry["question"] for entry in self._validation}
        self._train = make_task(o.task, base + 1, o.size, dict(o.task_options)) if self._split == "train" else None

    def _item(self, k: int, entry: dict) -> dict[str, Any]:
        item: dict[str, Any] = {"id": f"{self.options.task}/{self._split}/{k}", "answer": str(entry["answer"]),
                                "question": entry["question"], "metadata": entry["metadata"]}
        if self.options.chat:
            system = [{"role": "system", "content": self._system}] if self._system else []
            item["messages"] = [*system, {"role": "user", "content": entry["question"]}]
        else:
            item["prompt"] = f"{self._system}\n\n{entry['question']}" if self._system else entry["question"]
        return item

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._split == "validation":
            return (self._item(k, self._validation[k]) for k in range(len(self._validation)))
        # Pass 0 in the generator's order, later passes reshuffled by (seed, pass): the n-th iter() of any
        # instance gives pass n's order, so a resumed run re-reads the same stream.
        pass_index, self._passes = self._passes, self._passes + 1
        order = pass_order(len(self._train), self.seed, pass_index, shuffle=pass_index > 0)
        return (self._item(k, self._train[k]) for k in order if self._train[k]["question"] not in self._held_out)

    def __len__(self) -> int:
        if self._split == "validation":
            return len(self._validation)
        return sum(1 for k in range(len(self._train)) if self._train[k]["question"] not in self._held_out)

"""What the synthetic tasks share: problems drawn per index from a seed, a held-out validation set.

Problem ``k`` of a split comes from ``random.Random(stable_seed(task, seed,
split, k))``, so the stream is the same in every process and after a
restart, and any item can be rebuilt without the ones before it. The
validation set (``validation_size`` distinct problems) is drawn first; the
train stream skips every problem whose key is in it, so no validation
problem is ever trained on.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from typing import Any, ClassVar, Hashable, Iterator

from areal_core import Problem, ProblemsError
from areal_core.api import Dataset, pass_order, stable_seed

# Draws allowed per wanted problem before the problem space is declared too small.
MAX_DRAWS_PER_ITEM = 50
# The most held-out problems a task draws (at the start of a run, and in `areal check`): a few seconds' work.
MAX_VALIDATION_SIZE = 10_000


class SyntheticDataset(Dataset):
    """Base of generated tasks; a subclass draws one problem with :meth:`draw`.

    Options every synthetic task has (its ``config_class`` must declare
    them): ``size`` (train problems; 0 = endless), ``validation_size``.
    """

    task: ClassVar[str] = ""

    def __init__(self, context: Any = None) -> None:
        super().__init__(context)
        self.options = self.context.options if self.context.options is not None else self.config_class()
        problems = self.option_problems(self.options)
        if problems:
            raise ProblemsError(problems, f"the {self.task} dataset's options")
        self._split = self.split  # checks the split name now, not at the first iteration
        self._passes = 0
        self._validation = self._draw_validation()
        self._held_out = {key for key, _ in self._validation}

    # -- for subclasses ---------------------------------------------------
    @classmethod
    def option_problems(cls, options: Any) -> list[Problem]:
        """What is wrong with ``options`` taken together (ranges are checked by the core); [] if nothing."""
        return []

    @abstractmethod
    def draw(self, rng: random.Random) -> tuple[Hashable, dict[str, Any]]:
        """One problem: a key that identifies it (for de-duplication) and its item, without ``id``."""

    # -- the stream -------------------------------------------------------
    def _rng(self, split: str, k: int) -> random.Random:
        return random.Random(stable_seed(self.task, self.seed, split, k))

    def _draw_validation(self) -> list[tuple[Hashable, dict[str, Any]]]:
        wanted = self.options.validation_size
        found: dict[Hashable, dict[str, Any]] = {}
        draws = last_new = 0
        while len(found) < wanted:
            # Given up after 50 draws per wanted problem, or as soon as 50 per problem found brought nothing new
            # (the space is spent: a space of 441 problems asked for 10**8 stops after ~22,000 draws, not 5e9).
            if draws >= MAX_DRAWS_PER_ITEM * wanted or draws - last_new >= MAX_DRAWS_PER_ITEM * max(1, len(found)):
                raise ValueError(
                    f"{self.task}: only {len(found)} distinct problems found in {draws} draws, but "
                    f"dataset.validation_size is {wanted}; the options allow too few problems. Fix: lower "
                    f"dataset.validation_size, or widen the problem space (more operands, larger numbers)")
            key, item = self.draw(self._rng("validation", draws))
            draws += 1
            if key not in found:
                found[key], last_new = item, draws
        return [(key, {"id": f"{self.task}/validation/{k}", **item}) for k, (key, item) in enumerate(found.items())]

    def _train(self) -> Iterator[dict[str, Any]]:
        count, draws, misses = 0, 0, 0
        size = self.options.size
        while size == 0 or count < size:
            key, item = self.draw(self._rng("train", draws))
            draws += 1
            if key in self._held_out:
                misses += 1
                if misses >= MAX_DRAWS_PER_ITEM * max(1, len(self._held_out)):
                    raise ValueError(
                        f"{self.task}: {misses} draws in a row were validation problems, so the train split "
                        f"has (almost) nothing left. Fix: lower dataset.validation_size, or widen the problem space")
                continue
            misses = 0
            yield {"id": f"{self.task}/train/{count}", **item}
            count += 1

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._split == "validation":
            return iter([item for _, item in self._validation])
        pass_index, self._passes = self._passes, self._passes + 1
        if self.options.size == 0 or pass_index == 0:
            return self._train()
        items = list(self._train())
        return iter([items[k] for k in pass_order(len(items), self.seed, pass_index, True)])

    def __len__(self) -> int:
        if self._split == "validation":
            return len(self._validation)
        if self.options.size == 0:
            raise TypeError(f"the {self.task} train split is endless (dataset.size: 0)")
        return self.options.size

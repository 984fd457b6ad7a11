"""The dataset contract: items for workflows (entry-point group ``areal.datasets``).

An item is a dict. The convention every first-party dataset, workflow and
reward shares (docs/datasets.md):

- ``id`` (str): unique within the dataset, across both splits;
- ``prompt`` (str, raw text sent as it is) or ``messages`` (a chat: a list of
  ``{"role", "content"}`` dicts, to which the workflow applies the
  tokenizer's chat template once);
- ``answer`` (str): the reference answer the reward checks against;
- ``stop`` (optional list of str): stop strings the task needs (``"\\n"`` for
  a few-shot prompt);
- any task metadata the task's reward reads.
"""

from __future__ import annotations

import hashlib
import random
from abc import abstractmethod
from typing import Any, Iterator

from areal_core.api.component import Component

SPLITS = ("train", "validation")


def stable_seed(*parts: Any) -> int:
    """A seed in ``[0, 2**31)`` from ``parts`` (ints, strings), equal in every process and Python run.

    Python's ``hash()`` of a str changes per process (PYTHONHASHSEED), so
    seeds that must survive a restart (dataset items, per-sample sampling
    seeds) come from a digest of the parts' ``repr`` instead.
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 2**31


def pass_order(n: int, seed: int, pass_index: int, shuffle: bool = True) -> list[int]:
    """The order of pass ``pass_index`` over ``n`` items: ``0..n-1``, shuffled by (seed, pass) when asked.

    Equal in every process for the same arguments, so a dataset that
    reshuffles between passes stays resumable (see :class:`Dataset`).
    """
    order = list(range(n))
    if shuffle:
        random.Random(stable_seed("pass", seed, pass_index)).shuffle(order)
    return order


class Dataset(Component):
    """A finite or endless, seeded source of items (dicts the workflow understands).

    The split: the trainer builds one instance per split with
    ``Context(..., extras={"split": "train"})`` or ``{"split": "validation"}``
    (``"train"`` when absent; see :attr:`split`). Items of the validation
    split never appear in the train split, and each split is deterministic
    for the run's seed (``context.config.trainer.seed``, see :attr:`seed`).

    Resumable order: a fresh instance built from the same config yields the
    same items in the same order, so a resumed run re-reads the stream and
    skips what it already consumed. A dataset may reshuffle between passes;
    then the n-th ``iter()`` of an instance gives pass n's order, whatever
    instance, so the trainer's passes are reproducible too.
    """

    @abstractmethod
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Items in a deterministic order for a given seed."""

    def __len__(self) -> int:
        raise TypeError(f"{type(self).__name__} is endless")

    @property
    def split(self) -> str:
        """``context.extras["split"]``: ``"train"`` (the default) or ``"validation"``."""
        split = self.context.extras.get("split", "train")
        if split not in SPLITS:
            raise ValueError(f"{type(self).__name__}: split {split!r} is not one of {', '.join(SPLITS)}; "
                             f"build datasets with Context(extras={{'split': 'train'}}) or 'validation'")
        return split

    @property
    def seed(self) -> int:
        """The run's seed (``trainer.seed``), 0 when built without a config (unit tests)."""
        config = self.context.config
        return int(config.trainer.seed) if config is not None else 0

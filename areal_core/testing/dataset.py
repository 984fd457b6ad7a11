"""Conformance suite for datasets (entry-point group ``areal.datasets``)."""

from __future__ import annotations

import itertools
import json
from typing import Any, ClassVar

import pytest

from areal_core.api.component import Context
from areal_core.testing.base import ComponentConformance


def prompt_of(item: dict) -> str:
    """The item's prompt as comparable text (raw prompt or the chat messages)."""
    return json.dumps(item.get("messages") if "messages" in item else item.get("prompt"), sort_keys=True)


class DatasetConformance(ComponentConformance):
    """Checks a dataset against the item convention, the split and the ordering rules.

    Set on the subclass: ``component_name``; optionally ``options`` (a dict of
    the dataset's keys, as under ``dataset:`` in a config; the defaults of its
    ``config_class`` otherwise), ``seed`` and ``take`` (how many items of each
    split are checked; endless datasets are read that far). Override
    :meth:`make_split` when building takes more than a Context.
    """

    kind: ClassVar[str] = "dataset"
    options: ClassVar[dict[str, Any]] = {}
    seed: ClassVar[int] = 7
    take: ClassVar[int] = 40

    # -- helpers ------------------------------------------------------------
    def make_split(self, split: str, seed: int | None = None) -> Any:
        """A fresh instance for ``split``, built as the trainer builds one."""
        from areal_core.config.schema import RunConfig

        cls = self.component_class()
        config = RunConfig()
        config.trainer.seed = self.seed if seed is None else seed
        options = cls.config_class(**self.options) if cls.config_class is not None else None
        return cls.create(Context(config=config, options=options, extras={"split": split}))

    def read(self, dataset: Any) -> list[dict]:
        return list(itertools.islice(iter(dataset), self.take))

    # -- tests --------------------------------------------------------------
    def test_items_follow_the_convention(self) -> None:
        for split in ("train", "validation"):
            items = self.read(self.make_split(split))
            assert items, f"{self.component_name}: the {split} split yielded no items"
            for item in items:
                where = f"{self.component_name} {split} item {item.get('id')!r}"
                assert isinstance(item, dict), f"{where} is {type(item).__name__}, not a dict"
                assert isinstance(item.get("id"), str) and item["id"], f"{where}: 'id' must be a non-empty str"
                assert ("prompt" in item) != ("messages" in item), (
                    f"{where}: needs exactly one of 'prompt' (raw text) or 'messages' (chat), has "
                    f"{sorted(k for k in ('prompt', 'messages') if k in item)}")
                if "prompt" in item:
                    assert isinstance(item["prompt"], str), f"{where}: 'prompt' must be a str"
                else:
                    assert isinstance(item["messages"], list) and item["messages"] and all(
                        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                        for m in item["messages"]), f"{where}: 'messages' must be a list of {{role, content}} str"
                assert isinstance(item.get("answer"), str), f"{where}: 'answer' must be a str"
                stop = item.get("stop", [])
                assert isinstance(stop, list) and all(isinstance(s, str) and s for s in stop), (
                    f"{where}: 'stop' must be a list of non-empty str, not {stop!r}")

    def test_ids_are_unique_across_splits(self) -> None:
        ids = [i["id"] for split in ("train", "validation") for i in self.read(self.make_split(split))]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        assert not repeated, f"{self.component_name}: ids {repeated[:5]} appear more than once"

    def test_validation_items_never_appear_in_train(self) -> None:
        validation = {prompt_of(i) for i in self.make_split("validation")}
        train = self.read(self.make_split("train"))
        leaked = [i["id"] for i in train if prompt_of(i) in validation]
        assert not leaked, (f"{self.component_name}: train items {leaked[:5]} have the prompt of a validation "
                            f"item; validation problems must never be trained on")

    def test_same_seed_same_items_in_the_same_order(self) -> None:
        """What resuming relies on: a fresh instance re-reads the stream identically, pass after pass."""
        for split in ("train", "validation"):
            first, second = self.make_split(split), self.make_split(split)
            for pass_index in range(2):
                a, b = self.read(first), self.read(second)
                assert a == b, (f"{self.component_name}: two instances built with seed {self.seed} gave different "
                                f"{split} items on pass {pass_index}; the order must depend on the seed only")

    def test_default_split_is_train(self) -> None:
        cls = self.component_class()
        from areal_core.config.schema import RunConfig

        config = RunConfig()
        config.trainer.seed = self.seed
        options = cls.config_class(**self.options) if cls.config_class is not None else None
        default = cls.create(Context(config=config, options=options))
        assert self.read(default) == self.read(self.make_split("train")), (
            f"{self.component_name}: built without extras['split'] it must give the train split")

    def test_unknown_split_is_refused(self) -> None:
        with pytest.raises(ValueError, match="split"):
            self.read(self.make_split("test"))

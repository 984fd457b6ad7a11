"""Every config under examples/ validates, and the GSM8K-format example reads its local data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal_core.api import Context
from areal_core.config.validate import validate_run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_validate(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples name their data relative to the repository root
    run = validate_run(str(path), [])
    assert run.problems == []


def test_the_sync_example_is_the_demo_at_eta_zero():
    demo = validate_run(str(ROOT / "cli" / "areal_cli" / "demo.yaml"), []).resolved_dict()
    sync = validate_run(str(ROOT / "examples" / "demo_sync.yaml"), []).resolved_dict()
    assert sync["rollout"].pop("max_head_offpolicyness") == 0 and demo["rollout"].pop("max_head_offpolicyness") == 4
    assert sync.pop("trial") == "sync"
    demo.pop("trial")
    assert sync == demo


def test_the_gsm8k_example_reads_answers_after_the_hashes(monkeypatch):
    monkeypatch.chdir(ROOT)
    run = validate_run(str(ROOT / "examples" / "gsm8k_jsonl.yaml"), [])
    cls = run.components["dataset"]
    train = list(cls.create(Context(config=run.config, options=run.options["dataset"], extras={"split": "train"})))
    val = list(cls.create(Context(config=run.config, options=run.options["dataset"],
                                  extras={"split": "validation"})))
    assert (len(train), len(val)) == (200, 50)
    assert all(float(item["answer"]) == float(item["answer"]) for item in train + val)  # "#### " cut off
    assert "405" in {item["answer"] for item in train}  # row 0: "#### 405"
    assert "\\boxed{answer}" in train[0]["messages"][-1]["content"]
    assert not {i["id"] for i in train} & {i["id"] for i in val}

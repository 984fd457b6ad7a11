"""completions.jsonl (what the model wrote) and `areal samples`, on records made here; the real path, a run that
writes them, is tests/test_demo_run.py."""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from areal_cli.app import build_app
from areal_core.api.workflow import Trajectory
from areal_core.completions import append_records, completion_records, due, eval_item_records, read_records
from areal_core.plugins import get_plugin_manager
from areal_core.rollout.batch import EpisodeGroup


def group(seq: int, rewards: list[float], versions: tuple[int, int] = (3, 4)) -> EpisodeGroup:
    # prompt "ab" (not the policy's), then the policy's "cd" (two versions: interrupted by an update), tool "e",
    # policy "f"
    trajectories = [Trajectory(tokens=[97, 98, 99, 100, 101, 102], loss_mask=[0, 0, 1, 1, 0, 1],
                               logprobs=[0.0] * 6, versions=[-1, -1, versions[0], versions[1], -1, versions[1]],
                               reward=r, info={"method": "boxed", "tensor": object(), "nan": math.nan, "long": "x" * 900})
                    for r in rewards]
    return EpisodeGroup(seq, {"id": seq}, 2, trajectories, 0.0, 1.0)


def decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def test_records_split_prompt_and_completion_and_say_how_stale_each_sample_is():
    records = completion_records([group(7, [1.0, 0.0]), group(9, [0.5])], step=5, version=4, decode=decode,
                                 limit=8)
    assert [(r["item"], r["group"], r["sample"], r["reward"]) for r in records] == \
        [(7, 0, 0, 1.0), (7, 0, 1, 0.0), (9, 1, 0, 0.5)]
    first = records[0]
    assert (first["prompt"], first["completion"]) == ("ab", "cdef")  # tool text after the first policy token stays
    assert (first["prompt_tokens"], first["completion_tokens"]) == (2, 4)
    assert first["versions"] == [3, 4] and first["staleness"] == 1 and first["version"] == 4 and first["step"] == 5
    assert first["reward_info"]["method"] == "boxed" and "tensor" not in first["reward_info"]
    assert "nan" not in first["reward_info"] and first["reward_info"]["long"].endswith("...")
    json.dumps(records)  # every record is JSON
    assert len(completion_records([group(7, [1.0] * 5)] * 3, 5, 4, decode, limit=4)) == 4  # the cap
    no_text = completion_records([group(7, [1.0])], 5, 4, None, 8)[0]
    assert no_text["prompt"] is None and no_text["completion_tokens"] == 4
    assert [s for s in range(1, 10) if due(s, 3)] == [3, 6, 9] and not any(due(s, 0) for s in range(1, 10))


def test_areal_samples_shows_a_step_an_item_or_the_worst(tmp_path):
    for step in (1, 2, 3):
        append_records(tmp_path, completion_records([group(10 + step, [float(step) / 4, 1.0])], step, 4,
                                                    decode, 8))
    (tmp_path / "completions.jsonl").open("a").write('{"step": 4, "cut by a cr')  # a crash mid-line: skipped
    assert len(read_records(tmp_path / "completions.jsonl")) == 6
    app, _ = build_app(get_plugin_manager(refresh=True))

    def samples(*args):
        return CliRunner().invoke(app, ["samples", str(tmp_path), *args])

    latest = samples()
    assert latest.exit_code == 0 and latest.output.count("step 3 · item 13") == 2, latest.output
    assert "reward 0.75 (boxed) · staleness 1 (versions 3-4) · 4 tokens" in latest.output
    assert "completion: cdef" in latest.output and "prompt: ab" in latest.output
    worst = samples("--worst", "-n", "2", "--json")
    assert [json.loads(line)["reward"] for line in worst.output.splitlines()] == [0.25, 0.5]
    item = samples("--item", "12", "--json")
    assert {json.loads(line)["step"] for line in item.output.splitlines()} == {2}
    clipped = samples("--step", "1", "--chars", "2")
    assert "completion: cd... (2 more characters)" in clipped.output
    missing = samples("--step", "9")
    assert missing.exit_code == 1 and "no sample of step 9 was written; steps written: 1..3" in missing.output
    assert samples("--step", "1", "--worst").exit_code == 1
    (tmp_path / "older-run").mkdir()
    nothing = CliRunner().invoke(app, ["samples", str(tmp_path / "older-run")])
    assert nothing.exit_code == 1 and f"{tmp_path / 'older-run' / 'completions.jsonl'} does not exist" in \
        nothing.output and "metrics.completions_every > 0" in nothing.output


def test_eval_items_say_which_passed_and_what_each_sample_wrote():
    items = [{"id": "q1", "answer": "42", "messages": ["..."]}, {"answer": 7}, "plain item"]
    results = [group(0, [1.0, 0.0]).trajectories, None, RuntimeError("episode failed")]
    records = eval_item_records(results, items, success=1.0, decode=decode)
    assert [(r["index"], r["passed"], len(r["samples"])) for r in records] == [(0, True, 2), (1, False, 0),
                                                                               (2, False, 0)]
    assert records[0]["id"] == "q1" and records[0]["answer"] == "42" and records[0]["prompt"] == "ab"
    assert records[0]["samples"][1] == {"completion": "cdef", "reward": 0.0, "reward_info": {
        "method": "boxed", "long": "x" * 500 + "..."}, "completion_tokens": 4}
    assert records[1] == {"index": 1, "passed": False, "samples": [], "answer": 7}
    assert "prompt" not in records[2] and json.dumps(records)


def test_the_rewards_own_details_are_kept_flat_and_the_text_is_not_kept_twice():
    """rlvr puts the reward's details under info["reward_info"] and the texts under "prompt" / "completion"."""
    (t,) = group(1, [1.0]).trajectories
    t.info = {"id": "q1", "stop_reason": "stop", "prompt": "ab", "completion": "cdef",
              "reward_info": {"method": "boxed", "reason": "correct", "extracted": "42"}}
    (record,) = completion_records([EpisodeGroup(1, {}, 2, [t], 0.0, 1.0)], 3, 4, decode, 8)
    assert record["reward_info"] == {"id": "q1", "stop_reason": "stop", "method": "boxed", "reason": "correct",
                                     "extracted": "42"}

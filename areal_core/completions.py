"""What the model wrote: the trained samples' prompts and completions, as text, in ``completions.jsonl``.

Rank 0 of the trainer appends, every ``metrics.completions_every`` steps, up to ``metrics.completions_per_step``
trajectories of the batch it trained on (whole groups first, in the batch's order, so a group's samples can be
compared), one JSON line each::

    {"step": 12, "version": 11, "item": 305, "group": 0, "sample": 3,
     "prompt": "...", "completion": "...", "reward": 1.0, "reward_info": {"method": "boxed", ...},
     "prompt_tokens": 41, "completion_tokens": 17, "versions": [10, 11], "staleness": 1}

``versions`` is the oldest and newest policy version among the completion's tokens (a completion interrupted by
a weight update spans two), ``staleness`` the trained version minus the oldest. ``prompt`` is the text before the
policy's first token; ``completion`` everything after it (tool results of a multi-turn episode included). The text
is the tokenizer's decoding with special tokens kept (what the model saw). ``areal samples RUN`` shows them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Iterable

COMPLETIONS_FILE = "completions.jsonl"
EVAL_SAMPLES_FILE = "eval_samples.jsonl"  # the trainer's evaluations, one line per validation item


def _plain(value: Any) -> Any:
    """``value`` if JSON can hold it as is (finite numbers, short strings, booleans, None), else None."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value if len(value) <= 500 else value[:500] + "..."
    return None


def sample_text(t: Any, decode: Callable[[list[int]], str] | None) -> dict:
    """A trajectory's prompt (before the policy's first token) and completion (from it on) as text (None without
    ``decode``), their token counts, its reward and the reward's JSON-able details."""
    first = next((j for j, m in enumerate(t.loss_mask) if m), len(t.tokens))
    info = {k: v for k, v in (t.info or {}).items() if k not in ("prompt", "completion")}  # the text is above
    nested = info.pop("reward_info", None)  # what the reward said (rlvr keeps it there): its details, flattened
    if isinstance(nested, dict):
        info.update(nested)
    return {"prompt": decode(list(t.tokens[:first])) if decode else None,
            "completion": decode(list(t.tokens[first:])) if decode else None,
            "reward": _plain(float(t.reward)),
            "reward_info": {key: _plain(v) for key, v in info.items() if _plain(v) is not None},
            "prompt_tokens": first, "completion_tokens": len(t.tokens) - first}


def eval_item_records(results: list[Any], items: list[Any], success: float,
                      decode: Callable[[list[int]], str] | None) -> list[dict]:
    """Per validation item of one evaluation: its index, id and reference answer where the item has them,
    whether it passed (a sample reaching ``success``), and each sample's text and reward."""
    out = []
    for index, (item, result) in enumerate(zip(items, results)):
        samples = [] if isinstance(result, BaseException) or not result else result
        texts = [sample_text(t, decode) for t in samples]
        record = {"index": index, "passed": any((x["reward"] or 0.0) >= success for x in texts),
                  "samples": [{k: x[k] for k in ("completion", "reward", "reward_info", "completion_tokens")}
                              for x in texts]}
        if isinstance(item, dict):
            record.update({k: _plain(item[k]) for k in ("id", "answer") if k in item and _plain(item[k]) is not None})
        if texts:
            record["prompt"] = texts[0]["prompt"]
        out.append(record)
    return out


def completion_records(groups: Iterable[Any], step: int, version: int, decode: Callable[[list[int]], str] | None,
                       limit: int) -> list[dict]:
    """Up to ``limit`` records of the trajectories of ``groups`` (EpisodeGroups), in order; ``decode`` turns token
    ids into text (None: the text fields are None, the counts stay)."""
    out: list[dict] = []
    for k, group in enumerate(groups):
        for i, t in enumerate(group.trajectories):
            if len(out) >= limit:
                return out
            policy = [v for v, m in zip(t.versions, t.loss_mask) if m and v >= 0]
            out.append({"step": step, "version": version, "item": group.seq, "group": k, "sample": i,
                        **sample_text(t, decode),
                        "versions": [min(policy), max(policy)] if policy else [],
                        "staleness": version - min(policy) if policy else None})
    return out


TABLE_COLUMNS = ("step", "version", "item", "group", "sample", "prompt", "completion", "reward", "staleness",
                 "prompt_tokens", "completion_tokens", "reward_info")


def table_rows(records: Iterable[dict]) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows) of completion records as a tracker's table shows them: one row per sample, the reward's
    details as a JSON string (trackers' tables hold scalars and text)."""
    rows = []
    for record in records:
        row = [record.get(column) for column in TABLE_COLUMNS]
        row[-1] = json.dumps(record.get("reward_info"), sort_keys=True) if record.get("reward_info") else ""
        rows.append(row)
    return list(TABLE_COLUMNS), rows


def append_records(run_dir: Path, records: list[dict]) -> None:
    with open(Path(run_dir) / COMPLETIONS_FILE, "a", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_records(path: Path) -> list[dict]:
    """The complete records of a ``completions.jsonl`` (a line cut by a crash is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def due(step: int, every: int) -> bool:
    """Whether step ``step`` (1-based) writes its completions."""
    return every > 0 and step % every == 0

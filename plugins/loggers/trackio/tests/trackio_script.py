"""Run as a script by the tests, each time in a fresh process, because trackio reads ``TRACKIO_DIR`` once, when
it is imported. ``log RUN_DIR FIRST LAST``: steps FIRST..LAST through the MetricsLogger with loggers jsonl and
trackio; ``read PROJECT``: every run of the project (id, name, config, logged rows), as JSON on stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONFIG = {"experiment": "exp", "trial": "t1", "actor": {"backend": "fsdp", "optimizer": {"lr": 1e-6}}}


def log(run_dir: str, first: str, last: str) -> None:
    from areal_core.metrics import MetricsLogger

    with MetricsLogger.for_run(Path(run_dir), loggers=["jsonl", "trackio"], config=CONFIG, resume_step=int(first),
                               progress=False) as logger:
        assert [type(s).__name__ for s in logger.targets] == ["JsonlSink", "TrackioSink"], logger.targets
        for step in range(int(first), int(last) + 1):
            logger.log(step, {"reward/mean": step / 4, "train/loss": 1.0 / step, "rollout/accepted": step * 8,
                              "bad": float("nan"), "note": "text"})
        assert logger.disabled == []


def read(project: str) -> None:
    from trackio.sqlite_storage import SQLiteStorage

    runs = []
    for record in SQLiteStorage.get_run_records(project):
        rows = SQLiteStorage.get_logs(project, run_id=record["id"])
        config = SQLiteStorage.get_run_config(project, run_id=record["id"]) or {}
        runs.append({"id": record["id"], "name": record["name"],
                     "config": {k: v for k, v in config.items() if not k.startswith("_")},
                     "rows": [{k: v for k, v in row.items() if k != "timestamp"} for row in rows]})
    print(json.dumps(runs))


if __name__ == "__main__":
    {"log": log, "read": read}[sys.argv[1]](*sys.argv[2:])

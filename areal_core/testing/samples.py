"""For the tests of metrics loggers that show the trained samples as a table (``write_samples``): a table read
back from the tracker's own store agrees with the run's ``completions.jsonl``, column by column."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from areal_core.completions import COMPLETIONS_FILE, TABLE_COLUMNS, read_records


def assert_samples_table(run_dir: Path, step: int, table: list[dict[str, Any]]) -> None:
    """``table`` (one dict per row, as read back from the tracker) holds exactly the step's lines of
    ``completions.jsonl``, in order, every column equal (``reward_info`` as the JSON text of the record's)."""
    written = [r for r in read_records(Path(run_dir) / COMPLETIONS_FILE) if r["step"] == step]
    assert written, f"completions.jsonl has no line for step {step}"
    assert len(table) == len(written), (step, len(table), len(written))
    for row, record in zip(table, written):
        assert sorted(row) == sorted(TABLE_COLUMNS), sorted(row)
        for column in TABLE_COLUMNS:
            if column == "reward_info":
                assert (json.loads(row[column]) if row[column] else None) == (record.get(column) or None), column
            else:
                assert row[column] == record.get(column), (step, column, row[column], record.get(column))

"""The ``trackio`` metrics logger: each step's scalars to a Trackio run.

Trackio keeps every project in a local SQLite database under ``TRACKIO_DIR`` (default
``~/.cache/huggingface/trackio``; ``trackio show`` opens the dashboard over all of them); ``TRACKIO_SPACE_ID`` or
``TRACKIO_SERVER_URL`` send the run to a Hugging Face Space or a Trackio server instead, as trackio itself reads
them. The project is the run's ``experiment``, the run's name its ``trial``, its config the resolved run config.
``<run_dir>/trackio/areal-run.json`` records the project and name, so ``areal run --resume`` continues the same
Trackio run; a fresh start never appends to an older run of the same name. The trained samples' prompts and
completions (``completions.jsonl``) go to a table ``completions`` at their step.

trackio is imported when the logger is built, never when the plugin is listed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from areal_core.completions import table_rows
from areal_core.metrics import finite_scalars, import_for_logger, run_names

RUN_FILE = "areal-run.json"
TABLE_KEY = "completions"  # the table of trained samples (completions.jsonl's records)


class TrackioSink:
    """One Trackio run per areal run; ``write`` logs a step's finite scalars at that step."""

    def __init__(self, run_dir: str | os.PathLike[str], resume_step: int | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        trackio = import_for_logger("trackio", "trackio", "areal-plugin-trackio")
        self.run_dir = Path(run_dir)
        config = dict(config or {})
        marker = self.run_dir / "trackio" / RUN_FILE
        try:
            stored = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            stored = None
        if isinstance(stored, dict) and isinstance(stored.get("project"), str) and isinstance(stored.get("name"), str):
            self.project, self.name, resume = stored["project"], stored["name"], "allow"
        else:
            (self.project, self.name), resume = run_names(self.run_dir, config), "never"
        self._run = trackio.init(project=self.project, name=self.name, config=config, resume=resume)
        marker.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = getattr(self._run, "id", None)
        marker.write_text(json.dumps({"project": self.project, "name": self.name, "run_id": self.run_id}) + "\n",
                          encoding="utf-8")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(finite_scalars(metrics), step=int(step))

    def write_samples(self, step: int, records: list[dict]) -> None:
        """The step's samples as a Trackio table ``completions`` at that step."""
        import trackio

        columns, rows = table_rows(records)
        self._run.log({TABLE_KEY: trackio.Table(columns=columns, data=rows)}, step=int(step))

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.finish()

    def __repr__(self) -> str:
        return f"TrackioSink(project={self.project!r}, run={self.name!r})"

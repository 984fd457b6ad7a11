"""The ``wandb`` metrics logger: each step's scalars to a W&B run, offline unless ``WANDB_MODE`` says otherwise.

Offline (the default), the run is written to ``<run_dir>/wandb/offline-run-<time>-<id>/`` and ``wandb sync
<that folder>`` uploads it later; no account, key or network is needed while training. ``WANDB_MODE=online``
(with ``WANDB_API_KEY`` or ``wandb login``) logs live. The project is the run's ``experiment``, the run's name its
``trial``, its config the resolved run config; W&B's own variables (``WANDB_PROJECT``, ``WANDB_ENTITY``,
``WANDB_NAME``, ``WANDB_DIR``, ``WANDB_RUN_ID``, ``WANDB_TAGS``, ...) take precedence where set. The trained
samples' prompts and completions (``completions.jsonl``) go to a table ``completions`` at their step. The run's id is
kept in ``<run_dir>/wandb/areal-run-id``, so ``areal run --resume`` continues the same W&B run.

wandb is imported when the logger is built, never when the plugin is listed.
"""

from __future__ import annotations

import os
import re
import secrets
import string
from pathlib import Path
from typing import Any, Mapping

from areal_core.completions import table_rows
from areal_core.metrics import SinkError, finite_scalars, import_for_logger, run_names

ID_FILE = "areal-run-id"
TABLE_KEY = "completions"  # the table of trained samples (completions.jsonl's records), every completions_every steps
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def stored_run_id(run_dir: Path) -> str | None:
    """The W&B run id an earlier start of this run kept, if any (and well formed)."""
    try:
        text = (run_dir / "wandb" / ID_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return text if _ID.fullmatch(text) else None


def new_run_id() -> str:
    """Eight lowercase letters and digits, as W&B makes its own."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbSink:
    """One W&B run per areal run; ``write`` logs a step's finite scalars at that step."""

    def __init__(self, run_dir: str | os.PathLike[str], resume_step: int | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        wandb = import_for_logger("wandb", "wandb", "areal-plugin-wandb")
        self.run_dir = Path(run_dir)
        config = dict(config or {})
        experiment, trial = run_names(self.run_dir, config)
        (self.run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        run_id = os.environ.get("WANDB_RUN_ID") or stored_run_id(self.run_dir) or new_run_id()
        (self.run_dir / "wandb" / ID_FILE).write_text(run_id + "\n", encoding="utf-8")
        self.run_id = run_id
        kwargs: dict[str, Any] = {}
        for env, arg, value in (("WANDB_MODE", "mode", "offline"),
                                ("WANDB_PROJECT", "project", experiment),
                                ("WANDB_NAME", "name", trial),
                                ("WANDB_DIR", "dir", str(self.run_dir))):
            if not os.environ.get(env):
                kwargs[arg] = value
        try:
            self._run = wandb.init(
                id=run_id, resume="allow", config=config, reinit="create_new",
                # the trainer's output stays the trainer's (logs/): W&B does not wrap stdout / stderr
                settings=wandb.Settings(console="off"), **kwargs)
        except wandb.errors.AuthenticationError as e:
            raise SinkError(f"W&B refused the credentials: {e}",
                            "set WANDB_API_KEY (or run `wandb login`), or log offline (unset WANDB_MODE, or "
                            "WANDB_MODE=offline) and upload later with `wandb sync`") from e
        except wandb.errors.CommError as e:
            raise SinkError(f"W&B could not be reached: {e}",
                            "check the network and WANDB_BASE_URL, or log offline (unset WANDB_MODE, or "
                            "WANDB_MODE=offline) and upload later with `wandb sync`") from e
        self.folder = Path(self._run.dir).parent if getattr(self._run, "dir", None) else None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(finite_scalars(metrics), step=int(step))

    def write_samples(self, step: int, records: list[dict]) -> None:
        """The step's samples as a W&B table ``completions`` at that step (the run's page shows the latest, with
        a slider over the steps)."""
        import wandb

        columns, rows = table_rows(records)
        self._run.log({TABLE_KEY: wandb.Table(columns=columns, data=rows)}, step=int(step))

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.finish()
            # finish() returns once W&B's service has the run's end, not once it is on disk: stopping the
            # service waits for that, so the run folder is complete when the trainer exits
            import wandb

            wandb.teardown()

    def __repr__(self) -> str:
        return f"WandbSink(id={self.run_id!r}, {str(self.folder or self.run_dir)!r})"

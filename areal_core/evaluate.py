"""``areal eval``: a checkpoint (or a base model) scored on the validation split, as the trainer scores it.

What is evaluated (:func:`resolve_target`): a checkpoint folder
(``<run>/checkpoints/step-N``, its model in ``actor/``), a run folder (its
latest complete checkpoint), or a base model (a Hugging Face folder, a name an
installed plugin resolves, or ``demo`` for the built-in demo model).

How (:func:`evaluate`): the inference servers are started as ``areal run``
starts them (:class:`~areal_core.processes.fleet.InferenceServers`, on this
machine), serving the checkpoint's ``actor/`` folder as ``model.path`` (a LoRA
checkpoint's adapters merged into its base weights first); the validation
items, the workflow that samples them and the metrics are the trainer's own
(:class:`~areal_core.trainer_eval.Evaluation`,
:func:`~areal_core.trainer_eval.eval_metrics`), so a greedy ``areal eval`` of
a checkpoint gives the figures the trainer logged for that step.
:func:`write_report` writes ``eval.json`` atomically.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from areal_core.checkpoint import META_NAME, CheckpointDamagedError, CheckpointStore, verify

EVAL_FILE = "eval.json"
DEMO_MODEL = "demo"  # CHECKPOINT_OR_MODEL naming the built-in demo model (model.path: "")
ARG = "CHECKPOINT_OR_MODEL"
WHAT_TO_PASS = (f"pass a checkpoint folder (<output_dir>/<experiment>/<trial>/checkpoints/step-N), a run folder "
                f"(<output_dir>/<experiment>/<trial>: its latest checkpoint), a Hugging Face model folder "
                f"(config.json + *.safetensors), or '{DEMO_MODEL}' for the built-in demo model")


class EvalError(ValueError):
    """Input ``areal eval`` cannot evaluate; the message names the argument or key, the value and the fix."""


@dataclass
class Target:
    """What ``areal eval`` scores."""

    given: str  # as typed
    kind: str  # "checkpoint" or "model"
    model: str  # what the inference servers serve (model.path); "" = the built-in demo model
    checkpoint: Path | None = None
    run_dir: Path | None = None  # the run the checkpoint belongs to
    step: int = 0  # the checkpoint's step; 0 for a base model
    version: int | None = None  # the policy version the checkpoint holds
    lora: bool = False  # actor/ holds base weights + adapter/: merged before serving

    @property
    def run_config(self) -> Path | None:
        """The run's resolved config.yaml, when the checkpoint belongs to a run that has one."""
        path = self.run_dir / "config.yaml" if self.run_dir is not None else None
        return path if path is not None and path.is_file() else None


def _is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _checkpoint(folder: Path, given: str, verified: bool = False) -> Target:
    actor = folder / "actor"
    if not _is_model_folder(actor):
        raise EvalError(f"{ARG} {given!r} is a checkpoint folder, but its actor/ holds no Hugging Face model "
                        f"(config.json + *.safetensors): it was written by a train engine that saves another "
                        f"format. Fix: evaluate a checkpoint of a train engine that writes Hugging Face folders "
                        f"(fsdp, megatron), or convert actor/ into one and pass that folder")
    problems = [] if verified else verify(folder)  # a run folder's checkpoint was verified choosing it
    if problems:
        raise EvalError(f"{ARG} {given!r}: the checkpoint {folder} does not verify against its manifest, so it is "
                        f"not loaded: {'; '.join(problems[:3])}. Fix: restore it from a copy, or evaluate another "
                        f"checkpoint of the run (its run folder gives the newest one that verifies)")
    meta = json.loads((folder / META_NAME).read_text(encoding="utf-8"))
    run_dir = folder.parent.parent if folder.parent.name == "checkpoints" else None
    return Target(given, "checkpoint", str(actor), checkpoint=folder, run_dir=run_dir, step=int(meta["step"]),
                  version=meta.get("version"), lora=(actor / "adapter").is_dir())


def resolve_target(given: str) -> Target:
    """``CHECKPOINT_OR_MODEL`` as a :class:`Target`; :class:`EvalError` naming the fix when it is none."""
    if not given:
        raise EvalError(f"{ARG} is empty. Fix: {WHAT_TO_PASS}")
    try:
        path = Path(given).expanduser()
        is_dir, exists = path.is_dir(), path.exists()
    except (OSError, ValueError, RuntimeError) as exc:
        raise EvalError(f"{ARG} {given!r} cannot be read as a path ({exc}). Fix: {WHAT_TO_PASS}") from None
    if is_dir:
        path = path.resolve()
        if (path / META_NAME).is_file() and (path / "actor").exists():
            return _checkpoint(path, given)
        for store_root in (path / "checkpoints", path):  # a run folder, or its checkpoints/ folder
            try:  # the newest checkpoint that verifies
                latest, _passed = CheckpointStore(store_root).resumable()
            except CheckpointDamagedError as exc:
                raise EvalError(f"{ARG} {given!r}: {exc}") from None
            if latest is not None:
                return _checkpoint(latest, given, verified=True)
        if (path / "config.yaml").is_file():
            raise EvalError(f"{ARG} {given!r} is a run folder without a complete checkpoint (none under "
                            f"{path / 'checkpoints'}), so there is no trained model to evaluate. Fix: let the run "
                            f"save one (trainer.save_every; the last step is always saved), or evaluate its base "
                            f"model by passing model.path's folder (or '{DEMO_MODEL}')")
        if _is_model_folder(path):
            return Target(given, "model", str(path))
        raise EvalError(f"{ARG} {given!r} is a folder, but not a checkpoint (meta.json + actor/), a run folder "
                        f"(config.yaml + checkpoints/) nor a Hugging Face model folder (config.json + "
                        f"*.safetensors). Fix: {WHAT_TO_PASS}")
    if exists:
        raise EvalError(f"{ARG} {given!r} is a file, not a folder. Fix: {WHAT_TO_PASS}")
    if given == DEMO_MODEL:
        return Target(given, "model", "")
    from areal_core.config.validate import model_path_problems
    from areal_core.plugins import get_plugin_manager

    if model_path_problems(given, "auto", get_plugin_manager(), []):
        raise EvalError(f"{ARG} {given!r} does not exist, and no installed plugin knows it as a model name. "
                        f"Fix: {WHAT_TO_PASS}")
    return Target(given, "model", given)  # a name a plugin resolves (areal_resolve_model)


def merge_lora(actor: Path, out: Path) -> Path:
    """A Hugging Face folder in ``out`` with ``actor/adapter`` (PEFT) merged into ``actor``'s base weights, in
    the dtype of the files, with the tokenizer files beside it: what the inference servers load."""
    try:
        from peft import PeftModel
    except ImportError:
        raise EvalError(f"the checkpoint {actor.parent} holds LoRA adapters (actor/adapter), which areal eval "
                        f"merges into the base weights with PEFT, not installed here. Fix: pip install "
                        f"'peft>=0.13'") from None
    from transformers import AutoModelForCausalLM

    from areal_core.engine_kit.hf_folder import copy_side_files

    base = AutoModelForCausalLM.from_pretrained(str(actor), dtype="auto")
    merged = PeftModel.from_pretrained(base, str(actor / "adapter")).merge_and_unload()
    merged.save_pretrained(str(out))
    copy_side_files(actor, out)
    return out


def config_sha256(resolved: dict) -> str:
    """A digest of the resolved config evaluated (keys sorted), to tell evaluations of different configs apart."""
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()


def _engine(run: Any, index: int, address: str | None, log_dir: Path) -> Any:
    """Inference engine ``index`` as the trainer builds it (:meth:`areal_core.trainer.Trainer._rollout_side`)."""
    from areal_core.api import Context
    from areal_core.clock import REAL_CLOCK

    return run.components["rollout"].create(Context(
        config=run.config, options=run.options.get("rollout"), placement=run.placement("rollout"),
        extras={"server_index": index, "address": address, "same_node": True, "clock": REAL_CLOCK,
                "log_path": str(log_dir / f"eval-rollout-{index}.log")}))


def evaluate(run: Any, log_dir: Path, step: int = 0, say: Callable[[str], None] = print,
             per_item: list | None = None) -> dict[str, float]:
    """Score ``run.config``'s model: the trainer's :class:`~areal_core.trainer_eval.Evaluation` on inference
    servers started for it on this machine (their logs in ``log_dir``), all stopped again on return. Returns the
    ``eval/*`` metrics, ``eval/after_step`` = ``step``; ``per_item``, when given, receives each validation
    item's results (its samples' text and rewards, :func:`areal_core.completions.eval_item_records`).

    Raises :class:`EvalError` for ``eval.size`` 0, ``ProcessFailed`` / ``TimeoutError`` for a server that did
    not come up, ``RuntimeError`` for an item whose episode failed, ``TimeoutError`` (naming
    ``rollout.request_timeout_s``) for an evaluation that did not finish.
    """
    from areal_core.processes.fleet import InferenceServers
    from areal_core.processes.supervisor import Supervisor, split_threads
    from areal_core.rollout import RolloutController
    from areal_core.server_guard import ensure_run_token
    from areal_core.trainer import build, seed_everything
    from areal_core.trainer_eval import Evaluation

    cfg = run.config
    if cfg.eval.size == 0:
        raise EvalError("eval.size is 0: there is nothing to evaluate. Fix: eval.size=64 (validation items per "
                        "evaluation; the dataset's first ones)")
    seed_everything(cfg.trainer.seed)  # as the trainer's rank 0 (only sampled evaluations draw from it)
    reward = build(run, "reward")
    evaluation = Evaluation(run, reward, lambda: build(run, "dataset", split="validation"))  # items first: a
    # dataset without validation items is refused before any server starts
    ensure_run_token()  # the servers started here obey this process only
    servers = InferenceServers(run)
    with Supervisor(log_dir) as sup:
        if threading.current_thread() is threading.main_thread():
            sup.install_signal_handlers()  # Ctrl-C / SIGTERM stop the servers too
        if servers.servers:
            say(f"starting {len(servers.servers)} inference server(s) ({cfg.rollout.backend}, logs in {log_dir})")
        addresses = servers.start(sup, split_threads(len(servers.servers)), prefix="eval-rollout")
        engines = [_engine(run, i, addresses.get(i), log_dir) for i in range(run.placement("rollout").parallel.d)]
        controller = RolloutController(engines, evaluation.workflow, batch_size=1,
                                       request_timeout_s=cfg.rollout.request_timeout_s)
        controller.start()
        try:
            say(f"evaluating {len(evaluation.items)} validation items of {cfg.dataset.name!r}, "
                f"{cfg.eval.samples} sample(s) each at temperature {cfg.eval.temperature:g}")
            evaluation.start(controller, step)
            metrics = evaluation.collect(wait=True)
            if per_item is not None:
                per_item.extend(evaluation.last_items)
            return metrics
        finally:
            controller.close()


def report(target: Target, run: Any, metrics: dict[str, float], config_file: str, overrides: list[str],
           seconds: float, per_item: list | None = None) -> dict:
    """The contents of ``eval.json``."""
    cfg = run.config
    resolved = run.resolved_dict()
    resolved["model"]["path"] = target.model  # not the temporary folder a LoRA checkpoint is merged into
    k = cfg.eval.samples
    return {
        "evaluated": {"kind": target.kind, "path": str(target.checkpoint or target.given), "step": target.step,
                      "version": target.version, "model": target.model or DEMO_MODEL, "lora": target.lora},
        "config": {"file": config_file, "overrides": list(overrides), "sha256": config_sha256(resolved)},
        "dataset": {"name": cfg.dataset.name, "split": "validation"},
        "eval": {"size": cfg.eval.size, "samples": k, "temperature": cfg.eval.temperature,
                 "success": cfg.eval.success},
        "k": k, "pass@k": metrics["eval/accuracy"], "mean@k": metrics["eval/mean_at_k"],
        "reward_mean": metrics.get("eval/reward_mean"), "items": int(metrics["eval/items"]),
        "metrics": metrics,  # as the trainer logs them in metrics.jsonl
        "seconds": seconds,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "per_item": list(per_item or []),  # each validation item: passed, its samples' text and rewards
    }


def write_report(data: dict, out: Path) -> None:
    """``out`` appears whole or not at all (a temporary sibling renamed over it)."""
    from areal_core.engine_kit.hf_folder import write_json_atomic

    write_json_atomic(out, data)


class ServedModel:
    """The folder the servers load for ``target``: the checkpoint's actor/, or a LoRA checkpoint's merged
    weights in a temporary folder removed on exit."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._tmp: str | None = None

    def __enter__(self) -> str:
        if not self.target.lora:
            return self.target.model
        self._tmp = tempfile.mkdtemp(prefix="areal-eval-merged-")
        return str(merge_lora(Path(self.target.model), Path(self._tmp)))

    def __exit__(self, *exc: object) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

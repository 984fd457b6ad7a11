"""The trainer's evaluation: the policy scored on validation items, beside training (rank 0).

This part owns the validation items, the workflow that samples them
(``eval.samples`` per item at ``eval.temperature``), the one evaluation that
may be running (an evaluation runs on the rollout controller's engines while
training goes on, see :meth:`RolloutController.evaluate`) and the
``eval/*`` metrics it gives. ``areal eval`` (:mod:`areal_core.evaluate`)
scores a checkpoint or a base model with the same :class:`Evaluation` and
:func:`eval_metrics`, so its figures are the trainer's.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Any, Callable

from areal_core.api import Context
from areal_core.config.validate import ValidatedRun


class Evaluation:
    def __init__(self, run: ValidatedRun, reward: Any, validation: Callable[[], Any]) -> None:
        """``validation`` builds the dataset's validation split; it is called only when ``eval.size`` > 0."""
        self.cfg = run.config
        ev = self.cfg.eval
        self.items: list[Any] = []
        self._pending: tuple[Any, int, float] | None = None
        self.decode: Callable[[list[int]], str] | None = None
        # The last finished evaluation, per validation item (areal_core.completions.eval_item_records); with
        # samples_file set, each evaluation's is appended there too (the trainer's eval_samples.jsonl)
        self.last_items: list[dict] = []
        self.samples_file: Any = None
        if ev.size == 0:
            return
        self.items = list(itertools.islice(iter(validation()), ev.size))
        if not self.items:
            raise ValueError(f"eval.size is {ev.size} but dataset {self.cfg.dataset.name!r} has no validation "
                             f"items; give the dataset a validation split (docs/datasets.md) or set eval.size=0")
        r = self.cfg.rollout
        eval_cfg = replace(self.cfg, rollout=replace(
            r, group_size=ev.samples, sampling=replace(r.sampling, temperature=ev.temperature)))
        workflow_cls = run.components["workflow"]
        self.workflow = workflow_cls.create(Context(
            config=eval_cfg, options=run.options.get("workflow"), extras={"reward": reward}))
        tokenizer = getattr(self.workflow, "tokenizer", None)
        self.decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) \
            if callable(getattr(tokenizer, "decode", None)) else None

    def start(self, controller: Any, step: int) -> None:
        """Evaluate the policy the engines serve after ``step``, unless an evaluation is still running."""
        if self.items and self._pending is None:
            timeout = self.cfg.rollout.request_timeout_s
            pending = controller.evaluate(
                self.workflow, self.items, timeout_s=timeout,
                waited_for=f"the evaluation of {len(self.items)} validation items started after step {step} "
                           f"(rollout.request_timeout_s)")
            self._pending = (pending, step, time.monotonic())

    def collect(self, wait: bool) -> dict[str, float]:
        """The finished evaluation's metrics ({} while it runs, unless ``wait``)."""
        if self._pending is None:
            return {}
        pending, step, began = self._pending
        if not wait and not pending.done():
            return {}
        results = pending.result()
        self._pending = None
        metrics = eval_metrics(results, self.items, self.cfg.eval.success, step, time.monotonic() - began)
        from areal_core.completions import eval_item_records

        self.last_items = eval_item_records(results, self.items, self.cfg.eval.success, self.decode)
        if self.samples_file is not None:
            import json

            with open(self.samples_file, "a", encoding="utf-8") as f:
                for record in self.last_items:
                    f.write(json.dumps({"step": step, **record}, ensure_ascii=False) + "\n")
        return metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate for one item with ``c`` correct samples out of ``n`` (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code"): 1 - C(n-c, k) / C(n, k), the chance that ``k`` of
    the ``n`` samples drawn without replacement hold a correct one, in the paper's numerically stable product
    form. With ``k == n`` (how evaluation uses it: ``eval.samples`` samples, pass@``eval.samples``) it is 1 when
    any sample is correct, else 0."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def eval_metrics(results: list[Any], items: list[Any], success: float, step: int, seconds: float) -> dict[str, float]:
    """The ``eval/*`` metrics of one evaluation, for the trainer's metrics.jsonl and ``areal eval`` alike.

    ``eval/accuracy`` is pass@k (k = the samples per item, ``eval.samples``: an item counts when one of its
    samples reaches ``success``), ``eval/mean_at_k`` mean@k (the share of an item's samples that reach it,
    averaged over the items). ``results`` holds one entry per item: its trajectories, None (rejected by the
    workflow: counted wrong) or an exception (raised here with the item).
    """
    passed, means, rewards, lengths = 0.0, 0.0, [], []
    for item, result in zip(items, results):
        if isinstance(result, BaseException):
            raise RuntimeError(f"evaluation failed on validation item {str(item)[:80]}: "
                               f"{type(result).__name__}: {result}") from result
        trajectories = result or []
        item_rewards = [t.reward for t in trajectories]
        rewards += item_rewards
        lengths += [sum(t.loss_mask) for t in trajectories]
        n, c = len(item_rewards), sum(r >= success for r in item_rewards)
        if n:
            passed += pass_at_k(n, c, n)
            means += c / n
    out = {"eval/accuracy": passed / len(items), "eval/mean_at_k": means / len(items),
           "eval/items": float(len(items)), "eval/after_step": float(step), "eval/seconds": seconds}
    if rewards:
        out["eval/reward_mean"] = sum(rewards) / len(rewards)
        out["eval/completion_tokens_mean"] = sum(lengths) / len(lengths)
    return out

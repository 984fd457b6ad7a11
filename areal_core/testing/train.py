"""Conformance suite for train engines (entry-point group ``areal.engines.train``)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, ClassVar, Iterator

import pytest

from areal_core.testing.base import ComponentConformance, as_list, finite_number, requires


def neg_logprob_loss(logprobs: Any, entropy: Any, batch: dict) -> tuple[Any, dict]:
    """The simplest loss: mean negative log-likelihood of every token (supervised fine-tuning).

    Only ``-`` and ``.mean()`` are used, so it works on any tensor library.
    """
    return (-logprobs).mean(), {}


def masked_nll(logprobs: Any, entropy: Any, batch: dict) -> tuple[Any, dict]:
    """Token mean of ``-logprob`` over ``batch["loss_mask"]``, with the masked mean entropy as a stat: the
    loss an engine's own tests train with (it exercises the mask the trainer's batches carry)."""
    mask = batch["loss_mask"]
    return -(logprobs * mask).sum() / mask.sum(), {"entropy": (entropy * mask).sum() / mask.sum()}


def engine_run_config(spec: dict) -> Any:
    """A ``RunConfig`` for a train engine under test, from a spec of the keys tests vary: ``model`` (a folder),
    ``dtype``, ``mb_max_tokens``, ``lr``, ``weight_decay``, ``eps``, ``grad_clip``, ``gradient_checkpointing``;
    10 total steps. The spec is plain data, so a test can hand it to rank processes as JSON."""
    from areal_core.config.schema import RunConfig

    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype = spec["model"], spec.get("dtype", "float32")
    cfg.actor.mb_max_tokens = spec.get("mb_max_tokens", 8192)
    cfg.actor.gradient_checkpointing = spec.get("gradient_checkpointing", False)
    o = cfg.actor.optimizer
    o.lr, o.weight_decay = spec.get("lr", 1e-2), spec.get("weight_decay", 0.0)
    o.eps, o.grad_clip = spec.get("eps", 1e-8), spec.get("grad_clip", 1.0)
    cfg.trainer.total_steps = 10
    return cfg


def random_packed_batch(lengths: list[int], vocab: int, seed: int = 0, prompt: int = 2) -> dict:
    """A packed batch shaped as ``pack_groups`` makes it, of sequences of ``lengths`` random token ids below
    ``vocab`` (from 3: clear of the special ids), whose first ``prompt`` tokens are the prompt (loss mask 0);
    random behaviour logprobs and advantages, rewards alternating 0 / 1, two sequences per group. Plain lists,
    the same for the same arguments."""
    import random

    rng = random.Random(seed)
    out: dict = {k: [] for k in ("input_ids", "position_ids", "loss_mask", "logprobs", "versions", "advantages",
                                 "rewards", "group_index", "seq_lens")}
    cu = [0]
    for j, n in enumerate(lengths):
        out["input_ids"] += [rng.randrange(3, vocab) for _ in range(n)]
        out["position_ids"] += list(range(n))
        out["loss_mask"] += [int(i >= prompt) for i in range(n)]
        out["logprobs"] += [-rng.random() for _ in range(n)]
        out["versions"] += [0] * n
        out["advantages"] += [rng.uniform(-1, 1) for _ in range(n)]
        out["rewards"].append(float(j % 2))
        out["group_index"].append(j // 2)
        out["seq_lens"].append(n)
        cu.append(cu[-1] + n)
    out["cu_seqlens"] = cu
    return out


def check_two_steps(engine: Any, batch: dict, lrs: tuple[float, float], min_grad_norm: float = 0.0) -> None:
    """Two ``train_batch`` calls of :func:`masked_nll` on ``batch``, checked against what the first-party
    engines report: the first step's ``loss`` is the masked mean NLL of the weights it started from (read with
    ``forward_logprobs`` first), ``lr`` is ``lrs[0]`` then ``lrs[1]`` (the schedule), ``n_tokens`` and
    ``n_loss_tokens`` count the batch, ``grad_norm`` is above ``min_grad_norm``, no update is skipped, the
    entropy is reported, and the second step's loss is lower."""
    logprobs = as_list(engine.forward_logprobs(batch)["logprobs"])
    mask = as_list(batch["loss_mask"])
    expected = -sum(v for v, m in zip(logprobs, mask) if m) / sum(mask)
    first = engine.train_batch(batch, masked_nll)
    second = engine.train_batch(batch, masked_nll)
    assert first["loss"] == pytest.approx(expected, abs=1e-5), (first["loss"], expected)
    assert (first["lr"], second["lr"]) == pytest.approx(lrs)
    assert first["n_tokens"] == len(as_list(batch["input_ids"])) and first["n_loss_tokens"] == sum(mask)
    assert first["grad_norm"] > min_grad_norm and first["update_skipped"] == 0 and "entropy" in first
    assert second["loss"] < first["loss"], (first["loss"], second["loss"])


class TrainEngineConformance(ComponentConformance):
    """Runs forward and optimizer steps on a real engine instance.

    Set on the subclass: ``component_name``; override :meth:`make` (a tiny
    model, a high enough learning rate that two steps on one batch lower its
    loss) and :meth:`make_batch` (a packed batch: ``input_ids`` [T],
    ``position_ids`` [T], ``cu_seqlens`` [B+1], ``loss_mask`` [T], as the
    engine's tensors).

    Capabilities tested: ``save_load``, ``export_tensors``, ``export_beside_training``, ``minibatches``.
    """

    kind: ClassVar[str] = "train_engine"

    # -- for subclasses -----------------------------------------------------
    def make_batch(self) -> dict:
        pytest.fail(f"{type(self).__name__} must override make_batch() to return a packed batch")

    # -- helpers ------------------------------------------------------------
    @contextmanager
    def engine(self) -> Iterator[Any]:
        """An initialized engine, closed afterwards."""
        engine = self.make(self.component_class())
        engine.initialize()
        try:
            yield engine
        finally:
            engine.close()

    def logprobs(self, engine: Any, batch: dict) -> list[float]:
        """Per-token logprobs of ``batch``, checked for shape and sign."""
        out = engine.forward_logprobs(batch)
        assert isinstance(out, dict) and "logprobs" in out, (
            f"forward_logprobs returned {type(out).__name__} {list(out) if isinstance(out, dict) else ''}; "
            f"it must return a dict with 'logprobs'")
        values = as_list(out["logprobs"])
        n = len(as_list(batch["input_ids"]))
        assert len(values) == n, (f"forward_logprobs gave {len(values)} logprobs for {n} tokens; "
                                  f"it must give one per token of the packed batch")
        bad = [(i, v) for i, v in enumerate(values)
               if not isinstance(v, (int, float)) or not math.isfinite(v) or v > 1e-6]
        assert not bad, f"logprobs must be finite and <= 0; got (position, value) {bad[:8]}"
        return values

    def mean_nll(self, engine: Any, batch: dict) -> float:
        values = self.logprobs(engine, batch)
        return -sum(values) / len(values)

    # -- tests --------------------------------------------------------------
    def test_forward_logprobs_gives_one_logprob_per_token(self) -> None:
        with self.engine() as engine:
            self.logprobs(engine, self.make_batch())

    def test_train_batch_reports_a_finite_loss_and_bumps_the_version(self) -> None:
        with self.engine() as engine:
            before = engine.version
            stats = engine.train_batch(self.make_batch(), neg_logprob_loss)
            assert isinstance(stats, dict) and "loss" in stats, (
                f"train_batch returned {stats!r}; it must return a dict of stats with 'loss'")
            finite_number(stats["loss"], "train_batch stats['loss']")
            assert engine.version == before + 1, (
                f"version went from {before} to {engine.version} in one train_batch; it must rise by 1")

    def test_training_lowers_the_loss(self) -> None:
        with self.engine() as engine:
            batch = self.make_batch()
            before = self.mean_nll(engine, batch)
            engine.train_batch(self.make_batch(), neg_logprob_loss)
            engine.train_batch(self.make_batch(), neg_logprob_loss)
            after = self.mean_nll(engine, batch)
            assert after < before, (
                f"two steps of neg_logprob_loss on one batch moved its loss from {before} to {after}; "
                f"train_batch must step the optimizer on the loss_fn it is given (or raise the test "
                f"engine's learning rate)")

    @requires("minibatches")
    def test_minibatches_and_epochs_are_optimizer_steps_of_one_update(self) -> None:
        from areal_core.train_batches import MINIBATCH_KEY, UPDATE_STEP_KEY, assign_minibatches

        batch = self.make_batch()
        cu = [int(c) for c in as_list(batch["cu_seqlens"])]
        assert len(cu) > 2, "make_batch() must give at least two sequences for this test"
        batch[MINIBATCH_KEY] = assign_minibatches([b - a for a, b in zip(cu[:-1], cu[1:])], None, 2)
        seen: list[int] = []

        def loss(logprobs: Any, entropy: Any, mb: dict) -> tuple[Any, dict]:
            seen.append(int(mb[UPDATE_STEP_KEY]))
            return neg_logprob_loss(logprobs, entropy, mb)

        with self.engine() as engine:
            before = engine.version
            stats = engine.train_batch(batch, loss, epochs=2)
            assert engine.version == before + 1, (
                f"version went from {before} to {engine.version} in one train_batch of 2 mini-batches x 2 epochs; "
                f"an update is one version, whatever its optimizer steps")
            assert stats.get("n_optimizer_steps") == 4, (
                f"train_batch with 2 mini-batches and epochs=2 reported n_optimizer_steps="
                f"{stats.get('n_optimizer_steps')}; it must take 4 (areal_core.train_batches.update_plan)")
            assert sorted(set(seen)) == [0, 1, 2, 3], (
                f"loss_fn saw update_step values {sorted(set(seen))}; each micro-batch must carry the optimizer "
                f"steps already taken in the update (0 to 3 here)")
            finite_number(stats["loss"], "train_batch stats['loss']")

    @requires("save_load")
    def test_load_restores_the_saved_weights(self, tmp_path: Any) -> None:
        path = str(tmp_path / "checkpoint")
        with self.engine() as engine:
            batch = self.make_batch()
            engine.save(path)
            saved = self.logprobs(engine, batch)
            engine.train_batch(self.make_batch(), neg_logprob_loss)
            engine.load(path)
            loaded = self.logprobs(engine, batch)
        worst = max(abs(a - b) for a, b in zip(saved, loaded))
        assert worst <= 1e-6, (f"after save, train, load the logprobs differ from the saved state's by up to "
                               f"{worst}; load must restore the weights saved")

    @requires("export_tensors")
    def test_exported_tensors_are_copies_that_a_later_step_leaves_alone(self) -> None:
        # The trainer hands them to inference engines that may still read them while it trains on (eta > 0).
        import torch

        with self.engine() as engine:
            exported = [pair for bucket in engine.export_tensors(1 << 30) for pair in bucket]
            kept = {name: t.clone() for name, t in exported}
            engine.train_batch(self.make_batch(), neg_logprob_loss)
            after = dict(pair for bucket in engine.export_tensors(1 << 30) for pair in bucket)
        moved = [name for name, t in exported if not torch.equal(t, kept[name])]
        assert not moved, (f"a train_batch after export_tensors changed the exported {moved[:5]}: they are views "
                           f"of the engine's parameters; export_tensors must hand out copies")
        assert any(not torch.equal(after[name], kept[name]) for name in kept), (
            "train_batch left every exported weight as it was, so this test saw no update to guard against; "
            "raise the test engine's learning rate")

    @requires("export_into")
    def test_an_export_into_given_memory_writes_there_and_equals_an_ordinary_export(self) -> None:
        # The trainer exports straight into an inference engine's staging buffer; names it gives no memory for
        # (None) come back as the engine's own tensors.
        import torch

        with self.engine() as engine:
            plain = dict(pair for bucket in engine.export_tensors(1 << 30) for pair in bucket)
            skipped = sorted(plain)[0]
            given: dict[str, torch.Tensor] = {}

            def into(name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
                if name == skipped:
                    return None
                given[name] = torch.full(tuple(shape), float("nan")).to(dtype)
                return given[name]

            exported = dict(pair for bucket in engine.export_tensors(1 << 20, into=into) for pair in bucket)
        assert exported.keys() == plain.keys(), "an export with `into` must hand out the same names"
        assert given, ("export_tensors(into=...) never asked `into` for memory: an engine declaring 'export_into' "
                       "writes each tensor into what into(name, shape, dtype) gives")
        assert skipped not in given
        elsewhere = [name for name, t in given.items() if exported[name].data_ptr() != t.data_ptr()]
        assert not elsewhere, f"export_tensors(into=...) did not hand out the memory `into` gave for {elsewhere[:5]}"
        differ = [name for name, t in plain.items() if exported[name].dtype != t.dtype or
                  not torch.equal(exported[name].view(torch.uint8), t.view(torch.uint8))]
        assert not differ, f"export_tensors(into=...) wrote other values than an ordinary export for {differ[:5]}"

    @requires("export_beside_training")
    def test_an_export_read_on_another_thread_holds_the_next_optimizer_step(self) -> None:
        # The trainer reads the export on a background thread while this one trains on (eta > 0): the step
        # must wait until every bucket was read, so what the inference engines get is one version, whole.
        import threading

        import torch

        with self.engine() as engine:
            before = dict(pair for bucket in engine.export_tensors(1 << 30) for pair in bucket)
            stream = iter(engine.export_tensors(1))  # one tensor per bucket: many reads
            first = next(stream)
            done = threading.Event()
            step = threading.Thread(target=lambda: (engine.train_batch(self.make_batch(), neg_logprob_loss),
                                                    done.set()), daemon=True)
            step.start()
            ran_early = done.wait(0.5)
            rest = [pair for bucket in stream for pair in bucket]
            step.join(60)
            assert done.is_set(), "train_batch did not finish within 60 s after the export was read to the end"
        assert not ran_early, ("train_batch finished while an export_tensors() result was still being read; with "
                               "'export_beside_training' the optimizer step must wait until its last bucket is read")
        exported = dict(first + rest)
        torn = [name for name in before if not torch.equal(exported[name], before[name])]
        assert not torn, f"the export read beside train_batch mixed in weights after the step: {torn[:5]}"

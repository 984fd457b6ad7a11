"""One rank of a multi-process FSDPEngine scenario, started by ``run_ranks`` of test_fsdp_engine.py.

    python dist_worker.py SPEC.json       (RANK / WORLD_SIZE / MASTER_* in the environment)

SPEC names the model folder, dtype, mb_max_tokens, the batch and an output
folder; the rank runs the scenario of :func:`scenario` and rank 0 writes what
it saw to ``<out>/result.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from areal_core.api import Context
from areal_core.testing.ranks import rank_main
from areal_core.testing.train import engine_run_config, masked_nll
from areal_fsdp.engine import FSDPEngine, FSDPEngineConfig


def make_engine(spec: dict) -> FSDPEngine:
    cfg = engine_run_config(spec)
    placement = None
    if spec.get("allocation"):
        from areal_core.config.allocation import parse_allocation

        (placement,) = parse_allocation(spec["allocation"]).components
    engine = FSDPEngine(Context(config=cfg, options=FSDPEngineConfig(**spec.get("options", {})), placement=placement,
                                extras={"role": spec.get("role", "actor")}))
    engine.initialize()
    return engine


def scenario(engine: FSDPEngine, batch: dict, out: str, resume_from: str | None = None) -> dict:
    """forward, train, forward, export, save, train, load, train, export: what each step gave."""
    seen: dict = {}
    if resume_from:
        engine.load(resume_from)
        seen["resumed_version"] = engine.version
        engine.train_batch(batch, masked_nll)
        seen["after_resume"] = engine.forward_logprobs(batch)["logprobs"]
        return seen
    seen["lp0"] = engine.forward_logprobs(batch)
    seen["stats1"] = engine.train_batch(batch, masked_nll)
    seen["lp1"] = engine.forward_logprobs(batch)["logprobs"]
    engine.export_to_disk(os.path.join(out, "export"))
    engine.save(os.path.join(out, "ckpt"))
    engine.train_batch(batch, masked_nll)
    seen["lp2"] = engine.forward_logprobs(batch)["logprobs"]
    engine.load(os.path.join(out, "ckpt"))
    seen["loaded_version"] = engine.version
    seen["lp_loaded"] = engine.forward_logprobs(batch)["logprobs"]
    engine.train_batch(batch, masked_nll)
    seen["lp2_after_load"] = engine.forward_logprobs(batch)["logprobs"]
    engine.export_to_disk(os.path.join(out, "export2"))  # after two steps (one before the save, one after the load)
    return seen


def short_scenario(engine: FSDPEngine, batch: dict) -> dict:
    """forward, train, forward on a batch that may leave ranks without a sequence of their own."""
    seen = {"lp0": engine.forward_logprobs(batch)["logprobs"], "stats": engine.train_batch(batch, masked_nll)}
    seen["lp1"] = engine.forward_logprobs(batch)["logprobs"]
    return seen


def tensors_scenario(engine: FSDPEngine, batch: dict, out: str, bucket_bytes: int, repeats: int = 1) -> dict:
    """train, then export the weights as tensor buckets and to disk: what each gave (rank 0's buckets).

    ``repeats`` > 1 exports that many times more (each bucket checked equal to the first export's): async
    all-gathers over gloo corrupted the heap within ~30 exports, one at a time never.
    """
    engine.train_batch(batch, masked_nll)
    buckets = [[(name, t.clone()) for name, t in bucket] for bucket in engine.export_tensors(bucket_bytes)]
    for _ in range(repeats - 1):
        again = [[(name, t.clone()) for name, t in bucket] for bucket in engine.export_tensors(bucket_bytes)]
        assert len(again) == len(buckets) and all(
            [n for n, _ in a] == [n for n, _ in b] and all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))
            for a, b in zip(again, buckets)), "an export of unchanged weights differs from the first"
    engine.export_to_disk(os.path.join(out, "export"))
    return {"buckets": buckets, "n_buckets": len(buckets), "lp1": engine.forward_logprobs(batch)["logprobs"]}


def spy_on_context_attention(seen: dict) -> None:
    """Route the context-parallel attention through a spy that records what its first call was handed (query and
    key types and shapes, the row length, the ranks of the all-gather's group), then runs it unchanged."""
    from areal_fsdp import context
    from areal_fsdp.attention import register_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        shard = kwargs[context.SHARD]
        seen.setdefault("attention", {
            "types": (type(query).__name__, type(key).__name__), "heads": query.shape[1], "kv_heads": key.shape[1],
            "tokens": query.shape[2], "row": shard.length, "cp_group": dist.get_process_group_ranks(shard.group)})
        return context.cp_sdpa(module, query, key, value, attention_mask, **kwargs)

    register_attention(context.CP_SDPA, spy)


def run(spec: dict) -> None:
    engine = make_engine(spec)
    spied: dict = {}
    if engine.cp > 1:
        spy_on_context_attention(spied)
    if spec.get("scenario") == "short":
        seen = short_scenario(engine, spec["batch"])
    elif spec.get("scenario") == "tensors":
        seen = tensors_scenario(engine, spec["batch"], spec["out"], spec["bucket_bytes"], spec.get("repeats", 1))
        seen["n_buckets_per_rank"] = [None] * dist.get_world_size()
        dist.all_gather_object(seen["n_buckets_per_rank"], seen["n_buckets"])
    else:
        seen = scenario(engine, spec["batch"], spec["out"], spec.get("resume_from"))
    seen.update(spied)
    seen["plan"] = engine._plan(spec["batch"])  # rank 0's micro-batches (sequence indices), and their tokens
    seen["mb_tokens"] = [sum(spec["batch"]["seq_lens"][i] for i in seqs) for seqs in seen["plan"]]
    layer = engine.lm.get_decoder().layers[0]
    seen["layout"] = {name: str(getattr(module.weight, "placements", None)) for name, module in (
        ("q_proj", layer.self_attn.q_proj), ("o_proj", layer.self_attn.o_proj),
        ("embed", engine.lm.get_input_embeddings()))}
    if dist.get_rank() == 0:
        torch.save(seen, os.path.join(spec["out"], "result.pt"))
    engine.close()


if __name__ == "__main__":
    sys.exit(rank_main(run, sys.argv[1]))

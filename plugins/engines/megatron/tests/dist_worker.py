"""One rank of a multi-process MegatronEngine scenario, started by test_megatron_engine.py.

    python dist_worker.py SPEC.json       (RANK / WORLD_SIZE / MASTER_* in the environment)

SPEC names the model folder, the allocation (``megatron:t2``, ``megatron:d2``,
``megatron:p2``), ``actor.virtual_pipeline_size`` (``vpp``), the batch, the
optimizer settings, an output folder and whether to build a reference engine
too; every rank runs :func:`scenario` and writes what it saw to
``<out>/result<rank>.pt``.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from areal_core.api import Context  # noqa: E402
from areal_core.config.allocation import parse_allocation  # noqa: E402
from areal_core.testing.ranks import rank_main  # noqa: E402
from areal_core.testing.train import engine_run_config, masked_nll as nll  # noqa: E402
from areal_megatron.engine import MegatronEngine, MegatronEngineConfig  # noqa: E402


BUCKET_BYTES = 64 * 1024


def make_engine(spec: dict) -> MegatronEngine:
    cfg = engine_run_config(spec)
    (placement,) = parse_allocation(spec.get("allocation", "megatron:cpu")).components
    engine = MegatronEngine(Context(config=cfg, options=MegatronEngineConfig(virtual_pipeline_size=spec.get("vpp", 1)),
                                    placement=placement,
                                    extras={"role": spec.get("role", "actor")}))
    engine.initialize()
    return engine


def scenario(engine: MegatronEngine, batch: dict, out: str) -> dict:
    """forward, train, forward, export, save, train, load, forward: what each step gave."""
    seen: dict = {"lp0": engine.forward_logprobs(batch)}
    seen["stats1"] = engine.train_batch(batch, nll)
    seen["lp1"] = engine.forward_logprobs(batch)["logprobs"]
    engine.export_to_disk(os.path.join(out, "export"))
    engine.save(os.path.join(out, "ckpt"))
    seen["stats2"] = engine.train_batch(batch, nll)
    seen["lp2"] = engine.forward_logprobs(batch)["logprobs"]
    engine.load(os.path.join(out, "ckpt"))
    seen["loaded_version"] = engine.version
    seen["lp_loaded"] = engine.forward_logprobs(batch)["logprobs"]
    engine.train_batch(batch, nll)
    seen["lp2_after_load"] = engine.forward_logprobs(batch)["logprobs"]
    seen["buckets"] = [{name: t.clone() for name, t in bucket} for bucket in engine.export_tensors(BUCKET_BYTES)]
    return seen


def run(spec: dict) -> None:
    engine = make_engine(spec)
    seen = scenario(engine, spec["batch"], spec["out"])
    if spec.get("reference"):
        # A frozen copy beside the actor, as the trainer builds it for KL: same ranks, same parallel state.
        reference = make_engine({**spec, "role": "reference"})
        seen["reference_lp"] = reference.forward_logprobs(spec["batch"])["logprobs"]
        reference.close()
    torch.save(seen, os.path.join(spec["out"], f"result{dist.get_rank()}.pt"))
    engine.close()


if __name__ == "__main__":
    sys.exit(rank_main(run, sys.argv[1]))

"""Weight export time of the fsdp train engine: a safetensors folder on disk vs tensors in memory.

    .venv/bin/python benchmarks/weight_sync.py [--model DIR] [--dtype bfloat16|float32] [--repeats 3]
                                               [--bucket-mb 256]

Model: ``--model`` (an HF folder), else a random Llama with SmolLM2-135M's
shapes (30 layers, hidden 576, 9 / 3 heads, MLP 1536, vocab 49,152, tied
embeddings; 134.5 M parameters) written to a temporary folder: the timings
depend on the shapes, not on the values.

One ``FSDPEngine`` (world size 1, CPU, float32 master weights) exports its
weights in ``--dtype`` (what ``model.dtype`` makes it send), three ways:

- disk: ``export_to_disk`` (what ``rollout.weight_sync: disk`` does each step),
  a folder per version written atomically under a temporary folder on disk;
- tensors: ``export_tensors(bucket)`` consumed into a list (the gather and
  cast, what ``rollout.weight_sync: tensors`` does before the pause);
- tensors + shm: the same, then the hand-over the embedded engine
  (``areal_local``) makes of them: one safetensors file in ``/dev/shm``,
  rewritten in place per version (``areal_local.shm.WeightStage``), and, for
  comparison, the way it was done before: a fresh folder and ``save_file``
  per version.

Each line is the median of ``--repeats`` runs after one warm-up; the ratio is
disk / that way. The receiving side (the server loading the weights) is the
same file read for both and is not timed here. No pass / fail.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
                    rms_norm_eps=1e-5, rope_theta=100000.0)


def random_smollm2_shaped(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).save_pretrained(folder)
    return folder


def make_engine(path: Path, dtype: str):
    from areal_core.api import Context
    from areal_core.config.schema import RunConfig
    from areal_fsdp.engine import FSDPEngine, FSDPEngineConfig

    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype = str(path), dtype
    engine = FSDPEngine.create(Context(config=cfg, options=FSDPEngineConfig(), extras={"role": "actor"}))
    engine.initialize()
    return engine


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model folder (default: a random SmolLM2-135M-shaped Llama)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=256)
    args = parser.parse_args()
    from safetensors.torch import save_file
    from areal_local.shm import WeightStage

    with tempfile.TemporaryDirectory(prefix="areal-weight-sync-") as tmp:
        tmp = Path(tmp)
        path = Path(args.model) if args.model else random_smollm2_shaped(tmp / "model")
        engine = make_engine(path, args.dtype)
        n_params = sum(p.numel() for p in engine.lm.parameters())
        bucket = args.bucket_mb * 1024**2
        counter = iter(range(10**6))

        def disk() -> None:
            folder = tmp / "weights" / f"v{next(counter):06d}"
            engine.export_to_disk(str(folder))
            shutil.rmtree(folder)  # the trainer keeps two versions; the write is what is timed

        def tensors() -> list:
            return [pair for b in engine.export_tensors(bucket) for pair in b]

        def tensors_shm_fresh() -> None:
            # What areal_local did before its in-place stage: a new /dev/shm folder and save_file per version.
            root = "/dev/shm" if Path("/dev/shm").is_dir() else None
            with tempfile.TemporaryDirectory(prefix="areal-weights-", dir=root) as folder:
                save_file({n: t.contiguous() for n, t in tensors()}, str(Path(folder) / "model.safetensors"))

        shm_stage = WeightStage()

        def tensors_shm() -> None:
            shm_stage.write(tensors(), next(counter))

        sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in engine.export_tensors(bucket)]
        print(f"model: {'--model ' + str(path) if args.model else 'random SmolLM2-135M-shaped Llama'}, "
              f"{n_params / 1e6:.1f} M parameters, exported in {args.dtype} ({sum(sizes) / 2**20:.0f} MiB, "
              f"{len(sizes)} bucket(s) of at most {args.bucket_mb} MiB); torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads; median of {args.repeats}")
        base = timed(disk, args.repeats)
        print(f"  disk (export_to_disk)          {base:7.3f} s")
        for name, fn in (("tensors (export_tensors)", tensors), ("tensors + /dev/shm, fresh file", tensors_shm_fresh),
                         ("tensors + /dev/shm, in place", tensors_shm)):
            t = timed(fn, args.repeats)
            print(f"  {name:30s} {t:7.3f} s   disk / this = {base / t:5.2f}x")
        shm_stage.close()
        engine.close()


if __name__ == "__main__":
    main()

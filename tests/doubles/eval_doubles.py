"""A reward test double for ``tests/test_eval_command.py``: it scores a completion by its exact text, so two
evaluations give the same mean reward only when they generated the same completions. Never shipped."""

from __future__ import annotations

import zlib


def text_digest_reward_double(prompt, completion, item):
    """One of 0.0, 0.1, ..., 1.0, drawn from the completion's CRC-32: any changed character may change it."""
    return (zlib.crc32(completion.encode("utf-8")) % 11) / 10

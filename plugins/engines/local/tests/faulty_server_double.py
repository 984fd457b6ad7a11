"""Test double: the embedded engine's real server with a loader bug, for the integrity gate's tests.

``python faulty_server_double.py FAULT_FILE <areal_local.server arguments>`` runs
:func:`areal_local.server.main` with ``Generator.load_state_dict`` wrapped: at every load it reads FAULT_FILE
(empty or missing: no fault) and, after loading as usual, breaks the weights the way it names:

- ``permute:NAME``: tensor NAME's rows are reversed (a layout bug);
- ``skip:PREFIX``: the tensors whose names start with PREFIX keep their old values (a bucket skipped).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from areal_local import server
from areal_local.generator import Generator

FAULT_FILE = Path(sys.argv.pop(1))
_load = Generator.load_state_dict


def faulty_load(self, state_dict, *, strict: bool = True, adopt: bool = False) -> None:
    fault = FAULT_FILE.read_text().strip() if FAULT_FILE.exists() else ""
    kind, _, target = fault.partition(":")
    if kind == "skip":
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith(target)}
        strict = False
    _load(self, state_dict, strict=strict, adopt=adopt)
    if kind == "permute":
        self.own_all()  # weights served from a read-only stage slot are copied out before the double writes
        with torch.no_grad():
            weight = self.model.state_dict()[target]
            weight.copy_(weight.flip(0))


Generator.load_state_dict = faulty_load

if __name__ == "__main__":
    server.main()

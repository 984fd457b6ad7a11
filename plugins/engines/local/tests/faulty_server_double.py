"""Test double: the embedded engine's real server with a loader bug, for the integrity gate's tests.

``python faulty_server_double.py FAULT_FILE <areal_local.server arguments>`` runs
:func:`areal_local.server.main` with ``Generator.load_state_dict`` wrapped: at every load it reads FAULT_FILE
(empty or missing: no fault) and breaks the weights it loads the way it names:

- ``permute:NAME``: tensor NAME's rows are reversed on the way in (a layout bug);
- ``skip:PREFIX``: the tensors whose names start with PREFIX keep their old values (a bucket skipped).
"""

from __future__ import annotations

import sys
from pathlib import Path

from areal_local import server
from areal_local.generator import Generator

FAULT_FILE = Path(sys.argv.pop(1))
_load = Generator.load_state_dict


def faulty_load(self, state_dict, *, strict: bool = True, adopt: bool = False, beside=None) -> None:
    fault = FAULT_FILE.read_text().strip() if FAULT_FILE.exists() else ""
    kind, _, target = fault.partition(":")
    if kind == "skip":
        state_dict = {k: v for k, v in state_dict.items() if not k.startswith(target)}
        strict = False
    if kind == "permute" and target in state_dict:  # a loader that reorders one tensor's rows on the way in
        state_dict = {**state_dict, target: state_dict[target].flip(0)}
    _load(self, state_dict, strict=strict, adopt=adopt, beside=beside)


Generator.load_state_dict = faulty_load

if __name__ == "__main__":
    server.main()

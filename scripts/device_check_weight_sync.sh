#!/usr/bin/env bash
# The weight path's CUDA checks (issue 26), for a GPU machine lent to a session: an image with torch and triton
# but none of areal's other dependencies and no network.
#
#   bash scripts/device_check_weight_sync.sh --prepare   # here, with the package registries: fills .whl/ (areal's
#                                                        # wheels and the cp312 wheels the image lacks) and .device/
#                                                        # (SGLang's standalone GPU-hash kernel file); both ignored
#   bash scripts/device_check_weight_sync.sh             # there (carry .whl and .device); log in $OUT/log
#
# There it installs the wheels into the image's Python and runs, each whatever the others gave:
#   1. SGLang's compiled GPU tensor hash against the known answers, and areal's numpy / torch ports against it
#      (plugins/engines/sglang/tests/gpu_hash_vectors.py --cuda) and the sglang plugin's digest tests;
#   2. the fsdp engine on the GPU (tests/test_fsdp_cuda.py): against the CPU engine, the export from CUDA into CPU
#      memory it is given (bit for bit, digests equal), and `areal run` training on the GPU with the embedded engine
#      on the CPU, weights through /dev/shm, deltas on, the integrity gate and the parity probe at every update.
# Exit status: the number of the steps above that failed.
set -u
cd "$(dirname "$0")/.."

SGLANG_VERSION=0.5.23
# What `areal run` with the local and fsdp engines needs that the image lacks, at the versions scripts/install.sh
# resolved here (cp312: the image's Python)
DEPS=(stevedore==5.10.0 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 tensorboardX==2.6.5 fastapi==0.165.0
      starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7
      typing-inspection==0.4.5 uvicorn==0.54.0 typing_extensions==4.16.0 opentelemetry-api==1.45.2
      importlib_metadata==9.1.0 zipp==4.1.2)
PACKAGES=(. plugins/engines/local plugins/engines/fsdp plugins/engines/sglang plugins/algorithms/ppo
          plugins/workflows/rlvr plugins/datasets/tasks)

if [[ "${1:-}" == "--prepare" ]]; then
    set -e
    PY=${PYTHON:-.venv/bin/python}
    rm -rf .whl && mkdir -p .whl .device
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$p"); done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "${DEPS[@]}"
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "${PACKAGES[@]}"
    tmp=$(mktemp -d)
    "$PY" -m pip download -q --no-deps "sglang==$SGLANG_VERSION" -d "$tmp"
    unzip -o -q "$tmp"/sglang-"$SGLANG_VERSION"-*.whl 'sglang/kernels/ops/memory/gpu_tensor_hash.py' -d .device
    rm -rf "$tmp"
    du -sh .whl .device
    exit 0
fi

OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/log") 2>&1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', \
triton.__version__, 'cuda', torch.cuda.is_available())"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 100
failed=0
step() {  # step NAME TIMEOUT_S COMMAND...: run it, time it, count a failure
    local name=$1 limit=$2 began=$SECONDS
    shift 2
    echo "=== $name"
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: rc $rc in $((SECONDS - began)) s"
    [[ $rc == 0 ]] || failed=$((failed + 1))
}
step "SGLang GPU hash: kernel vs known answers and areal's ports" 120 \
    env PYTHONPATH=plugins/engines/sglang python3 plugins/engines/sglang/tests/gpu_hash_vectors.py \
    --cuda .device/sglang/kernels/ops/memory/gpu_tensor_hash.py
step "sglang plugin digest tests (torch port on CUDA)" 120 \
    python3 -m pytest -q -p no:cacheprovider plugins/engines/sglang/tests/test_sglang_weight_digest.py
step "fsdp on the GPU: parity, export into CPU memory, areal run with the gate" 420 \
    python3 -m pytest -q -p no:cacheprovider -rA --durations=0 plugins/engines/fsdp/tests/test_fsdp_cuda.py
echo "=== steps failed: $failed"
exit "$failed"

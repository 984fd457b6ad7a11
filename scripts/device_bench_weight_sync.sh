#!/usr/bin/env bash
# Device run: benchmarks/weight_sync.py --whole-path-only on a GPU machine's host cores, the embedded server's
# packed-copy rebuild in the background vs in the foreground, alternated. Prepare here with
# `bash scripts/device_check_weight_sync.sh --prepare` and carry .whl; the log comes back as $OUT/bench.log.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/device-bench}
mkdir -p "$OUT"
exec > >(tee "$OUT/bench.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 100
nproc; lscpu | grep -E "Model name|Flags" | cut -c1-200
python3 - <<'PY' || exit 101
import shutil, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from weight_sync import random_smollm2_shaped
from areal_core.testing import tiny_model
model = random_smollm2_shaped(Path("/tmp/smollm2-shaped"))
tok = tiny_model("/tmp/tok", vocab_size=512)
for f in tok.iterdir():
    if "token" in f.name or f.name == "special_tokens_map.json":
        shutil.copy(f, model / f.name)
print("model at", model, sorted(p.name for p in model.iterdir()))
PY
for round in 1 2; do
  for mode in foreground background; do
    echo "=== round $round, rebuild $mode"
    timeout 240 python3 benchmarks/weight_sync.py --model /tmp/smollm2-shaped --dtype float32 --repeats 5 \
        --whole-path-only --rebuild $mode 2>&1 | grep -v "Loading weights"
  done
done

#!/usr/bin/env bash
# The one-GPU recipe's shape (examples/gpu/gsm8k_qwen2.5-0.5b_1gpu.yaml) with a tiny model, for a GPU machine lent
# to a session (issue 41, part 3): its keys as written (GRPO, decoupled PPO, the math reward, bf16, gradient
# checkpointing, the GSM8K-format files, dynamic filtering, eta 2), 3 steps, the trainer on the GPU. The device
# image has torch and triton but no vLLM and no network (and a vLLM wheel is over the 64 MiB a call carries), so
# the embedded engine serves instead of vLLM (allocation local:cpu+fsdp:d1); everything else is the recipe's.
#
#   bash scripts/device_check_recipe_1gpu.sh --prepare   # here: .whl/ (areal's wheels and the cp312 wheels the
#                                                        # image lacks, as scripts/device_check_weight_sync.sh
#                                                        # --prepare, plus the math reward's)
#   bash scripts/device_check_recipe_1gpu.sh --cpu       # here, first: the same run with the trainer on the CPU
#   bash scripts/device_check_recipe_1gpu.sh             # there (carry .whl); log and metrics in $OUT
#
# Exit status: 0 when the run finished its 3 steps with finite losses and a checkpoint; the reason otherwise.
set -u
cd "$(dirname "$0")/.."

MATH_DEPS=(math-verify==0.9.0 latex2sympy2_extended==1.11.0 pebble==5.2.3)

if [[ "${1:-}" == "--prepare" ]]; then
    set -e
    bash scripts/device_check_weight_sync.sh --prepare
    PY=${PYTHON:-.venv/bin/python}
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "${MATH_DEPS[@]}"
    "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl plugins/rewards/math
    du -sh .whl
    exit 0
fi

OUT=${OUT:-/tmp/device-recipe}
mkdir -p "$OUT"
exec > >(tee "$OUT/log") 2>&1
export PYTHONUNBUFFERED=1
if [[ "${1:-}" == "--cpu" ]]; then
    PY=${PYTHON:-.venv/bin/python}
    AREAL=$(dirname "$PY")/areal
    allocation="local:cpu+fsdp:d1@cpu"
    dtype=float32  # bf16 matmuls on this CPU are the slow path; the GPU run uses the recipe's bf16
else
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 100
    PY=python3
    AREAL="python3 -m areal_cli.app"
    allocation="local:cpu+fsdp:d1"
    dtype=bfloat16
fi
"$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"

work=$(mktemp -d)
# A tiny Qwen2-shaped model with the repository's chat template (areal_core.testing.tiny_model), its weights random.
"$PY" -c "from areal_core.testing.models import tiny_model; tiny_model('$work/tiny', seed=0)" || exit 101
began=$SECONDS
# The recipe as written, but: the tiny model and the repository's GSM8K-format files (no hub here), the embedded
# engine in place of vLLM, 3 steps of 2 groups of 4, replies of at most 64 tokens, a short evaluation.
# vLLM's own keys (its memory share and context length) leave with vLLM: the embedded engine has neither
grep -v -e 'gpu_memory_utilization:' -e 'max_model_len:' examples/gpu/gsm8k_qwen2.5-0.5b_1gpu.yaml > "$work/recipe.yaml"
timeout 540 $AREAL run "$work/recipe.yaml" \
    output_dir="$work/runs" model.path="$work/tiny" model.dtype=$dtype allocation=$allocation \
    rollout.backend=local rollout.batch_size=2 rollout.group_size=4 rollout.sampling.max_new_tokens=64 \
    rollout.dynamic_filtering=false \
    dataset.path=examples/data/gsm8k_format_train.jsonl dataset.validation_path=examples/data/gsm8k_format_val.jsonl \
    trainer.total_steps=3 trainer.save_every=3 eval.size=4 eval.every=3
rc=$?
echo "=== areal run: rc $rc in $((SECONDS - began)) s"
run_dir=$(ls -d "$work"/runs/*/* 2>/dev/null | head -n 1)
[[ -n "$run_dir" ]] && cp "$run_dir/metrics.jsonl" "$run_dir/config.yaml" "$OUT/" 2>/dev/null
[[ $rc == 0 ]] || exit "$rc"
"$PY" - "$run_dir" <<'PY' || exit 102
import json, math, sys
from pathlib import Path
run = Path(sys.argv[1])
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
steps = [r for r in rows if "train/loss" in r]
assert [r["step"] for r in steps] == [1, 2, 3], [r["step"] for r in rows]
assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in steps), steps
assert (run / "checkpoints" / "latest").read_text().strip(), "no checkpoint"
config = (run / "config.yaml").read_text()
for key in ("name: grpo", "name: math", "decoupled: true", "gradient_checkpointing: true"):
    assert key in config, key
print("recipe shape ran:", [(r["step"], round(r["train/loss"], 4), r.get("length/mean")) for r in steps])
PY
echo "=== recipe check passed"

"""``model.dtype: auto``: the fastest dtype this machine computes well.

bfloat16 halves memory traffic, but on a CPU without bf16 matrix units
(AMX or AVX512-BF16) its matmuls run several times slower than float32
(measured on this project's 2-core CI machine: ~50 vs ~130 GFLOP/s), so
``auto`` picks bfloat16 on a GPU or a CPU with those units, float32
otherwise. Decided without importing torch.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set(cpuinfo.split())
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def resolve_dtype(value: str) -> str:
    """``float32`` / ``bfloat16`` unchanged; ``auto`` chosen for this machine."""
    if value != "auto":
        return value
    return "bfloat16" if has_gpu() or cpu_has_bf16() else "float32"

"""Known-answer vectors of SGLang's GPU tensor hash, made by running SGLang's own triton kernels.

SGLang's ``/weights_checker`` hashes a CUDA tensor with ``gpu_tensor_hash``
(``sglang/kernels/ops/memory/gpu_tensor_hash.py`` in SGLang 0.5.23): the kernel
``hash_tiles32_kernel_blocked`` over tiles of 32-bit words, the tree reduction
``add_tree_reduce_u64_kernel`` of its partial hashes, then ``_final_splitmix64``.
areal ports that algorithm to numpy (``areal_sglang.weight_layout.gpu_hash``)
to compute on the trainer what a GPU server reports; ``test_sglang_weight_digest``
checks the port against the vectors below.

How they were made (no GPU needed): triton's interpreter (``TRITON_INTERPRET=1``)
runs the kernels on CPU tensors. ``gpu_tensor_hash`` itself asserts a CUDA tensor,
so this script repeats its few lines of host code (the word view with zero
padding, the grid, the kernel arguments, the reduction loop, the final mix)
around SGLang's unmodified kernels, loaded from SGLang's source file. Run::

    python -m venv --system-site-packages /tmp/tritonvenv && /tmp/tritonvenv/bin/pip install triton  # 3.9.0 here
    PYTHONPATH=/tmp/tritonvenv/lib/python3.11/site-packages .venv/bin/python \\
        plugins/engines/sglang/tests/gpu_hash_vectors.py /path/to/sglang/kernels/ops/memory/gpu_tensor_hash.py

(``/path/to/sglang`` is the ``sglang`` package of the SGLang 0.5.23 wheel, unpacked); it prints the
``VECTORS`` dict to paste here. Without arguments it checks the port against ``VECTORS`` instead.

On a CUDA machine (a device check: its image has torch and triton, no SGLang; the kernel file is standalone)::

    pip download sglang==0.5.23 --no-deps -d /tmp/sgl && unzip -o -q /tmp/sgl/sglang-0.5.23-*.whl \
        'sglang/kernels/ops/memory/gpu_tensor_hash.py' -d .device   # here; .device is git-ignored, carried
    PYTHONPATH=plugins/engines/sglang python3 plugins/engines/sglang/tests/gpu_hash_vectors.py \
        --cuda .device/sglang/kernels/ops/memory/gpu_tensor_hash.py               # there

runs SGLang's compiled kernel on CUDA tensors against ``VECTORS`` and areal's numpy and torch ports against it
on random tensors, and times the torch port on 1 GiB (:func:`cuda_check`).

The tensors (:func:`vector_tensor`) are bytes of an integer formula viewed as the dtype, so they are the same
on every machine; their sizes cover a few bytes, sizes that are not a multiple of 4 bytes (zero padding), one
tile (8192 words) exactly, several tiles with a partial last one, and more than 1024 tiles (two levels of the
reduction).
"""

from __future__ import annotations

import importlib.util
import os
import sys

# (dtype, number of elements) of each vector
CASES = [("uint8", 1), ("uint8", 7), ("bfloat16", 3), ("float16", 0), ("float32", 1), ("float32", 8192),
         ("bfloat16", 16389), ("int8", 70001), ("float32", 40000), ("bfloat16", 2 * 1100 * 8192 + 6)]

# Made with triton 3.9.0's interpreter from SGLang 0.5.23's kernels (see the module); keys "dtype:numel"
VECTORS: dict[str, str] = {
    "uint8:1": "3d93a6540b54ef2a",
    "uint8:7": "843c8befef5e89fe",
    "bfloat16:3": "2760c3a85edbc637",
    "float16:0": "0000000000000000",
    "float32:1": "832e10af412149e4",
    "float32:8192": "185a46a7e5b677e7",
    "bfloat16:16389": "36da5a8dd7522293",
    "int8:70001": "4c83bee43333007b",
    "float32:40000": "022af4a2463f61c3",
    "bfloat16:18022406": "49cb7b66a314ca4a",
}


def vector_tensor(dtype: str, numel: int):
    """``numel`` elements of ``dtype`` whose bytes are ``(i * 2654435761 >> 13) & 0xFF`` for byte ``i``."""
    import torch

    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size() * numel
    i = torch.arange(size, dtype=torch.int64)
    return ((i * 2654435761) >> 13).bitwise_and(0xFF).to(torch.uint8).view(getattr(torch, dtype))


def kernel_hash(module, tensor) -> int:
    """``gpu_tensor_hash(tensor)`` with its defaults, the host code repeated on a CPU tensor (see the module)."""
    import torch
    import triton

    tb = tensor.contiguous().reshape(-1).view(torch.uint8)
    pad = (4 - (tb.numel() & 3)) & 3
    if pad:
        tb = torch.cat([tb, torch.zeros(pad, dtype=torch.uint8)])
    u32 = tb.view(torch.uint32)
    n = u32.numel()
    if n == 0:
        return 0
    seed, tile_words, block_words, reduce_chunk = 0x243F6A88, 8192, 256, 1024
    partials = torch.empty(triton.cdiv(n, tile_words), dtype=torch.uint64)
    module.hash_tiles32_kernel_blocked[(partials.numel(),)](
        u32, partials, n, seed1=seed & 0xFFFFFFFF, seed2=((seed * 0x9E3779B1) ^ 0xDEADBEEF) & 0xFFFFFFFF,
        FM_C1=module.FMIX32_C1, FM_C2=module.FMIX32_C2, POS_A=module.POS_C1, POS_B=module.POS_C2,
        TILE=tile_words, BLOCK=block_words, USE_CG=True, num_warps=4, num_stages=4)
    cur = partials
    while cur.numel() > 1:
        nxt = torch.empty(triton.cdiv(cur.numel(), reduce_chunk), dtype=torch.uint64)
        module.add_tree_reduce_u64_kernel[(nxt.numel(),)](cur, nxt, cur.numel(), CHUNK=reduce_chunk)
        cur = nxt
    return module._final_splitmix64(int(cur.item()))


def cuda_check(module) -> int:
    """On a CUDA machine: SGLang's own ``gpu_tensor_hash`` (compiled triton, CUDA tensors) against the vectors,
    and areal's two ports (numpy on the CPU, torch on the GPU) against it on larger random tensors; the torch
    port's speed on a 1 GiB tensor. Returns the number of mismatches."""
    import time

    import torch

    from areal_sglang.weight_layout import _gpu_hash_numpy, _gpu_hash_torch

    bad = 0
    for key, want in VECTORS.items():
        got = f"{module.gpu_tensor_hash(vector_tensor(*_case(key)).cuda()):016x}"
        print(f"SGLang's kernel on CUDA, {key}: {got} {'ok' if got == want else 'DIFFERS from ' + want}")
        bad += got != want
    gen = torch.Generator().manual_seed(0)
    for dtype, numel in (("bfloat16", 3 * 8192 * 1024 + 5), ("float32", 10**7 + 3), ("float16", 123457)):
        t = torch.randn(numel, generator=gen).to(getattr(torch, dtype))
        want = module.gpu_tensor_hash(t.cuda())
        ports = {"numpy": _gpu_hash_numpy(t),
                 "torch-cuda": _gpu_hash_torch(t.cuda(), torch.device("cuda"))}
        for name, value in ports.items():
            print(f"random {dtype}[{numel}]: {name} port {'ok' if value == want else 'DIFFERS'}")
            bad += value != want
    big = torch.randn(2**28, generator=gen).to(torch.float32).cuda()  # 1 GiB
    _gpu_hash_torch(big, big.device)
    torch.cuda.synchronize()
    began = time.perf_counter()
    _gpu_hash_torch(big, big.device)
    torch.cuda.synchronize()
    ours = time.perf_counter() - began
    began = time.perf_counter()
    module.gpu_tensor_hash(big)
    torch.cuda.synchronize()
    print(f"1 GiB on {torch.cuda.get_device_name()}: areal's torch port {ours:.3f} s, SGLang's kernel "
          f"{time.perf_counter() - began:.3f} s")
    return bad


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--cuda":
        spec = importlib.util.spec_from_file_location("sglang_gpu_tensor_hash", sys.argv[2])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.exit(1 if cuda_check(module) else 0)
    if len(sys.argv) < 2:
        from areal_sglang.weight_layout import gpu_hash

        bad = [k for k, v in VECTORS.items() if f"{gpu_hash(vector_tensor(*_case(k))):016x}" != v]
        print("the port matches every vector" if not bad else f"the port differs on {bad}")
        sys.exit(1 if bad else 0)
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    spec = importlib.util.spec_from_file_location("sglang_gpu_tensor_hash", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    print("VECTORS = {")
    for dtype, numel in CASES:
        print(f'    "{dtype}:{numel}": "{kernel_hash(module, vector_tensor(dtype, numel)):016x}",', flush=True)
    print("}")


def _case(key: str) -> tuple[str, int]:
    dtype, numel = key.split(":")
    return dtype, int(numel)


if __name__ == "__main__":
    main()

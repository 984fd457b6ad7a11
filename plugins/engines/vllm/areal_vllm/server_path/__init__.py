"""Modules the vLLM server process imports (its PYTHONPATH holds this folder): areal_vllm_worker."""

"""Modules the SGLang server process imports (its PYTHONPATH holds this folder): areal_sglang_launch."""

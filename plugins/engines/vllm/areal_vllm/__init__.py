"""areal-plugin-vllm: the vLLM inference engine (backend ``vllm``).

For now the plugin declares the backend's placement and checks plans; the
engine itself lands with issue 9.
"""

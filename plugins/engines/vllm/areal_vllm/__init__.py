"""areal-plugin-vllm: the vLLM inference engine (backend ``vllm``).

``hooks`` declares the backend's placement and checks plans; ``engine`` is the
client of vLLM servers (entry point ``areal.engines.inference: vllm``).
"""

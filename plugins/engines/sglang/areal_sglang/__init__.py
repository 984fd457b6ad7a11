"""areal-plugin-sglang: the SGLang inference engine (backend ``sglang``).

``hooks`` declares the backend's placement and checks plans; ``engine`` is the
client of SGLang servers (entry point ``areal.engines.inference: sglang``).
"""

"""areal-plugin-sglang: the SGLang inference engine (backend ``sglang``).

For now the plugin declares the backend's placement and checks plans; the
engine itself lands with issue 9.
"""

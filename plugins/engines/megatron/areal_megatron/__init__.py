"""areal-plugin-megatron: the Megatron-Core train engine (backend ``megatron``).

For now the plugin declares the backend's placement and checks plans; the
engine itself lands with issue 10.
"""

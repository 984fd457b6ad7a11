"""areal-plugin-fsdp: the PyTorch FSDP2 train engine (backend ``fsdp``).

For now the plugin declares the backend's placement and checks plans; the
engine itself lands with issue 5.
"""

"""areal-plugin-fsdp: the PyTorch FSDP2 train engine (backend ``fsdp``).

:mod:`areal_fsdp.hooks` declares the backend's placement and checks plans
(no torch import); :mod:`areal_fsdp.engine` is the engine itself, imported
only when ``actor.backend: fsdp`` is selected.
"""

"""An areal plugin: the exact-match reward and its CLI command.

Nothing is imported here: areal imports ``areal_example.hooks`` on every
``areal`` call and ``areal_example.reward`` only when a run selects it.
"""

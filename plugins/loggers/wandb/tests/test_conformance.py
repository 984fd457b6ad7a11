"""The checks every component kind shares: the entry point resolves, `areal plugins` lists it cleanly."""

from areal_core.testing import ComponentConformance


class TestWandbLogger(ComponentConformance):
    kind = "logger"
    component_name = "wandb"

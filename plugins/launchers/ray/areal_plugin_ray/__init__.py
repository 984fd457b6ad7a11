"""areal's Ray launcher: ``areal run ... launcher.name=ray``."""

"""areal single-turn RLVR workflow."""

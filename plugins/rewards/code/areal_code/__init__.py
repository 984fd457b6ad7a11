"""The sandboxed code reward for areal (imported only when a run selects it)."""

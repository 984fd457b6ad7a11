"""areal multi-turn workflow: model turns and environment replies, token-in / token-out."""

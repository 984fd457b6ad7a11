"""areal agent workflow: an OpenAI-compatible proxy in front of the rollout controller's engine."""

"""The PPO family of areal algorithms (``areal-plugin-ppo``); see docs/algorithms.md."""

__version__ = "0.1.0"

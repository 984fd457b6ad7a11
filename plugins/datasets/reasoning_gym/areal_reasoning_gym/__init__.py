"""areal over reasoning-gym: its offline task generators as a dataset, its verifiers as a reward."""

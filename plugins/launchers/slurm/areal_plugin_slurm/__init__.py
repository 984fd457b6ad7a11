"""areal on SLURM: ``launcher.name: slurm`` runs a whole run as one batch job (see README.md)."""

"""The ``areal`` command line (Typer)."""

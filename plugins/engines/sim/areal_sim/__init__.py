"""Simulated engines for areal: the real controller and trainer loop against modelled latencies (work in progress:
the latency profiles first)."""

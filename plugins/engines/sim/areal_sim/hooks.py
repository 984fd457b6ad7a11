"""Placement declaration of the ``sim`` inference backend.

A simulated server models one server of the profile's tensor-parallel size,
on GPUs or on CPU: every layout the core accepts for data and tensor
parallelism is accepted, since nothing runs on the devices.
"""

from __future__ import annotations

from areal_core.parallelism import declare_backend

areal_declare_backends = declare_backend(
    "sim", "inference", dims="dt", devices=("gpu", "cpu"),
    description="simulated inference servers: modelled latencies from a profile (areal-plugin-sim)")

"""Measurement of `vase_jax` (not installed with the library: pyproject packages only `vase_jax` and
`pallas_kernels`). Run from the repository root, one entry point per mode:

    python -m benchmarks.bench ...         decode speed, memory and eviction cost of `generate`; its workloads
    python -m benchmarks.kernels ...       the Pallas kernels against their XLA twins; the decode kernel's sweep
    python -m benchmarks.device_check ...  the one check on a GPU or TPU, in phases under a time budget

Shared by every mode: `timing` (the one timing loop and the one bandwidth probe), `decode_step` (a decode step and
an eviction event timed alone on filled caches, and the bytes a step reads), `workload` (the AIME25 protocol
measured in windows and projected) and `report` (number formats, the names of a row, tables, JSON files). Named
model shapes are the library's (`vase_jax.random_model.named_configs`).
"""

"""Measuring a step: the op-by-op timing interpreter, peak memory and wall time, clocks, transfer
probes under compute, and the offload directory's calibration.

Nothing here imports :mod:`teraio.lifecycle`: measurements are handed to the backend, not fetched by it.
"""

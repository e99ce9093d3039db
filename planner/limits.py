"""The largest numbers and files teraio accepts as input, in one place (docs/safety.md lists them).

Profiles, plans, hardware models and command-line options are untrusted input. A tensor of 2**62 bytes,
a count of 10**30 devices or a 10**8-layer synthetic model is a corrupt or hostile file (or a typo),
not a machine: such numbers overflow the int64 arithmetic of pandas and numpy (sums wrap silently), or
make the planner build tables without bound, or end in a traceback far from the input that caused
them. So every loader and option checks its numbers against these limits and refuses, in one line
naming the field, what lies beyond them. Each limit is far above any real machine or model and far
below where the arithmetic breaks: a step's tensors together stay below ``MAX_STEP_NBYTES``, whose
sums of a few thousand terms fit int64 with room to spare.

Pure Python, no imports: the planner's loaders and the CLI share it.
"""

from __future__ import annotations

#: One tensor (a profile row, a plan decision): 256 TiB, a hundred times the largest accelerator memory.
MAX_TENSOR_NBYTES = 1 << 48
#: Any byte count that sums a step (a budget, a peak, a profile's ``other_bytes``, a tier's capacity):
#: 64 PiB. Also the largest size the CLI's size options accept.
MAX_STEP_NBYTES = 1 << 56
#: Rows of a profile table (ops or tensors) and decisions of a plan; also the largest op index.
MAX_ROWS = 10_000_000
#: Any duration in seconds a file holds (a step time, a latency, a per-transfer cost): about 31 years.
MAX_SECONDS = 1e9
#: One op's duration in microseconds (``duration_us``, ``recompute_us``): about 11.6 days.
MAX_OP_US = 1e12
#: A solver time limit, in seconds (``--time-limit``): about 11.6 days.
MAX_TIME_LIMIT_S = 1e6
#: A bandwidth per device, bytes per second: 1 PB/s.
MAX_BW_BYTES_PER_S = 1e15
#: The compute time one moved byte may cost, in seconds (``cpu_s_per_byte``): one second per byte.
MAX_CPU_S_PER_BYTE = 1.0
#: Devices striped together in one tier (a hardware model's ``count``, ``--ssds``).
MAX_DEVICES = 4096
#: Solver worker threads (``--workers``).
MAX_WORKERS = 1024
#: Steps a command runs or profiles (``demo --steps``, ``profile --steps``), and rows it lists (``--top``).
MAX_STEPS = 100_000
#: Repeats of a calibration measurement (``calibrate --repeats``).
MAX_REPEATS = 10_000
#: The largest JSON document teraio reads (a plan, a hardware model, a profile's meta.json or index.json).
MAX_JSON_FILE_NBYTES = 256 << 20
#: The largest profile table (``ops.parquet``, ``tensors.parquet``) teraio reads.
MAX_TABLE_FILE_NBYTES = 4 << 30
#: A synthetic profile (``teraio synth``, ``planner.synth``): layers, and each of hidden, seq, batch,
#: vocab (its largest tensor must also stay within ``MAX_TENSOR_NBYTES``). ``teraio estimate`` bounds its
#: ``--layers``, ``--batch`` and ``--seq`` by the same figures.
MAX_SYNTH_LAYERS = 1024
MAX_SYNTH_DIM = 1 << 24
#: ``teraio synth --tflops``: matmul throughput in TFLOP/s.
MAX_TFLOPS = 1e6

__all__ = [
    "MAX_BW_BYTES_PER_S",
    "MAX_CPU_S_PER_BYTE",
    "MAX_DEVICES",
    "MAX_JSON_FILE_NBYTES",
    "MAX_OP_US",
    "MAX_REPEATS",
    "MAX_ROWS",
    "MAX_SECONDS",
    "MAX_STEPS",
    "MAX_STEP_NBYTES",
    "MAX_SYNTH_DIM",
    "MAX_SYNTH_LAYERS",
    "MAX_TABLE_FILE_NBYTES",
    "MAX_TENSOR_NBYTES",
    "MAX_TFLOPS",
    "MAX_TIME_LIMIT_S",
    "MAX_WORKERS",
]

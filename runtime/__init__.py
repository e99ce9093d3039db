"""teraio's offload runtime: move tensors to SSD (O_DIRECT or kvikio/GDS) or host memory and back.

Never imports ``planner`` or ``teraio``: it executes named requests, it does not read plans.
"""

from teraio.runtime.config import RuntimeConfig, parse_nbytes
from teraio.runtime.engine import Engine
from teraio.runtime.handle import Handle
from teraio.runtime.stats import DirStats, RuntimeStats, TransferStats

__all__ = [
    "DirStats",
    "Engine",
    "Handle",
    "RuntimeConfig",
    "RuntimeStats",
    "TransferStats",
    "parse_nbytes",
]

"""Storage tiers behind one small protocol: POSIX files, kvikio/GPUDirect Storage, host memory."""

from teraio.runtime.tiers.base import Chunk, Placement, Tier

__all__ = ["Chunk", "Placement", "Tier"]

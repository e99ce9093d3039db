"""Handles: the asynchronous result of an offload or a prefetch.

A handle is a ``concurrent.futures.Future`` completed by the engine's I/O threads and waited on by the
training thread, so it composes with ``concurrent.futures.wait``/``as_completed``. On top of the Future
it adds ``wait()`` (block, re-raise the runtime's typed error, return nothing) and charges the time the
caller spent blocked to the engine's stall counter, the number that tells whether I/O is hidden behind
compute. For device tensors the handle completes on the host side; the ordering of device streams is
the engine's job (``fetch`` makes the caller's stream wait for the read).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any, Literal

HandleKind = Literal["offload", "prefetch"]


class Handle(concurrent.futures.Future):
    """Completion of one request (``kind`` "offload" or "prefetch") for ``key``."""

    def __init__(self, key: str, kind: HandleKind, on_stall: Callable[[float], None] | None = None) -> None:
        super().__init__()
        self.key = key
        self.kind = kind
        self._on_stall = on_stall

    @classmethod
    def completed(cls, key: str, kind: HandleKind, result: Any = None) -> Handle:
        """A handle that is already done (zero-size data, forwarding from memory)."""
        handle = cls(key, kind)
        handle.set_result(result)
        return handle

    def result(self, timeout: float | None = None) -> Any:
        """Wait, then return the request's value (None: a prefetch's bytes come back through ``fetch``).

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            RuntimeIOError: the request failed (the subclass says why).
        """
        if self.done():
            return super().result()
        t0 = time.perf_counter()
        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{self.kind} of {self.key!r} still running after {timeout} s") from None
        finally:
            if self._on_stall is not None:
                self._on_stall(time.perf_counter() - t0)

    def cancel(self) -> bool:
        """Requests cannot be cancelled once submitted (their chunks are queued on I/O threads): False."""
        return False

    def wait(self, timeout: float | None = None) -> None:
        """Block until the request finishes; re-raise its typed error (see :meth:`result`)."""
        self.result(timeout)

    def failed(self) -> bool:
        """True when the request finished with an error (never blocks)."""
        return self.done() and not self.cancelled() and self.exception(timeout=0) is not None

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self.failed() else "done")
        return f"Handle({self.kind} {self.key!r}, {state})"

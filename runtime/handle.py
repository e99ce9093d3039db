"""Handles: the asynchronous result of an offload or a prefetch.

A handle is completed by an I/O thread and waited on by the training thread. It follows
``concurrent.futures.Future`` (``done``, ``wait``, ``result``, ``exception``, ``add_done_callback``),
re-raises the runtime's typed error on ``wait()`` and charges the time spent blocked to the engine's
stall counter, the number that tells whether I/O is hidden behind compute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class Handle:
    """Completion of one request (``kind`` is "offload" or "prefetch") for ``key``."""

    def __init__(self, key: str, kind: str, on_stall: Callable[[float], None] | None = None) -> None:
        self.key = key
        self.kind = kind
        self._event = threading.Event()
        self._result: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[Handle], None]] = []
        self._lock = threading.Lock()
        self._on_stall = on_stall

    @classmethod
    def completed(cls, key: str, kind: str, result: Any = None) -> Handle:
        """A handle that is already done (zero-size data, forwarding from memory)."""
        handle = cls(key, kind)
        handle._set_result(result)
        return handle

    def done(self) -> bool:
        """True when the request finished, successfully or not."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the request finishes; re-raise its typed error.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
            RuntimeIOError: the request failed (the subclass says why).
        """
        if not self._event.is_set():
            t0 = time.perf_counter()
            finished = self._event.wait(timeout)
            if self._on_stall is not None:
                self._on_stall(time.perf_counter() - t0)
            if not finished:
                raise TimeoutError(f"{self.kind} of {self.key!r} still running after {timeout} s")
        if self._exc is not None:
            raise self._exc

    def result(self, timeout: float | None = None) -> Any:
        """Wait, then return the request's value (None: the bytes of a prefetch come back through ``fetch``)."""
        self.wait(timeout)
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait, then return the request's error or None."""
        try:
            self.wait(timeout)
        except TimeoutError:
            raise
        except BaseException as exc:  # noqa: BLE001 - returned, not swallowed
            return exc
        return None

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(handle)`` when done (at once, in this thread, if it already is)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _set_result(self, result: Any) -> None:
        self._result = result
        self._finish()

    def _set_exception(self, exc: BaseException) -> None:
        self._exc = exc
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exc else "done")
        return f"Handle({self.kind} {self.key!r}, {state})"

"""Profiler sessions that span compiled calls never corrupt the heap (Note: [A session never ends under
another session's record functions] in teraio.profiling.measure).

A record function that starts while one torch profiler session records and ends while a later one
records makes torch write into the first session's freed event storage. Dynamo opens one around every
compiled frame, so a session stopped inside a compiled call and another started before that call returns
corrupt the heap: the GAN with two backends crashed in about one run in ten that way.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import teraio.profiling.measure as measure
from teraio.profiling.measure import MemoryRecorder, ProfilerBusyError


def _compiled_with_hook():
    """A compiled function that runs ``hook[0]()`` inside its compiled call (where a backend's code runs)."""
    hook = [lambda: None]

    def backend(gm, example_inputs):
        def run(*args):
            hook[0]()
            return gm(*args)

        return run

    torch._dynamo.reset()
    f = torch.compile(lambda x: (x @ x).relu().sum(), backend=backend)
    x = torch.randn(32, 32)
    f(x)  # compiled outside any session
    return f, x, hook


def test_no_session_starts_inside_the_compiled_call_a_spanning_session_stopped_in() -> None:
    f, x, hook = _compiled_with_hook()
    first, second = MemoryRecorder("cpu"), MemoryRecorder("cpu")
    seen: dict[str, object] = {}

    hook[0] = first.start  # a step's measurement: starts in one compiled call...
    f(x)

    def stop_then_start() -> None:  # ...and stops in a later one; a second measurement tries to start
        first.stop()
        try:
            second.start()
        except ProfilerBusyError as e:
            seen["refused"] = str(e)
            census = MemoryRecorder("cpu")  # a session inside this call ends before the call: allowed
            census.start(local=True)
            census.stop()
            seen["local"] = True
        else:
            second.stop()  # stopped in this call: no harm done, but the start should have been refused
            seen["refused"] = None

    hook[0] = stop_then_start
    f(x)
    assert seen["refused"] is not None, "a session started inside the compiled call another stopped in"
    assert "later call" in seen["refused"]
    assert seen["local"]
    # Outside the compiled call, the record functions it opened have ended: starting is safe.
    second.start()
    second.stop()
    measure.settle_profiler_barriers()
    assert not measure._barriers


def test_a_session_stopped_outside_compiled_calls_leaves_no_barrier() -> None:
    measure.settle_profiler_barriers()  # none left running by earlier tests
    rec = MemoryRecorder("cpu")
    rec.start()
    torch.randn(64).sum()
    rec.stop()
    assert not measure._barriers
    rec.start()
    rec.stop()


# Without the barrier, this crashed in every run (SIGSEGV or SIGABRT, often well before the last call).
_SWITCHING = textwrap.dedent(
    """
    import torch
    from teraio.profiling.measure import MemoryRecorder, ProfilerBusyError

    recs = []

    def switch():  # one measurement stops and the next starts inside the same compiled call
        if recs:
            recs.pop().stop()
        rec = MemoryRecorder("cpu")
        try:
            rec.start()
        except ProfilerBusyError:
            return
        recs.append(rec)

    def backend(gm, example_inputs):
        def run(*args):
            switch()
            return gm(*args)
        return run

    f = torch.compile(lambda x: (x @ x).relu().sum(), backend=backend)
    x = torch.randn(64, 64)
    for _ in range(600):
        for _ in range(5):
            torch.randn(64, 64) @ torch.randn(64, 64)
        f(x)
    if recs:
        recs.pop().stop()
    print("survived")
    """
)


@pytest.mark.slow
def test_switching_sessions_across_compiled_calls_does_not_corrupt_the_heap() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _SWITCHING], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0 and "survived" in proc.stdout, (proc.returncode, proc.stderr[-2000:])

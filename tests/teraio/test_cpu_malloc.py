"""``teraio demo``'s CPU allocator setting (Note: [Freed CPU memory and step time] in teraio.platform.cpu_malloc).

Each case runs in its own interpreter: the setting changes the whole process and cannot be undone.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

FAULTS_PER_STEP = """
import json, resource, sys, threading
import torch
from teraio.platform.cpu_malloc import apply_cpu_malloc
mode = apply_cpu_malloc(sys.argv[1])
faults = []
sizes = [n << 20 for n in (3, 40, 8, 64, 5, 16, 64, 12)]
def steps():
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held = []
        for n in sizes:  # a step's activations pile up, then all go
            held.append(torch.empty(n, dtype=torch.uint8))
            held[-1].fill_(1)  # touch every page
        del held
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
if sys.argv[2] == "main":
    steps()
else:  # a thread started after the call (a training loop or a loader run outside the main thread)
    t = threading.Thread(target=steps)
    t.start()
    t.join()
print(json.dumps({"mode": mode, "faults": faults}))
"""


def _faults(mode: str, thread: str = "main") -> dict:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_STEP, mode, thread], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.parametrize("thread", ["main", "other"])
def test_retained_memory_is_reused_without_faulting_it_in_again(thread: str) -> None:
    """Steps that allocate 212 MiB of tensors and free them: glibc's default unmaps the large blocks and
    every step faults them in again; retained, steps after the first few reuse the same pages (a step
    may still fault in a new block where the heap's free space was split differently). The same in the
    first thread a fresh interpreter starts after the call, which glibc would give a new arena whose heaps
    cannot hold a 64 MiB block (Note: [Freed CPU memory and step time])."""
    released, retained = _faults("release", thread), _faults("retain", thread)
    assert released["mode"] == "release" and retained["mode"] == "retain"
    steady_released = statistics.median(released["faults"][4:])
    steady_retained = statistics.median(retained["faults"][4:])
    assert steady_released >= (64 << 20) // (2 << 20)  # at least one fresh 64 MiB, even in huge pages
    assert steady_retained < 0.25 * steady_released


def test_release_after_retain_says_it_still_retains() -> None:
    code = "from teraio.platform.cpu_malloc import apply_cpu_malloc as a; print(a('retain'), a('release'), a('retain'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["retain", "retain", "retain"]
    assert "cannot undo" in out.stderr

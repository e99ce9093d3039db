"""torch 2.13 (CPU): a record function that outlives one profiler session into the next writes into freed
memory. No teraio: torch only. Cause of the GAN test's crashes (gan_two_backends_crash_202611.md).

A RecordFunction keeps the profiler callbacks that were active when it started; when it ends, the
profiler's exit callback (torch/csrc/autograd/profiler_kineto.cpp, onFunctionExit) returns early only if
*no* session is active on the thread now, and otherwise writes the end time and the thread id (8 bytes
each) into the event its start allocated, in the first session's event storage, which that session's stop
freed (ThreadLocalSubqueue::TorchOpStorage::materialize). Dynamo opens such a record function around every
compiled frame ("Torch-Compiled Region"), so stopping one session and starting another inside one compiled
call is enough.

    python benchmarks/results/profiler_stale_record_function_repro.py MODE [N]

MODE:
    cross     a record_function opened under session 1 ends under session 2 (session 1 stopped inside it)
    dynamo    the same with no record_function of ours: a torch.compile'd function whose backend stops
              session 1 and starts session 2 inside the compiled call
    nosecond  control: as cross, but no session is active when the record function ends
    inside    control: the record function opens and ends inside session 1

Seen on the 2-core VM, N=2000 (default): cross 3 of 3 runs and dynamo 3 of 3 runs died (SIGSEGV, once
SIGABRT "munmap_chunk(): invalid pointer"); nosecond and inside 3 of 3 runs each printed "survived".
Under valgrind (PYTHONMALLOC=malloc), `cross 2` reports "Invalid write of size 8" in
onFunctionExit<false> into "a block of size 77,840 free'd" by TorchOpStorage::materialize under
_disable_profiler.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

_S: dict[str, profile] = {}


def _start() -> None:
    p = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    p.__enter__()
    _S["p"] = p


def _stop() -> None:
    _S.pop("p").__exit__(None, None, None)


def _work() -> None:
    for _ in range(20):
        torch.randn(64, 64) @ torch.randn(64, 64)


def main(mode: str, n: int) -> None:
    if mode == "dynamo":

        def backend(gm, example_inputs):
            def run(*args):
                if "p" in _S:  # switch sessions inside the compiled call, as a backend that measures might
                    _stop()
                    _start()
                return gm(*args)

            return run

        f = torch.compile(lambda x: (x @ x).relu(), backend=backend)
        x = torch.randn(64, 64)
        f(x)  # compiled outside any session
        for _ in range(n):
            _start()
            _work()
            f(x)  # Dynamo's record function opens under session 1 and ends under session 2
            _work()
            _stop()
    else:
        for _ in range(n):
            _start()
            rf = record_function("outer")
            rf.__enter__()
            _work()
            if mode == "inside":
                rf.__exit__(None, None, None)
            _stop()
            if mode == "cross":
                _start()
                _work()
                rf.__exit__(None, None, None)  # ends under session 2: writes into session 1's freed events
                _stop()
            elif mode == "nosecond":
                rf.__exit__(None, None, None)  # no session active: the exit callback returns early
                _start()
                _work()
                _stop()
            else:
                _start()
                _work()
                _stop()
    print("survived", mode, n, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2000)

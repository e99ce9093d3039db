"""Many threads issuing offload/prefetch/fetch/release/drop in random order must never see a wrong bit."""

from __future__ import annotations

import random
import threading

import torch

from teraio.runtime.errors import UnknownKeyError


def test_concurrent_random_interleaving(make_engine):
    eng = make_engine(checksum=True, io_threads=3)
    nthreads, keys_per_thread, ops = 4, 12, 150
    errors: list[BaseException] = []
    shared = torch.randn(64, 1024)  # views of it are offloaded by every thread: dedup under races

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        truth: dict[str, torch.Tensor] = {}
        try:
            for _ in range(ops):
                key = f"t{tid}.k{rng.randrange(keys_per_thread)}"
                op = rng.choice(["offload", "offload", "release", "prefetch", "fetch", "fetch", "drop"])
                if op == "offload":
                    if rng.random() < 0.3:
                        row = rng.randrange(60)
                        t = shared[row : row + 4]
                    else:
                        n = rng.choice([1, 1000, 4096, 70_001, 200_000])
                        t = torch.randint(0, 1 << 30, (n,), dtype=torch.int64)
                    eng.offload(key, t)
                    truth[key] = t.clone()
                elif key not in truth:
                    continue
                elif op == "release":
                    eng.release(key)
                elif op == "prefetch":
                    eng.prefetch(key)
                elif op == "fetch":
                    out = eng.fetch(key)
                    assert torch.equal(out, truth[key]), f"wrong bits for {key}"
                    assert out.stride() == truth[key].stride() or truth[key].numel() <= 1
                else:
                    eng.drop(key)
                    del truth[key]
                    try:
                        eng.fetch(key)
                        raise AssertionError("fetch after drop succeeded")
                    except UnknownKeyError:
                        pass
            for key, t in truth.items():
                eng.release(key)
                assert torch.equal(eng.fetch(key), t)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors[0]
    st = eng.stats()
    assert st.checksum_failures == 0
    assert st.transfers[f"{eng.default_tier}.write"].requests > 0

"""Small hand-made profiles and hardware for the planner tests (no synth, no tracing)."""

from __future__ import annotations

from teraio.planner.hardware import HardwareModel, TierModel
from teraio.planner.profile import Profile, make_profile

MB = 10**6


def ops_rows(durations_us: list[float], num_fwd_ops: int, other_bytes: list[int] | None = None) -> list[dict]:
    rows = []
    for i, dur in enumerate(durations_us):
        row = {
            "idx": i,
            "name": f"op{i}",
            "target": "aten.mm",
            "phase": "fwd" if i < num_fwd_ops else "bwd",
            "duration_us": float(dur),
            "module": f"blocks.{i % num_fwd_ops}",
        }
        if other_bytes is not None:
            row["other_bytes"] = int(other_bytes[i])
        rows.append(row)
    return rows


def act(
    name: str,
    nbytes: int,
    producer: int,
    last_fwd: int,
    first_bwd: int,
    last_use: int | None = None,
    offloadable: bool = True,
) -> dict:
    return {
        "name": name,
        "nbytes": int(nbytes),
        "dtype": "float32",
        "shape": (int(nbytes) // 4,),
        "kind": "activation",
        "offloadable": offloadable,
        "producer_idx": producer,
        "last_fwd_use_idx": last_fwd,
        "first_bwd_use_idx": first_bwd,
        "last_use_idx": first_bwd if last_use is None else last_use,
        "module": f"blocks.{producer}",
    }


def param(name: str, nbytes: int) -> dict:
    return {
        "name": name,
        "nbytes": int(nbytes),
        "dtype": "float32",
        "shape": (int(nbytes) // 4,),
        "kind": "param",
        "offloadable": False,
        "producer_idx": -1,
        "last_fwd_use_idx": 0,
        "first_bwd_use_idx": -1,
        "last_use_idx": 0,
        "module": "",
    }


def pyramid(duration_us: float = 1000.0, fingerprint: str = "pyramid") -> Profile:
    """4 forward ops each saving 100 MB (t0..t3), used again in reverse by 4 backward ops.

    Memory per op (MB): 100 200 300 400 | 400 300 200 100. t3 is used by the first backward op right
    after its producer, so it is no candidate. Idle windows: t0 ops 2..6, t1 3..5, t2 4..4.
    """
    tensors = [act(f"t{k}", 100 * MB, k, k + 1 if k < 3 else k, 7 - k) for k in range(4)]
    return make_profile(ops_rows([duration_us] * 8, 4), tensors, {"fingerprint": fingerprint})


def ssd_only(
    write_bw: float = 1e9,
    read_bw: float = 0.5e9,
    latency_s: float = 0.0,
    count: int = 1,
    shared: bool = False,
    cpu_s_per_byte: float = 0.0,
    cpu_s_per_transfer: float = 0.0,
    cpu_s_per_step_with_io: float = 0.0,
) -> HardwareModel:
    return HardwareModel(
        tiers={
            "ssd": TierModel(
                write_bw_bytes_per_s=write_bw,
                read_bw_bytes_per_s=read_bw,
                write_latency_s=latency_s,
                read_latency_s=latency_s,
                count=count,
                cpu_s_per_transfer=cpu_s_per_transfer,
                cpu_s_per_step_with_io=cpu_s_per_step_with_io,
                shared_channel=shared,
                cpu_s_per_byte=cpu_s_per_byte,
            ),
            "host": TierModel(write_bw_bytes_per_s=1e10, read_bw_bytes_per_s=1e10, capacity_bytes=0),
        },
        name="test",
    )


def rebuilt(row: dict, recompute_us: float, inputs: tuple[str, ...] = (), peak_bytes: int = 0) -> dict:
    """``row`` with a rebuild recipe (the profile's recompute columns)."""
    return {
        **row,
        "recompute_us": float(recompute_us),
        "recompute_inputs": inputs,
        "recompute_peak_bytes": peak_bytes,
    }


def chain(duration_us: float = 1000.0, fingerprint: str = "chain") -> Profile:
    """4 forward and 4 backward ops of ``duration_us``; rebuild recipes that chain.

    - ``x`` (100 MB, op 0) dies in forward (last use op 1): no candidate, but ``c``'s rebuild reads it.
    - ``a`` (100 MB, op 0, idle 2..6) rebuilds from param ``w`` in 500 us.
    - ``b`` (100 MB, op 1, idle 3..5) rebuilds from ``a`` in 300 us, holding 50 MB meanwhile.
    - ``c`` (100 MB, op 2, idle 4..4) rebuilds from ``x`` and ``b`` in 200 us.

    Unplanned memory per op (MB): 200 300 300 300 | 300 300 200 100.
    """
    nan = float("nan")
    tensors = [
        rebuilt(param("w", MB), nan),
        rebuilt(act("x", 100 * MB, 0, 1, -1, last_use=1), nan),
        rebuilt(act("a", 100 * MB, 0, 1, 7), 500.0, ("w",)),
        rebuilt(act("b", 100 * MB, 1, 2, 6), 300.0, ("a",), 50 * MB),
        rebuilt(act("c", 100 * MB, 2, 3, 5), 200.0, ("x", "b")),
    ]
    return make_profile(ops_rows([duration_us] * 8, 4), tensors, {"fingerprint": fingerprint})


def block(
    h1_us: float = 100.0,
    h2_us: float = 200.0,
    duration_us: float = 1000.0,
    fingerprint: str = "block",
    x_offloadable: bool = True,
) -> Profile:
    """A block rebuildable from its input, as activation checkpointing sees it: 4 forward and 4 backward
    ops of ``duration_us``; 100 MB each.

    - ``x`` (op 0, used again by op 7): the block input, not recomputable.
    - ``h1`` (op 1, idle 2..5) rebuilds from ``x`` in ``h1_us``; ``h2`` (op 2, idle 3..4) from ``h1`` in
      ``h2_us``.

    Unplanned memory per op (MB): 100 200 300 300 | 300 300 200 100.
    """
    nan = float("nan")
    tensors = [
        rebuilt(act("x", 100 * MB, 0, 1, 7, offloadable=x_offloadable), nan),
        rebuilt(act("h1", 100 * MB, 1, 1, 6), h1_us, ("x",)),
        rebuilt(act("h2", 100 * MB, 2, 2, 5), h2_us, ("h1",)),
    ]
    return make_profile(ops_rows([duration_us] * 8, 4), tensors, {"fingerprint": fingerprint})
